// A tour of the Moebius API in one runnable program (the README quotes it whole, and a test
// compiles the README's copy). Host memory and host_transport stand in for GPUs: with
// Moebius::cuda, device_deployment_memory and cuda_peer_transport take their places.
#include <cstdio>
#include <iostream>
#include <optional>
#include <vector>

#include "moebius/moebius.hpp"

using namespace moebius;

int main() {
  // 1. Describe the experts and lay out one rank's arena (validated; allocates nothing).
  expert_shape shape = qwen3_235b_a22b();  // L=94, E=128, H=4096, I=1536, bf16
  std::cout << make_arena_geometry(shape, 8) << '\n';
  shape.num_layers = 2;  // small enough for host memory
  shape.hidden = 256;
  shape.intermediate = 64;
  const int P = 4;
  const arena_geometry arena = make_arena_geometry(shape, P, 256, 4096);

  // 2. Plans are pure functions of the geometry and two cursors: print, compare, cache them.
  const plan to_tp = plan_weight_switch(arena, arena_cursor{0}, arena_cursor{shape.num_layers});
  std::cout << to_tp;

  // 3. The KV cache: geometry, and page tables of the live sequences (EP: one owner each).
  const kv_geometry kv = make_kv_geometry(shape.num_layers, /*kv_heads=*/4, /*head_dim=*/32,
                                          /*page_size=*/16, /*ep_pages=*/64, P);
  std::vector<std::vector<kv_sequence>> tables(P);
  tables[1].push_back(kv_sequence{.seq_id = 7, .num_tokens = 40, .last_page_len = 8,
                                  .prefill_cursor = 40, .pages = {3, 4, 5}});
  const kv_state kv_tables = make_kv_state(kv, parallel_mode::ep, tables);

  // 4. The memory owner: per rank one arena and one KV pool, never moved; views of each
  //    layer's tensors; a transport over its ranks.
  host_deployment_memory memory(arena, kv);
  const tensor_slab w2 = memory.weights(/*rank=*/0, /*layer=*/1)[weight_tensor::w2];
  std::cout << "rank 0, layer 1, w2: " << w2.bytes << " B at arena offset " << w2.offset << '\n';
  host_transport transport(memory.ranks());

  // 5. The switcher runs the whole switch: capacity check, weights, KV, tables, selector.
  parallel_layout graphs = parallel_mode::ep;  // which set of CUDA graphs the engine launches
  switcher_options options;
  options.on_commit = [&](parallel_layout l) { graphs = l; };  // flip the runtime selector
  switcher sw(arena, kv, transport, kv_tables, arena_cursor{0}, options);
  const switch_report report = sw.switch_to(parallel_mode::tp);
  memory.set_cursor(report.cursor);
  std::cout << report << '\n';
  for_each_metric(report, [](std::string_view name, double value) {
    if (name.ends_with("_ms") && value > 0) std::cout << name << ' ' << value << '\n';
  });

  // 6. The policy decides when, in two phases: its rules propose (asymmetric hysteresis,
  //    cooldown); the engine plans the proposal once and prices that plan (capacity here; a
  //    gate's weighing too: policy/step_time_gate.hpp); the rules decide, and the plan runs.
  switch_policy policy(interactive_config(/*t_high=*/256));
  const switch_proposal proposal =
      policy.propose(/*active sequences=*/300, sw.mode(), /*now_s=*/0.0);
  std::optional<switch_plan> plan;
  switch_pricing priced;
  if (proposal.proposed()) {
    plan = sw.plan(proposal.target);
    priced.fits = plan->capacity.fits;
  }
  const switch_decision d = policy.decide(proposal, priced);
  std::cout << d << '\n';
  if (d.do_switch) std::cout << sw.switch_to(*plan) << '\n';

  const bool ok = report.outcome == switch_outcome::committed && graphs == sw.layout();
  std::puts(ok ? "api tour: ok" : "api tour: FAILED");
  return ok ? 0 : 1;
}
