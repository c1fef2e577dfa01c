// Calibration on the engine's clock: decode steps of both modes over a batch sweep (engine.hpp).
#include <algorithm>
#include <moebius/error.hpp>
#include <moebius/kv/page_table.hpp>

#include "engine_run_state.hpp"
#include "host_clock.hpp"
#include "kv_pages.hpp"

namespace mini_engine {

using moebius::errc;
using moebius::kv_state;
using moebius::parallel_mode;

double engine::decode_step_s(moebius::parallel_layout layout, int64_t batch, int64_t context,
                             int64_t dcp) {
  MOEBIUS_CHECK(batch >= 1 && context >= 1, errc::invalid_argument,
                "decode_step_s: need batch >= 1 and context >= 1 (got ", batch, ", ", context, ")");
  step_cost cost;
  cost.set(configuration_of(layout, dcp > 0 ? dcp : kv_.dcp));
  cost.num_ranks = kv_.num_ranks;
  cost.num_sequences = batch;
  cost.new_tokens = batch;
  cost.context_tokens = batch * (context + 1);
  if (!clock_.needs_measurement()) return clock_.step_s(cost, 0.0);

  MOEBIUS_CHECK(no_live_sequences(switcher_.kv_tables()), errc::invalid_argument,
                "decode_step_s: the KV tables still hold live sequences");
  const moebius::switch_report r = switch_untimed(layout, dcp);
  MOEBIUS_CHECK(r.outcome == moebius::switch_outcome::committed ||
                    r.outcome == moebius::switch_outcome::already_there,
                errc::internal, "decode_step_s: the switch to ", moebius::to_string(layout),
                " with no live sequence failed (", moebius::to_string(r.outcome), "): ", r.error);
  kv_state& tables = switcher_.mutable_kv_tables();
  // Placeholder sequences far above any request id; EP owners round-robin.
  constexpr int64_t first_id = int64_t{1} << 60;
  const std::vector<int32_t> token(1, 0);
  std::vector<step_item> items;
  // The placeholders go whatever happens (a pool too small for them, a step that throws).
  auto release_all = [&] {
    for (int64_t i = 0; i < batch; ++i) release_sequence(tables, first_id + i);
  };
  for (int64_t i = 0; i < batch; ++i) {
    try {
      reserve_tokens(kv_, tables, first_id + i, context + 1, static_cast<int>(i % kv_.num_ranks));
    } catch (...) {
      release_all();
      throw;
    }
    step_item it;
    it.seq_id = first_id + i;
    it.tokens = token;
    it.start_position = context;
    it.sample = true;
    items.push_back(it);
  }
  const auto t0 = host_clock::now();
  try {
    step_layout at{&tables, switcher_.cursor()};
    at.dcp = kv_.dcp;
    runtime_.step(at, items);
  } catch (...) {
    release_all();
    throw;
  }
  const double measured =
      runtime_.measured_step_s() >= 0 ? runtime_.measured_step_s() : seconds_since(t0);
  release_all();
  return clock_.step_s(cost, measured);
}

moebius::calibration_result calibrate_engine(engine& e, std::span<const int64_t> batches,
                                             int64_t context,
                                             const moebius::calibration_options& options,
                                             const mode_layouts& layouts) {
  std::vector<moebius::latency_sample> ep, tp;
  for (const int64_t b : batches) {
    ep.push_back({static_cast<double>(b),
                  e.decode_step_s(layouts.ep, b, context, layouts.ep_dcp) * 1e3});
    tp.push_back({static_cast<double>(b),
                  e.decode_step_s(layouts.tp, b, context, layouts.tp_dcp) * 1e3});
  }
  return moebius::calibrate(ep, tp, options);
}

}  // namespace mini_engine
