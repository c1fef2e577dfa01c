#pragma once

// Executes plans on P ranks whose memory is host memory. It is the reference transport: CPU
// tests and CI run every plan through it, and the GPU transports must match it byte for byte.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "moebius/plan/plan.hpp"

namespace moebius {

// One rank's memory: one span per memory_space (an absent space is an empty span).
struct host_rank_memory {
  std::span<std::byte> spaces[num_memory_spaces];

  std::span<std::byte> space(memory_space s) const { return spaces[static_cast<int>(s)]; }
};

// Where an injected fault fires: before op `op` of phase `phase` (ops before it in that phase
// have run, phases before it are complete).
struct fault_point {
  int64_t phase = 0;
  int64_t op = 0;
};

class host_transport {
 public:
  // One entry per rank. Throws errc::invalid_argument when `ranks` is empty or when two
  // ranks' spans overlap.
  explicit host_transport(std::vector<host_rank_memory> ranks);

  int num_ranks() const { return static_cast<int>(ranks_.size()); }

  // Runs every phase of `p` in order. Validates the whole plan against the ranks' memory
  // first (see validate(plan, ...)), so a bad plan moves nothing. On an injected fault throws
  // errc::injected_fault naming the phase and op; phases before it are complete.
  void execute(const plan& p);

  // Runs phase `phase_idx` of `p` alone (the caller has validated `p`, or calls validate()),
  // so a caller can advance a cursor phase by phase.
  void execute_phase(const plan& p, int64_t phase_idx);

  // Validates `p` against this transport's ranks; throws as validate(plan, ...).
  void validate(const plan& p) const;

  // Arms a one-shot fault: the next execution that reaches `at` throws before running it.
  // Phase indices count within the plan being executed.
  void inject_fault(std::optional<fault_point> at) { fault_ = at; }

 private:
  std::vector<host_rank_memory> ranks_;
  std::optional<fault_point> fault_;
};

}  // namespace moebius
