#include "step_runner.hpp"

#include <utility>

#include "host_clock.hpp"

namespace mini_engine {

step_cost cost_of(const step_batch& b, const configuration& config, int num_ranks,
                  std::vector<rank_work> ep_split) {
  step_cost cost;
  cost.set(config);
  cost.num_ranks = num_ranks;
  cost.num_sequences = b.num_sequences;
  cost.new_tokens = b.decode_tokens + b.prefill_tokens;
  cost.context_tokens = b.context_tokens;
  if (cost.mode == moebius::parallel_mode::ep) cost.ranks = std::move(ep_split);
  return cost;
}

page_source& plain_steps::open_step() {
  // Every call hands out the tables for change: a plan made before it is stale (switcher.hpp).
  return pages_.emplace(kv_, sw_.mutable_kv_tables());
}

served_step plain_steps::run(runtime& rt, const step_batch& b, step_record& rec) {
  const moebius::kv_state& tables = pages_->tables();
  step_layout layout{&tables, sw_.cursor()};
  layout.dcp = kv_.dcp;  // the switcher's (engine::follow_kv_dcp)
  // Data-parallel attention: in EP each rank runs its own items.
  std::vector<rank_work> ep_split;
  if (tables.mode == moebius::parallel_mode::ep) ep_split = ep_rank_work(tables, b.items);
  if (record_ranks_) rec.ranks = ep_split;
  const auto t0 = host_clock::now();
  step_result done = rt.finish(rt.enqueue(layout, b.items));
  if (done.overflowed) {  // nothing beside it: the rerun is at the same layout
    step_options rerun;
    rerun.rerun = true;
    done = rt.finish(rt.enqueue(layout, b.items, rerun));
  }
  served_step s;
  s.measured_s = seconds_since(t0);
  // A runtime that times itself (the GPU runtime: CUDA events) reports the device time.
  if (done.measured_s >= 0) s.measured_s = done.measured_s;
  s.tokens = std::move(done.tokens);
  // The switcher's layout: the tables' attention, the experts where the arena rests.
  s.layout = sw_.layout();
  s.config = configuration_of(s.layout, kv_.dcp);
  s.clock_s = clock_.step_s(cost_of(b, s.config, kv_.num_ranks, std::move(ep_split)), s.measured_s);
  s.tables = &tables;
  last_step_s_ = s.clock_s;
  return s;
}

}  // namespace mini_engine
