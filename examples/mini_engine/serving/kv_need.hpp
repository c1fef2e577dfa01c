#pragma once

// What the policy expects the live sequences' KV to need, and what a pool holds for it: the
// estimates both the switch pricing (run_policy::serving_load_of) and the dcp-only design's
// capacity rule (run_policy::decide_for_capacity) read. A sequence's remaining output is not
// known; these say how it is guessed.

#include <cstdint>

#include <moebius/kv/kv_geometry.hpp>

#include "scheduler.hpp"

namespace mini_engine {

// Tokens the pool holds for admission under attention `m`: EP, every rank's pages
// (data-parallel attention: a sequence lives on one rank); TP at `dcp`, one rank's times dcp
// (every replica set of dcp ranks holds every sequence, each rank 1/dcp of its tokens), less the
// `watermark` share kept free.
double pool_tokens(const moebius::kv_geometry& g, moebius::parallel_mode m, int64_t dcp,
                   double watermark);

// The mean output a request is expected to have: of the requests finished so far, else of what
// the running ones have generated (at least 1).
double output_prior(const work_view& w);

// Expected decode tokens still to come for a sequence that has generated `generated`: at least
// what it has generated (a heavy-tailed length: a sequence that has run g tokens runs about g
// more) and at least the mean output of the requests finished so far (`prior`).
double expected_remaining(int64_t generated, double prior);

// The known residency of a closed-loop rollout (no request arrives on its own): in TP, until
// the last survivor of the rollout step ends (the next step's batch sends the engine back to
// EP); in EP, until the live count falls under `boundary` (residency_boundary: T_l). In steps,
// at least 1.
int64_t rollout_residency(const work_view& w, moebius::parallel_mode target, int64_t boundary,
                          double prior);

}  // namespace mini_engine
