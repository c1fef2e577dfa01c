#pragma once

// The mini-engine's serving loop: a scheduler (continuous batching), a runtime (one forward
// step per call), a moebius::switcher that owns the KV page tables and the arena cursor, and
// a moebius::switch_policy that decides between two steps whether to switch. Each step and
// each switch advances the serving clock by what a step_clock says it took.
//
//   loop: [run_policy.decide: rules.propose(load, mode, now); for a proposal
//          plan = switcher.plan(target) once, priced (capacity, gate, style) from that plan;
//          rules.decide(proposal, pricing)]                      (run_policy.hpp; or forced)
//         [stop the world: switcher.switch_to(plan);
//          progressive: a progressive_driver begins it, then runs each step as a hybrid step
//          with the next paced advance enqueued beside it (step_beside.hpp: its copies run
//          while the step computes) until the last layer; DESIGN.md §7]
//         runner = the step_runner of this step (plain_steps, or the driver: step_runner.hpp)
//         batch = scheduler.next_step(runner.open_step(), now)     (admit, grow page tables)
//         tokens = runner.run(runtime, batch)                     (timed, priced by the clock)
//         now += the step's time; scheduler.finish_step(batch, tokens, now)
//
// The load the policy sees is the number of sequences that want to run: running plus arrived
// and waiting, capped at max_running (the batch the calibration measured).
//
// The cost gate (DESIGN.md §7, "a switch must pay for itself") is on by default whenever a
// policy decides (engine_options::gate): a switch the policy's rules propose goes ahead only
// when (latency(current, load) - latency(target, load)) x predicted residency >= predicted
// switch cost x (1 + margin). Latency curves: given, or calibrated at the run's start on the
// engine's clock (calibrate_engine); residency: a moebius::residency_predictor the engine feeds
// each step (arrivals, completions and the steps completed requests ran, counted as their
// output tokens); switch cost: the clock's prediction (step_clock::predicted_switch_s) for what
// the switcher would move now, weights and the live KV.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <moebius/kv/kv_geometry.hpp>
#include <moebius/kv/kv_pool_layout.hpp>
#include <moebius/layout/arena_geometry.hpp>
#include <moebius/policy/calibration.hpp>
#include <moebius/policy/residency.hpp>
#include <moebius/policy/switch_policy.hpp>
#include <moebius/policy/throughput_gate.hpp>
#include <moebius/switch/pacing.hpp>
#include <moebius/switch/switcher.hpp>
#include <moebius/transport/transport.hpp>

#include "configuration.hpp"
#include "run_report.hpp"
#include "scheduler.hpp"
#include "step.hpp"
#include "step_clock.hpp"
#include "trace.hpp"

namespace mini_engine {

enum class switching : uint8_t {
  never,   // static: serve in start_mode throughout
  policy,  // the switch policy decides between steps
  forced,  // switch to the other mode before each step in forced_steps (tests)
};

// How a switch runs once decided.
enum class switch_style : uint8_t {
  stop_the_world,  // switcher::switch_to between two steps: no token meanwhile
  // switcher::begin, then a few layers per step (advance, paced so that each step's copies
  // fit the step: moebius/switch/pacing.hpp) while the engine keeps decoding with hybrid
  // steps (step.hpp); finish() after the last layer. Before begin() every running sequence
  // gets the pages for the tokens it writes during the switch (the tables are frozen until
  // finish); no admission meanwhile; finished sequences release their pages at the end. When
  // those pages are not there the switch runs stop-the-world instead.
  progressive,
  // Per switch, the style that costs the requests less (price_styles, progressive_driver.hpp), in
  // request-seconds: stop-the-world holds every running and waiting request for the stall;
  // progressive slows each running request's steps by the copies beside them and holds the
  // waiting ones (no admission) until it ends. The policy's cost gate weighs the cheaper one,
  // as seconds of the whole batch (request-seconds over the requests). Not priced: the gain a
  // progressive switch defers while its layers move (the gate counts it from now), which
  // leans the choice toward progressive.
  by_cost,
};

constexpr const char* to_string(switch_style s) {
  switch (s) {
    case switch_style::stop_the_world:
      return "stop-the-world";
    case switch_style::progressive:
      return "progressive";
    case switch_style::by_cost:
      return "by cost";
  }
  return "unknown";
}

// What the engine does with sequences whose K/V a failed switch lost (switcher::recover).
enum class lost_kv_policy : uint8_t {
  resume,  // recomputed from their tokens (prompt and generated): the same greedy tokens
  fail,    // each fails with an error naming it (request_result::error)
};

struct progress_info {
  const std::string* run = nullptr;
  int64_t step = 0;
  double now_s = 0;
  int64_t running = 0, finished = 0, total = 0, switches = 0;
  moebius::parallel_mode mode = moebius::parallel_mode::ep;  // the policy's
  configuration config = moebius::parallel_mode::ep;        // the layout it rests in, its dcp
};

// What the cost gate weighs.
enum class gate_kind : uint8_t {
  // moebius::throughput_gate (policy/throughput_gate.hpp): each mode at the batch its pool
  // admits, the residency from known work (a rollout's survivors) or the queue's drain or the
  // predictor; the terms switchable (cost_gate_options::terms).
  throughput,
  // switch_policy's own: (latency(current, load) - latency(target, load)) x the predictor's
  // residency, both modes at the same batch.
  step_time,
};

const char* to_string(gate_kind k);

// The cost gate of a policy run (switching::policy).
struct cost_gate_options {
  bool enabled = true;   // off: the policy's rules alone (and its own expected_residency_steps)
  gate_kind kind = gate_kind::throughput;
  moebius::gate_terms terms;  // gate_kind::throughput: which terms it weighs
  // Correct the curves by what the steps take: per mode, the mean over its recent steps (an
  // exponential mean, 1/64 a step) of the step's time on the serving clock over the curve's
  // at its rows (decode and prefill tokens), which folds in what the calibration's evenly
  // spread decode steps leave out (in EP a prefill chunk on its owner's rank alone, the
  // busiest rank setting the step; contexts other than the calibration's). A mode not yet
  // seen takes the other's factor, EP's with the recent prefill on one rank as far as a rank's
  // chunk goes (prefill_stalls.hpp, ep_prefill_slowdown). Each mode's curve is also
  // slowed by the decodes its prefill-first steps hold (SGLang without mixed chunks: the
  // share of its time those decodes lose over its last 512 steps, prefill_stalls.hpp; the
  // mode not serving estimated from the serving one, its schedulers counted; vLLM holds
  // none). After every step the gate takes the corrected curves; the rules keep the
  // calibrated thresholds. (1/64: the residency predictor's weight of one completion; not
  // tuned.)
  bool correct_curves = true;
  // The share by which the predicted gain must exceed the predicted cost (sets the policy's
  // gate_margin): covers the residency's spread and a cost model off by tens of percent.
  double margin = 0.25;
  // The least gain a step, as a share of the current layout's step at its batch, that a switch
  // must promise (gate_evaluation::least_step_gain_ms): the corrected curves do not resolve two
  // layouts closer than this. Two layouts priced within it are not told apart, so each mode's
  // correction drifting with the work cannot make them look faster in turn and switch back and
  // forth (each switch paying its cost: the experts-only design's two layouts, priced 0.1%
  // apart a step, switched 205 times on a rollout). 1%: a switch that pays over a long queue at
  // a gain of a few percent a step still passes.
  double least_step_gain = 0.01;
  moebius::residency_config residency;
  // Step-latency curves of both modes; empty: calibrated at the run's start on the engine's
  // clock, decode steps at batches 1, 2, 4, ... up to max_running (and max_running itself), at
  // `calibration_context` tokens per sequence (0: the trace's mean prompt + half its output).
  std::optional<moebius::latency_curves> curves;
  int64_t calibration_context = 0;
};

// Where tests reach into a run: fault injection and aborts. Serving leaves them unset.
struct engine_test_hooks {
  // Called before each switch of the run starts, either style (inject a fault here).
  std::function<void(moebius::switcher&, int64_t step)> before_switch;
  // Progressive: called before each advance (inject a fault here), and after it (return true
  // to abort the switch at the cursor reached).
  std::function<void(moebius::switcher&, const moebius::progressive_switch&, int64_t step)>
      before_advance;
  std::function<bool(const moebius::progressive_switch&, int64_t step)> abort_after_advance;
};

struct engine_options {
  scheduler_options scheduler;
  // The layout each of the policy's modes serves in (a deployment's: deployment::modes()); the
  // start mode, a forced switch and the policy's targets are modes, mapped through it. The
  // default: the paper's two layouts, EP and TP.
  mode_layouts layouts;
  moebius::parallel_mode start_mode = moebius::parallel_mode::ep;
  switching how = switching::never;
  moebius::switch_policy_config policy;  // switching::policy
  // switching::policy: start in EP when the requests that have arrived at the first arrival
  // reach T_h (a rollout's batch), else in TP, instead of start_mode.
  bool start_from_load = false;
  // switching::policy: record every decision in which a rule fired (run_result::decisions).
  bool explain = false;
  cost_gate_options gate;                 // switching::policy: the cost gate (on by default)
  std::vector<int64_t> forced_steps;     // switching::forced: step indices, ascending
  // switching::forced: serving times in seconds, ascending, instead of forced_steps when given:
  // a switch before the first step that starts at or after each (one a step; a run priced by
  // another clock takes other steps, so the same indices fall at other times, and these put its
  // switches where a measured run's were).
  std::vector<double> forced_at_s;
  bool validate_every_step = false;      // moebius::validate(kv, tables) after every step
  // step_record::ranks on every EP step outside a switch (to price the steps again offline:
  // the fidelity tool); off, a rollout's records would carry ~200 B more a step.
  bool record_rank_split = false;
  int64_t max_steps = 50'000'000;        // a run longer than this throws (a stuck loop)
  int64_t progress_every_steps = 0;      // 0: no progress callback
  std::function<void(const progress_info&)> on_progress;
  switch_style style = switch_style::stop_the_world;
  // Progressive: the share of the link the copies may use (pacing_params::link_fraction).
  double copy_link_fraction = 0.55;
  // Progressive, with a clock that provides an overlap slowdown curve (step_clock::slowdown()):
  // the most a step may slow down with the layers copied beside it (1.10: 10% longer), and
  // the most it may lengthen, in ms (a switch's steps within normal + 5 ms). The layers per
  // step are cut until both hold, down to one (a switch must end).
  double max_overlap_slowdown = 1.10;
  double max_overlap_extra_ms = 5.0;
  engine_test_hooks test_hooks;
  // Passed to the switcher (switcher_options::verify and verify_layer): layout-independent
  // checksums (switch/checksum.hpp). The tables they are given hold only the tokens each
  // sequence had written when the switch began (written_prefix in kv_pages.hpp): the room
  // reserved beyond them holds stale bytes that a progressive switch's steps overwrite, so it
  // is excluded; those tokens are checked by what the serving tests check, the greedy tokens.
  std::function<uint64_t(moebius::arena_cursor, const moebius::kv_state&)> verify;
  std::function<uint64_t(int64_t layer, moebius::parallel_mode, const moebius::kv_state&)>
      verify_layer;
  // Recovery after a switch that left the switcher inconsistent (a barrier timeout, a device
  // error, a failed undo): with this set the run recovers and serves on (switcher::recover, in
  // the switch's source mode), no restart. It writes every layer's experts where the cursor puts
  // them from a source of truth: host_runtime::place_experts with weights kept on the host, or
  // the checkpoint. Unset: the run throws errc::internal and engine::recover() is the way back.
  std::function<void(moebius::arena_cursor)> reload_experts;
  lost_kv_policy lost_kv = lost_kv_policy::resume;
};


struct decided_switch;  // run_policy.hpp

// What engine::run does with requests and switches that go wrong (docs/ERRORS.md, "The serving
// loop"):
//   - a bad request (scheduler.hpp, validate_request) fails alone: its request_result's error
//     names it and says why; it is never admitted (bad_request_policy::refuse_run: run()
//     throws that error instead, before anything is admitted);
//   - a switch that is refused (capacity: the switcher's check of the live KV, or the running
//     sequences' reservations at their largest in the target) or rolls back (a fault, a verify
//     mismatch, an abort) is recorded in run_result::switches and the run serves on in the
//     mode it is in, the start-mode switch included;
//   - whatever ends a run early (an exception from the runtime, a callback or a check) leaves
//     the engine empty and ready: the progressive switch in flight aborted, every page freed.
class engine {
 public:
  // The runtime's arena must rest at `cursor` and its KV pool hold no live sequence; `t` is
  // a transport over the runtime's memory. The engine's switcher owns the tables from here.
  // `kv_layout`: how the runtime's pool lies (host_runtime::kv_layout(), gpu_runtime's), which
  // every switch honours (switcher_options::kv_layout); empty: the present layout.
  engine(runtime& rt, moebius::transport& t, const moebius::arena_geometry& arena,
         const moebius::kv_geometry& kv, const step_clock& clock, moebius::arena_cursor cursor,
         std::optional<moebius::kv_pool_layout> kv_layout = std::nullopt);

  // Serves `requests` to the end (every request finished, every page free) and returns what
  // happened. Switches first (untimed) to options.start_mode when the engine rests elsewhere.
  run_result run(std::vector<request> requests, const engine_options& options,
                 const std::string& name = "run");

  // One decode step of `batch` sequences at `context` tokens each in `layout` (with the KV
  // geometry's dcp under TP attention) on the serving clock: evaluated directly for a model
  // clock, else run on the runtime with placeholder sequences (KV content meaningless; released
  // after). For calibration.
  // `dcp`: the TP view's (0: the KV geometry's now).
  double decode_step_s(moebius::parallel_layout layout, int64_t batch, int64_t context,
                       int64_t dcp = 0);

  // After a run that threw because a switch left the switcher inconsistent (no
  // engine_options::reload_experts): switcher::recover in `mode` with `reload_experts`, then
  // every page freed (no run is in flight to resume anything). Throws errc::internal when the
  // recovery fails (the report's error), errc::invalid_argument when there is nothing to recover.
  moebius::recovery_report recover(const std::function<void(moebius::arena_cursor)>& reload_experts,
                                   moebius::parallel_mode mode);

  moebius::parallel_mode mode() const { return switcher_.mode(); }
  const moebius::switcher& get_switcher() const { return switcher_; }
  const step_clock& clock() const { return clock_; }

 private:
  struct run_state;  // what one run() carries from step to step (engine_run_state.hpp)
  struct run_cleanup;

  // Switches with no live sequence (untimed) to `target` with the TP view at `dcp` (0: the
  // dcp it is at); the report says how it ended (the last switch's, when the layout and the
  // dcp both change: under data-parallel attention the dcp first, which moves nothing).
  moebius::switch_report switch_untimed(moebius::parallel_layout target, int64_t dcp = 0);
  // The plan of a switch to `to` at the TP view's `dcp`: a dcp change when the layout stays
  // (switcher::plan_dcp), else switcher::plan in `scope`.
  moebius::switch_plan plan_switch(moebius::parallel_layout to, int64_t dcp,
                                   moebius::plan_scope scope) const;
  // After any switch: kv_ and the run's scheduler at the switcher's dcp (a committed dcp change
  // moved the TP view; everything that reads the pool reads kv_ or the scheduler's geometry).
  void follow_kv_dcp();
  // Aborts the switch in flight, frees every page, clears the run's hooks. Never throws.
  void end_run(std::optional<run_state>& st) noexcept;
  // The switch to make before this step, if any (never while a progressive switch runs): the
  // policy's decision (run_policy.hpp) with the plan it was priced on, or a forced one.
  std::optional<decided_switch> decide(run_state& st, int64_t step);
  // Runs (stop the world) or begins (progressive) the decided switch; records it.
  void start_switch(run_state& st, decided_switch d, step_record& rec);
  // Whether the running sequences, each at its largest, fit the target of `plan` (the
  // reservations the scheduler holds must survive the switch; TP -> EP the plan's placement);
  // records a refused switch in `s` when not.
  bool reservations_fit(run_state& st, const moebius::switch_plan& plan, switch_record& s);
  void stop_the_world(run_state& st, moebius::switch_plan plan, switch_record& s,
                      step_record& rec);
  // Runs one step through the run's step_runner (step_runner.hpp) and records it. False when
  // nothing could run (only future arrivals: the idle jump takes over).
  bool serve_step(run_state& st, step_record& rec);
  // The progressive switch is over: its record, recovery when it left the switcher
  // inconsistent, the deferred pages; the driver goes.
  void end_progressive(run_state& st);
  // Outcome inconsistent: recovers in s.from (engine_options::reload_experts) and hands the
  // lost sequences to the scheduler; throws errc::internal when it cannot.
  void recover_in_run(run_state& st, const moebius::switch_report& r, switch_record& s);
  void report_progress(const run_state& st, int64_t step) const;

  runtime& runtime_;
  moebius::arena_geometry arena_;
  moebius::kv_geometry kv_;       // at the switcher's dcp (follow_kv_dcp)
  const int64_t home_dcp_;        // the constructor's: what a mode without its own dcp serves at
  const step_clock& clock_;
  moebius::switcher switcher_;
  // The run's hooks, reached through the switcher's (set for one run).
  std::function<uint64_t(moebius::arena_cursor, const moebius::kv_state&)> verify_;
  std::function<uint64_t(int64_t, moebius::parallel_mode, const moebius::kv_state&)> verify_layer_;
  std::vector<std::pair<int64_t, int64_t>> verify_written_;  // (seq, tokens) at the switch's start
  scheduler* sched_ = nullptr;  // the run's: TP -> EP placement by reservations, follow_dcp
};

// Calibration (moebius::calibrate) from the engine's clock: decode-step times of both modes
// (each in its layout of `layouts`) at each batch in `batches` (>= 2 distinct, each >= 1) at
// `context` tokens per sequence.
moebius::calibration_result calibrate_engine(engine& e, std::span<const int64_t> batches,
                                             int64_t context,
                                             const moebius::calibration_options& options = {},
                                             const mode_layouts& layouts = {});

}  // namespace mini_engine
