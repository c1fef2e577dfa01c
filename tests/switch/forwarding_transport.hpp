#pragma once

// A host_transport behind the transport interface, every call forwarded: switcher tests derive
// from it to watch or bend one call (count what each plan sends, time a barrier out).
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "moebius/memory/rank_memory.hpp"
#include "moebius/transport/host_transport.hpp"
#include "moebius/transport/transport.hpp"

namespace moebius::testing {

class forwarding_transport : public transport {
 public:
  explicit forwarding_transport(std::vector<rank_memory> ranks) : inner_(std::move(ranks)) {}
  int num_ranks() const override { return inner_.num_ranks(); }
  std::vector<int> local_ranks() const override { return inner_.local_ranks(); }
  void validate(const plan& p) const override { inner_.validate(p); }
  void enqueue(const plan& p, std::span<const stream_handle> streams) override {
    inner_.enqueue(p, streams);
  }
  bool poll() override { return inner_.poll(); }
  void wait() override { inner_.wait(); }
  int64_t completed_phases() const override { return inner_.completed_phases(); }
  void inject_fault(std::optional<fault_point> at) override { inner_.inject_fault(at); }
  void mark_phases(std::span<const int64_t> after_phases) override {
    inner_.mark_phases(after_phases);
  }
  event_handle phase_event(size_t mark, size_t local_index) const override {
    return inner_.phase_event(mark, local_index);
  }
  void wait_before_phases(std::span<const phase_wait> waits) override {
    inner_.wait_before_phases(waits);
  }

 protected:
  host_transport inner_;
};

}  // namespace moebius::testing
