#pragma once

// The simulated runtime: the step interface (step.hpp) without a model. It checks every step
// as a runtime must find it (each item's sequence in the tables its layers read, in the layout's
// mode, with pages for every token it writes: in EP on exactly one rank, in TP on every rank;
// hybrid steps against both sets of tables) and returns a token for every sampled item, but
// computes nothing: the serving loop around it is the real one (scheduler, admission, page
// tables and KV accounting, policy, the switcher planning, checking and committing every
// switch over a moebius::dry_run_transport), and the step's time is what the serving clock
// prices (a priced clock: step_curves.hpp's measured curves). So it runs a deployment at its
// real size (Qwen3-235B-A22B on 8 H200s: 2,048 running, millions of KV tokens) on a CPU.
//
// Its tokens are not a model's: token = (seq_id * 31 + position) mod vocab, a function of the
// sequence and the position only. On any trace the host runtime can serve, a run on this
// runtime gives the host runtime's event log (admissions, steps with their batch and mode,
// switches, finish times) on the same priced clock: the serving loop never reads a token's
// value (tests/test_serving_sim.cpp).

#include <cstdint>
#include <span>
#include <vector>

#include <moebius/kv/kv_geometry.hpp>
#include <moebius/layout/arena_geometry.hpp>
#include <moebius/transport/dry_run_transport.hpp>

#include "step.hpp"

namespace mini_engine {

class sim_runtime final : public synchronous_runtime {
 public:
  // Throws errc::invalid_argument unless `kv` is valid, arena and KV have the same ranks and
  // (for hybrid steps) layers, and vocab >= 1.
  sim_runtime(const moebius::arena_geometry& arena, const moebius::kv_geometry& kv, int32_t vocab);

  int64_t vocab_size() const override { return vocab_; }
  const moebius::arena_geometry& arena() const { return arena_; }
  const moebius::kv_geometry& kv() const { return kv_; }
  // The sizes a moebius::dry_run_transport over this deployment's ranks needs.
  moebius::dry_run_spaces spaces() const;
  // Steps run so far.
  int64_t steps() const { return steps_; }

 protected:
  std::vector<int32_t> compute(const step_layout& layout, std::span<const step_item> items,
                               std::vector<std::vector<float>>* logits) override;

 private:
  // Throws errc::invalid_argument unless every item's sequence is in `tables` as its mode
  // holds it, with room for the item's tokens.
  void check_tables(const moebius::kv_state& tables, std::span<const step_item> items);

  moebius::arena_geometry arena_;
  moebius::kv_geometry kv_;
  int32_t vocab_;
  int64_t steps_ = 0;
};

}  // namespace mini_engine
