#pragma once

// What every transport offers: run a plan, phase by phase, on its P ranks. The switcher and
// the example engine hold a `transport&` and never care whether bytes move by memcpy, copy
// engines, an SM kernel or NCCL.

#include <cstdint>
#include <optional>

#include "moebius/plan/plan.hpp"

namespace moebius {

// Where an injected fault fires: before op `op` of phase `phase` (ops before it in that phase
// may have run, phases before it are complete on every rank).
struct fault_point {
  int64_t phase = 0;
  int64_t op = 0;
};

class transport {
 public:
  virtual ~transport() = default;

  virtual int num_ranks() const = 0;

  // Throws (errc::invalid_argument / errc::out_of_range) unless `p` fits this transport's
  // ranks and memory. Moves nothing.
  virtual void validate(const plan& p) const = 0;

  // Runs every phase of `p` in order and returns when all of it is complete (and visible to
  // every rank). Validates first, so a bad plan moves nothing. On failure (a transport error,
  // a barrier timeout, an injected fault) throws moebius::error; completed_phases() then says
  // how many leading phases completed on every rank, which is what a caller needs to roll
  // back: a plan's phases leave the memory in a valid resting state after each one.
  virtual void execute(const plan& p) = 0;

  // Phases of the last execute() that completed on every rank.
  virtual int64_t completed_phases() const = 0;

  // Arms a fault for the next execute() only: it throws errc::injected_fault before op
  // `at.op` of phase `at.phase`; a fault that execute() does not reach (the phase has fewer
  // ops) is dropped when it returns. std::nullopt disarms.
  virtual void inject_fault(std::optional<fault_point> at) = 0;
};

}  // namespace moebius
