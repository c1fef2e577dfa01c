#pragma once

// Executes plans on P ranks whose memory is host memory. It is the reference transport: CPU
// tests and CI run every plan through it, and the GPU transports must match it byte for byte.
// The CPU is its device: enqueue() does the copies (memcpy, op by op, phase by phase) and keeps
// a failure for wait(), so it follows the same lifecycle as the device transports.

#include <cstddef>
#include <vector>

#include "moebius/memory/rank_memory.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/transport/synchronous_transport.hpp"

namespace moebius {

// The lifecycle, faults, marks and waits are synchronous_transport's: enqueue() runs the whole
// plan before it returns, so every stream and event is nullptr.
class host_transport final : public synchronous_transport {
 public:
  // One entry per rank, all host memory. Throws errc::invalid_argument when validate_rank_memory
  // (memory/rank_memory.hpp) rejects them: no rank, a device rank, a null or negative space,
  // or two spaces that overlap.
  explicit host_transport(std::vector<rank_memory> ranks);

  // Every op must fit the smallest rank's space of its memory space.
  void validate(const plan& p) const override;

  const std::vector<rank_memory>& ranks() const { return ranks_; }

 private:
  // Copies the ops' rows, op by op (memcpy).
  void run_ops(const plan_phase& phase, size_t num_ops) override;

  std::vector<rank_memory> ranks_;
};

}  // namespace moebius
