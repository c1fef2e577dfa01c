#pragma once

// A transport whose enqueue() runs the whole plan before it returns, on the calling thread:
// the lifecycle, fault semantics, phase marks and waits of transport.hpp for a "device" that is
// the CPU. There are no streams and no events: every stream given must be nullptr, every phase
// event is nullptr (the plan has run when enqueue() returns), every wait must name nullptr
// events. A failure is kept for wait(), as a device transport reports one.
//
// The two of them differ only in what running an op means:
//   host_transport     copies the op's rows (memcpy) between host ranks' memory
//   dry_run_transport  moves nothing and counts the bytes
// so a derived class gives validate() and run_ops(); this class does the rest once.

#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <vector>

#include "moebius/plan/plan.hpp"
#include "moebius/transport/transport.hpp"

namespace moebius {

class synchronous_transport : public transport {
 public:
  int num_ranks() const final { return num_ranks_; }
  // Every rank, 0..P-1: one process drives them all.
  std::vector<int> local_ranks() const final;
  // Validates `p`, then runs its phases in order up to an armed fault (run_ops); `streams` must
  // be empty or all nullptr.
  void enqueue(const plan& p, std::span<const stream_handle> streams = {}) final;
  bool poll() final { return true; }
  void wait() final;
  int64_t completed_phases() const final { return completed_phases_; }
  // Fires before op `at.op` of phase `at.phase` with `at.code` (any code: there is no device
  // to leave in doubt, so a test can stand a timeout or a device error in for a dead peer).
  void inject_fault(std::optional<fault_point> at) final { fault_ = at; }
  void mark_phases(std::span<const int64_t> after_phases) final;
  void wait_before_phases(std::span<const phase_wait> waits) final;
  event_handle phase_event(size_t mark, size_t local_index) const final;

  // Plans enqueue() accepted (validated and started) since construction.
  int64_t plans_run() const { return plans_run_; }

 protected:
  // `name` heads every message ("host_transport::enqueue: ..."); `no_streams` says why a stream
  // or an event must be nullptr ("host memory has no streams"). Both must outlive the object
  // (string literals). Throws errc::invalid_argument unless num_ranks >= 1.
  synchronous_transport(int num_ranks, const char* name, const char* no_streams);

  // Runs the first `num_ops` ops of `phase` (all of them, or those before an injected fault:
  // then num_ops < phase.ops.size() and the phase fails after them). The plan was validated.
  virtual void run_ops(const plan_phase& phase, size_t num_ops) = 0;

 private:
  int num_ranks_;
  const char* name_;
  const char* no_streams_;
  std::optional<fault_point> fault_;
  std::vector<int64_t> pending_marks_;
  size_t num_marks_ = 0;  // marks the last plan reached
  int64_t completed_phases_ = 0;
  bool outstanding_ = false;
  std::exception_ptr failure_;
  int64_t plans_run_ = 0;
};

}  // namespace moebius
