#pragma once

// The demo's runs, by name, and the pool that serves them. One vocabulary for every runtime:
// a run is a run_kind (static TP, static EP, ours stop-the-world / progressive / by cost, the
// rules without the gate, the paper's policy), never a position in a list; the table rows, the
// JSON and the verdicts find a run by its kind (find_run).
//
// The pool (run_pool) serves a trace once per run spec, as many runs at a time as it has
// seats, in the order of the specs:
//   host, GPU  a fixed set of worlds (two host runtimes beside each other on two cores, or the
//              GPU runtime), each with its engine, serving every run of every trace in turn (an
//              engine rests empty between runs)
//   sim        a fresh world per run, the deployment of its kind (deployment_of): the static
//              layouts' pools are sized after their own weights, the switching deployment's
//              after EP's plus the spare slot

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <moebius/transport/transport.hpp>

#include "deployment.hpp"
#include "engine.hpp"
#include "world.hpp"

namespace mini_engine::demo {

// switching, progressive, by_cost: our policy and its cost gate, each switch stop-the-world,
// progressive, or the cheaper of the two per switch (switch_style::by_cost).
// no_gate: our policy's rules without the gate (the host demo's view of what the gate prevents).
// paper_policy: the paper's rules as written (§7.1, eq. 13): no gate, no blocked-admission
// rule, the load capped at max_running, starting in TP (the simulated runtime's baseline).
// The simulated runtime's other configurations and designs (deployment.hpp):
// static_tp_dcp2, static_tep_dcp2: TP attention with dcp 2, experts TP or EP, each on its own
// deployment; switching_dcp2 ("ours DCP2"): our policy, stop-the-world, switching EP <->
// TP-DCP2 on the paper's footprint; experts_only ("ours experts"): our policy, stop-the-world,
// TP-DCP2 attention throughout, the experts EP <-> TP; dcp_only ("ours dcp"): our policy,
// stop-the-world, TP attention and experts throughout on static TP's footprint, the KV's dcp
// 2 <-> 1 (TP-DCP2 for a large load, TP for a small one).
enum class run_kind : uint8_t {
  static_tp,
  static_ep,
  switching,
  progressive,
  no_gate,
  paper_policy,
  by_cost,
  static_tp_dcp2,
  static_tep_dcp2,
  switching_dcp2,
  experts_only,
  dcp_only,
};

// "static TP", "static EP", "ours", "ours progressive", "no gate", "paper policy", "ours by
// cost", "static TP-DCP2", "static TEP-DCP2", "ours DCP2", "ours experts", "ours dcp": the
// runs' names in tables, CSVs and JSON.
const char* label_of(run_kind k);

// The deployment a run is served on by the simulated runtime: each static configuration its
// own, each switching design its own (ours, its styles and the paper's policy: the paper's).
deployment_kind deployment_of(run_kind k);

bool is_static(run_kind k);
// A policy run of a switching design other than the paper's (its own calibration and layouts).
bool is_other_design(run_kind k);

// One run of a trace: which, and the engine options it is served with.
struct run_spec {
  run_kind kind;
  engine_options options;
};

// What one run gave.
struct run_outcome {
  run_kind kind;
  run_result result;
  run_summary summary;
  double wall_s = 0;  // the host's own time
};

// The run of kind `k` in `runs` (null when it was not served).
const run_outcome* find_run(const std::vector<run_outcome>& runs, run_kind k);
// The same, throwing std::logic_error when it was not served.
const run_outcome& run_of(const std::vector<run_outcome>& runs, run_kind k);

class run_pool {
 public:
  // Host, GPU: every run served on these worlds, worlds.size() at a time.
  run_pool(std::vector<world> worlds, const step_clock& clock);
  // Simulated: a fresh deployment per run (make_sim_world(deployment_of(kind))), `width` at a
  // time.
  run_pool(size_t width, const step_clock& clock);
  ~run_pool();
  run_pool(const run_pool&) = delete;
  run_pool& operator=(const run_pool&) = delete;

  size_t width() const { return width_; }
  // The engine the calibration measures on: the first world's, or a switching deployment's.
  engine& calibration_engine();
  // Simulated: the engine of deployment `k` (one kept per kind), for a design's calibration.
  engine& calibration_engine(deployment_kind k);
  // The first world (host, GPU) or the switching deployment (simulated).
  const world& front_world();

  // Serves `trace` once per spec (`announce`: a line as each run starts); rethrows the first
  // failure after every thread is joined. The outcomes in the order of `specs`, summarized.
  std::vector<run_outcome> serve(const std::vector<request>& trace,
                                 const std::vector<run_spec>& specs, bool announce);

 private:
  struct seat {
    world w;
    std::unique_ptr<moebius::transport> transport;
    std::unique_ptr<engine> eng;
  };
  seat make_seat(world w) const;
  engine& engine_for(size_t slot, run_kind k, std::vector<seat>& fresh);

  const step_clock& clock_;
  size_t width_ = 1;
  bool per_run_ = false;
  std::vector<seat> fixed_;  // host, GPU; simulated: the calibration's switching deployment
  std::vector<std::pair<deployment_kind, seat>> designs_;  // simulated: other designs' engines
};

}  // namespace mini_engine::demo
