#pragma once

// A progressive switch in the serving loop (engine.hpp; DESIGN.md §7), as one object: it owns
// the session (moebius::progressive_switch), its pacing, the pages reserved for its steps and
// the frozen view each step reads. The loop runs its steps through it (a step_runner: the next
// paced layers' copies beside each step, step_beside.hpp) and ends it in one place
// (engine::end_progressive) when after_step() or finish_rest() says it is over.
//
//   begin     the layers per step paced from the last step's time, the clock's link and the
//             plan's bytes a layer (capped by the measured overlap slowdown); every running
//             sequence's pages for the switch's steps reserved (scheduler::reserve_for_switch);
//             switcher::begin on a plan of the reserved tables;
//   each step the batch from the frozen tables (frozen_pages: no admission), a hybrid step at
//             the cursor with the advance enqueued on its layer events, the wait for the copies,
//             the step priced with them (step_clock::switch_step_s);
//   end       finish() after the last layer (or the advance failed and rolled back, or a test
//             aborted it): the report, and the pages of sequences that finished meanwhile freed.
//
// Also here, because by_cost prices a switch before deciding its style: the pacing of a switch
// and the price of both styles (price_styles).

#include <cstdint>
#include <optional>
#include <vector>

#include <moebius/switch/pacing.hpp>
#include <moebius/switch/progressive.hpp>
#include <moebius/switch/switch_plan.hpp>
#include <moebius/switch/switcher.hpp>

#include "engine.hpp"
#include "step_runner.hpp"

namespace mini_engine {

// The pacing of a progressive switch moving `per_layer` bytes a layer now: from the last
// step's time (0: none yet, 10 ms assumed), the clock's link, engine_options'
// copy_link_fraction.
moebius::pacing_params pacing_for(const step_clock& clock, const engine_options& o,
                                  double last_step_s, const moebius::layer_bytes& per_layer,
                                  int64_t num_layers);
// Layers per step: moebius::layers_per_step, cut while the clock's measured overlap slowdown
// (when it has one) says a step would exceed max_overlap_slowdown or max_overlap_extra_ms, down
// to one (a switch must end).
int64_t paced_layers(const step_clock& clock, const engine_options& o,
                     const moebius::pacing_params& p, int64_t num_layers);

// Both styles of one switch priced now (switch_style::by_cost).
struct style_price {
  int64_t running = 0, waiting = 0;  // the requests a switch now would hold or slow
  double stall_s = 0;                // stop-the-world: the predicted stall
  int64_t layers_per_step = 0;       // progressive: paced layers per step,
  int64_t steps = 0;                 //   the steps it spans,
  double extra_s_per_step = 0;       //   what its copies add to each of them,
  double duration_s = 0;             //   and begin to finish
  double stall_request_s = 0;        // (running + waiting) x stall_s
  // running x steps x extra_s_per_step + waiting x duration_s (infinite when impossible)
  double progressive_request_s = 0;

  bool progressive() const { return progressive_request_s < stall_request_s; }
  // The cheaper style's request-seconds over the requests: seconds of the whole batch, the
  // unit of the cost gate (stop-the-world: stall_s). With no request to hold, the stall: a
  // switch at idle is not free to a gate that would then pass it on zero gain.
  double batch_s() const;
};

// Both styles of a switch moving `per_layer` bytes a layer, for the work `w` in front of the
// engine: stop-the-world holds every running and waiting request for the stall; progressive
// slows each running request's steps by the copies beside them and holds the waiting ones (no
// admission) until it ends. `progressive_possible` false (no per-layer plan): progressive costs
// infinity.
style_price price_styles(const step_clock& clock, const engine_options& o, const work_view& w,
                         double last_step_s, const moebius::layer_bytes& per_layer,
                         int64_t num_layers, bool progressive_possible);

class progressive_driver final : public step_runner {
 public:
  // How begin() went: open (the driver serves the switch's steps), ended (begun and refused at
  // once, e.g. the verify hook failed: its report says why; no stop-the-world retry), or not
  // begun (no per-layer plan, or the reserved pages are not there: run it stop-the-world).
  enum class start { open, ended, not_begun };

  // Paces the switch `planned` describes, reserves the pages its steps write and opens the
  // session on a plan of the reserved tables (the reservation changes the tables the KV plan
  // moves; the pacing keeps the bytes `planned` says). `rec` is the switch's record, at
  // `switch_idx` in the run's list.
  progressive_driver(moebius::switcher& sw, scheduler& sched, const step_clock& clock,
                     const engine_options& o, int64_t num_layers,
                     const moebius::switch_plan& planned, double last_step_s, switch_record& rec,
                     size_t switch_idx);
  ~progressive_driver() override = default;  // an open session aborts (progressive.hpp)
  progressive_driver(const progressive_driver&) = delete;
  progressive_driver& operator=(const progressive_driver&) = delete;

  start started() const { return started_; }

  page_source& open_step() override;
  bool runs_without_batch() const override { return true; }
  served_step run(runtime& rt, const step_batch& b, step_record& rec) override;

  // After a step's tokens are recorded: counts the step; true when the switch is over (the
  // advance failed and rolled back, a test aborted it, or the last layer moved and finish()
  // committed or rolled back).
  bool after_step(const step_record& rec, run_result& out);
  // Every request finished during the switch: moves the remaining layers and finishes; the
  // seconds it counts for on the serving clock (copies alone).
  double finish_rest();

  // Once over (or begin ended it at once): how it ended, and the tokens produced meanwhile.
  const moebius::switch_report& report() const;
  int64_t tokens_during() const;
  // Once over: the pages of sequences that finished during it go back, from the tables now
  // current (after any recovery).
  void release_deferred();

  size_t switch_idx() const { return switch_idx_; }

 private:
  void enqueue_advance(step_record& rec, const moebius::step_layer_events* step_events);
  double wait_for_advance();

  moebius::switcher& sw_;
  scheduler& sched_;
  const step_clock& clock_;
  const engine_options& options_;
  int64_t num_layers_;
  start started_ = start::not_begun;
  std::optional<moebius::progressive_switch> session_;
  moebius::switch_report ended_;  // the report once over (begin's, when it did not open)
  moebius::pacing_params pacing_;
  int64_t layers_ = 1;        // paced layers per step
  int64_t tokens_before_ = 0;  // tokens produced when it began
  size_t switch_idx_ = 0;
  moebius::parallel_layout from_, to_;  // the switch's source and target layouts
  // The step's view of both sets of tables and its page source over the frozen source tables.
  std::optional<moebius::switch_step_view> view_;
  std::optional<frozen_pages> pages_;
  // Sequences finished during it: their pages go back when it has ended.
  std::vector<int64_t> deferred_release_;
};

}  // namespace mini_engine
