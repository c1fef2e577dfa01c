#pragma once

// Executes plans on P ranks whose memory is host memory. It is the reference transport: CPU
// tests and CI run every plan through it, and the GPU transports must match it byte for byte.
// The CPU is its device: enqueue() does the copies (memcpy, op by op, phase by phase) and keeps
// a failure for wait(), so it follows the same lifecycle as the device transports.

#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <vector>

#include "moebius/memory/rank_memory.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/transport/transport.hpp"

namespace moebius {

class host_transport final : public transport {
 public:
  // One entry per rank, all host memory. Throws errc::invalid_argument when validate_rank_memory
  // (memory/rank_memory.hpp) rejects them: no rank, a device rank, a null or negative space,
  // or two spaces that overlap.
  explicit host_transport(std::vector<rank_memory> ranks);

  int num_ranks() const override { return static_cast<int>(ranks_.size()); }
  std::vector<int> local_ranks() const override;
  // Every op must fit the smallest rank's space of its memory space.
  void validate(const plan& p) const override;
  // Runs the whole plan before returning; `streams` must be empty or all nullptr (host memory
  // has no streams).
  void enqueue(const plan& p, std::span<const stream_handle> streams = {}) override;
  bool poll() override { return true; }
  void wait() override;
  int64_t completed_phases() const override { return completed_phases_; }
  void inject_fault(std::optional<fault_point> at) override { fault_ = at; }
  // The plan has run when enqueue() returns: every event is nullptr.
  void mark_phases(std::span<const int64_t> after_phases) override;
  // Host memory has no streams to wait on: every event must be nullptr.
  void wait_before_phases(std::span<const phase_wait> waits) override;
  event_handle phase_event(size_t mark, size_t local_index) const override;

  const std::vector<rank_memory>& ranks() const { return ranks_; }

 private:
  void execute_phase(const plan& p, int64_t phase_idx, const std::optional<fault_point>& fault);

  std::vector<rank_memory> ranks_;
  std::optional<fault_point> fault_;
  std::vector<int64_t> pending_marks_;
  size_t num_marks_ = 0;  // marks the last plan reached
  int64_t completed_phases_ = 0;
  bool outstanding_ = false;
  std::exception_ptr failure_;
};

}  // namespace moebius
