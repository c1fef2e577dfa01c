#pragma once

// Executes plans on P ranks whose memory is host memory. It is the reference transport: CPU
// tests and CI run every plan through it, and the GPU transports must match it byte for byte.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "moebius/plan/plan.hpp"
#include "moebius/transport/transport.hpp"

namespace moebius {

// One rank's memory: one span per memory_space (an absent space is an empty span).
struct host_rank_memory {
  std::span<std::byte> spaces[num_memory_spaces];

  std::span<std::byte> space(memory_space s) const { return spaces[static_cast<int>(s)]; }
};

class host_transport final : public transport {
 public:
  // One entry per rank. Throws errc::invalid_argument when `ranks` is empty or when two
  // ranks' spans overlap.
  explicit host_transport(std::vector<host_rank_memory> ranks);

  int num_ranks() const override { return static_cast<int>(ranks_.size()); }
  // Every op must fit the smallest rank's span of its memory space.
  void validate(const plan& p) const override;
  // Ops run one after another with memcpy, phase by phase.
  void execute(const plan& p) override;
  int64_t completed_phases() const override { return completed_phases_; }
  void inject_fault(std::optional<fault_point> at) override { fault_ = at; }

 private:
  void execute_phase(const plan& p, int64_t phase_idx, const std::optional<fault_point>& fault);

  std::vector<host_rank_memory> ranks_;
  std::optional<fault_point> fault_;
  int64_t completed_phases_ = 0;
};

}  // namespace moebius
