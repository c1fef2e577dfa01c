// The policy (policy/): when to switch, in two phases (switch_policy.hpp: the rules propose, the
// caller plans the proposal once and prices it, the policy decides), the gates that price a
// proposal (step_time_gate.hpp, throughput_gate.hpp), the residency they weigh
// (residency.hpp) and the latency curves they read (calibration.hpp).

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <tuple>
#include <vector>

#include "common.hpp"

namespace moebius::python {

namespace {

using sample_list = std::vector<std::tuple<double, double>>;  // (batch, ms)

std::vector<latency_sample> samples_of(const sample_list& s) {
  std::vector<latency_sample> out;
  out.reserve(s.size());
  for (const auto& [batch, ms] : s) out.push_back({batch, ms});
  return out;
}

void bind_calibration(nb::module_& m) {
  nb::enum_<curve_fit>(m, "CurveFit", "How a latency curve is fitted to its samples.")
      .value("least_squares_line", curve_fit::least_squares_line)
      .value("piecewise_linear", curve_fit::piecewise_linear);

  nb::class_<latency_curve>(m, "LatencyCurve",
                            "Decode-step latency of one mode against the batch (calibration.hpp).")
      .def(nb::init<>())
      .def_static(
          "fit",
          [](const sample_list& samples, curve_fit kind) {
            const std::vector<latency_sample> s = samples_of(samples);
            return latency_curve::fit(s, kind);
          },
          nb::arg("samples"), nb::arg("kind") = curve_fit::least_squares_line,
          "Fits (batch, ms) samples: fit([(1, 10), (3, 14)]) -> 8 + 2 * batch.")
      .def("at", &latency_curve::at, nb::arg("batch"), "Latency in ms at `batch`.")
      .def_prop_ro("kind", &latency_curve::kind)
      .def_prop_ro("min_batch", &latency_curve::min_batch)
      .def_prop_ro("max_batch", &latency_curve::max_batch)
      .def_prop_ro("slope", &latency_curve::slope, "line: ms per sequence")
      .def_prop_ro("intercept", &latency_curve::intercept, "line: ms at batch 0")
      .def_prop_ro(
          "knots",
          [](const latency_curve& c) {
            sample_list out;
            for (const latency_sample& k : c.knots()) out.emplace_back(k.batch, k.ms);
            return out;
          },
          "piecewise: the (batch, ms) knots; line: empty")
      .def("__repr__", &printed<latency_curve>);

  nb::class_<latency_curves>(m, "LatencyCurves", "Both modes' curves (what the gates read).")
      .def(
          "__init__",
          [](latency_curves* c, const latency_curve& ep, const latency_curve& tp) {
            new (c) latency_curves{ep, tp};
          },
          nb::arg("ep"), nb::arg("tp"))
      .def_rw("ep", &latency_curves::ep)
      .def_rw("tp", &latency_curves::tp)
      .def("latency_ms", &latency_curves::latency_ms, nb::arg("mode"), nb::arg("batch"));

  nb::enum_<crossover_status>(m, "CrossoverStatus")
      .value("found", crossover_status::found)
      .value("tp_always_faster", crossover_status::tp_always_faster)
      .value("ep_always_faster", crossover_status::ep_always_faster)
      .value("wrong_orientation", crossover_status::wrong_orientation);

  record<crossover> cross(m, "Crossover",
                          "Where TP stops being faster than EP (find_crossover).");
  cross.field("status", &crossover::status)
      .field("batch", &crossover::batch, "B* (valid when status is found)")
      .field("num_crossings", &crossover::num_crossings)
      .field("range_lo", &crossover::range_lo, "common measured range of both modes")
      .field("range_hi", &crossover::range_hi)
      .done();

  record<calibration_options> options(m, "CalibrationOptions");
  options.def(nb::init<>());
  options.field_rw("fit", &calibration_options::fit)
      .field_rw("margin", &calibration_options::margin, "T_h = ceil(B* * (1 + margin))")
      .field_rw("low_ratio", &calibration_options::low_ratio, "T_l = round(low_ratio * T_h)")
      .done();

  record<calibration_result> result(m, "CalibrationResult");
  result.field("curves", &calibration_result::curves)
      .field("cross", &calibration_result::cross)
      .field("has_thresholds", &calibration_result::has_thresholds)
      .field("t_high", &calibration_result::t_high)
      .field("t_low", &calibration_result::t_low)
      .done(/*comparable=*/false);

  m.def("find_crossover", &find_crossover, nb::arg("curves"),
        "ep = 20 + 0.05 b, tp = 10 + 0.1 b measured on [1, 512] -> found, B* = 200.");
  m.def(
      "calibrate",
      [](const sample_list& ep, const sample_list& tp, const calibration_options& options) {
        const std::vector<latency_sample> e = samples_of(ep), t = samples_of(tp);
        return calibrate(e, t, options);
      },
      nb::arg("ep_samples"), nb::arg("tp_samples"), nb::arg("options") = calibration_options{},
      "Fits both curves from (batch, ms) samples, finds B* and derives T_h / T_l.");
  m.def("apply_calibration", &apply_calibration, nb::arg("result"), nb::arg("base"),
        "`base` (a SwitchPolicyConfig) with T_h / T_l from `result`.");
}

void bind_gates(nb::module_& m) {
  record<gate_evaluation> gate(
      m, "GateEvaluation",
      "What a gate weighed for one proposed switch (weigh_step_time, weigh_switch): hand it\n"
      "to SwitchPolicy.decide in a SwitchPricing, and keep it for traces. An engine with a\n"
      "gate of its own makes one with the keywords.");
  gate.def(
      "__init__",
      [](gate_evaluation* g, bool evaluated, parallel_mode target, int64_t load,
         int64_t residency_steps, double gain_ms, double cost_ms, bool passed,
         int64_t current_batch, int64_t target_batch, int64_t waiting, bool priced) {
        new (g) gate_evaluation{};
        g->evaluated = evaluated;
        g->target = target;
        g->load = load;
        g->residency_steps = residency_steps;
        g->gain_ms = gain_ms;
        g->cost_ms = cost_ms;
        g->passed = passed;
        g->current_batch = current_batch;
        g->target_batch = target_batch;
        g->waiting = waiting;
        g->priced = priced;
      },
      nb::kw_only(), nb::arg("evaluated") = false, nb::arg("target") = parallel_mode::ep,
      nb::arg("load") = 0, nb::arg("residency_steps") = 0, nb::arg("gain_ms") = 0.0,
      nb::arg("cost_ms") = 0.0, nb::arg("passed") = false, nb::arg("current_batch") = 0,
      nb::arg("target_batch") = 0, nb::arg("waiting") = 0, nb::arg("priced") = true);
  gate.field("evaluated", &gate_evaluation::evaluated, "False: no gate weighed the switch")
      .field("target", &gate_evaluation::target)
      .field("load", &gate_evaluation::load)
      .field("residency_steps", &gate_evaluation::residency_steps)
      .field("gain_ms", &gate_evaluation::gain_ms,
             "time the target saves over the residency")
      .field("cost_ms", &gate_evaluation::cost_ms, "predicted switch cost (before the margin)")
      .field("passed", &gate_evaluation::passed)
      .field("current_batch", &gate_evaluation::current_batch,
             "throughput gate: the batch the current mode runs")
      .field("target_batch", &gate_evaluation::target_batch,
             "throughput gate: the batch the target's pool would admit")
      .field("waiting", &gate_evaluation::waiting, "requests waiting for admission")
      .prop("residency_from",
            [](const gate_evaluation& g) { return std::string(g.residency_from); },
            "'known work', 'queue', 'predictor', 'fixed' or ''")
      .field("priced", &gate_evaluation::priced,
             "False: weighed against the least the switch could cost, before planning it")
      .done();

  record<gate_terms> terms(m, "GateTerms",
                           "The throughput gate's terms, each of which can be turned off.");
  terms.def(
      "__init__",
      [](gate_terms* t, bool admission, bool queueing, bool known_work) {
        new (t) gate_terms{admission, queueing, known_work};
      },
      nb::arg("admission") = true, nb::arg("queueing") = true, nb::arg("known_work") = true);
  terms.field_rw("admission", &gate_terms::admission, "each mode runs the batch its pool admits")
      .field_rw("queueing", &gate_terms::queueing,
                "the residency is at least the time to serve the queue")
      .field_rw("known_work", &gate_terms::known_work,
                "the residency from known work (a rollout's survivors) when given")
      .done();

  record<serving_load> load(m, "ServingLoad", "What the engine knows when a rule fires.");
  load.def(
      "__init__",
      [](serving_load* l, int64_t running, int64_t waiting, int64_t max_running,
         int64_t admits_ep, int64_t admits_tp, double queue_tokens,
         int64_t known_residency_steps, int64_t predicted_residency_steps) {
        new (l) serving_load{running,      waiting,      max_running,
                             admits_ep,    admits_tp,    queue_tokens,
                             known_residency_steps, predicted_residency_steps};
      },
      nb::kw_only(), nb::arg("running") = 0, nb::arg("waiting") = 0, nb::arg("max_running") = 1,
      nb::arg("admits_ep") = 0, nb::arg("admits_tp") = 0, nb::arg("queue_tokens") = 0.0,
      nb::arg("known_residency_steps") = -1, nb::arg("predicted_residency_steps") = 1);
  load.field_rw("running", &serving_load::running, "sequences running now")
      .field_rw("waiting", &serving_load::waiting, "arrived requests waiting for admission")
      .field_rw("max_running", &serving_load::max_running, "the scheduler's cap (>= 1)")
      .field_rw("admits_ep", &serving_load::admits_ep,
                "sequences EP's pool holds at the live mean KV")
      .field_rw("admits_tp", &serving_load::admits_tp)
      .field_rw("queue_tokens", &serving_load::queue_tokens,
                "expected tokens the waiting requests will generate")
      .field_rw("known_residency_steps", &serving_load::known_residency_steps,
                "from known work; < 0: unknown")
      .field_rw("predicted_residency_steps", &serving_load::predicted_residency_steps,
                "the residency predictor's (>= 1): residency_steps(...)")
      .done();
  load.def("admits", &serving_load::admits, nb::arg("mode"));

  m.def("weigh_step_time", &weigh_step_time, nb::arg("curves"), nb::arg("current"),
        nb::arg("target"), nb::arg("load"), nb::arg("residency_steps"), nb::arg("switch_ms"),
        nb::arg("margin") = 0.0,
        "The step-time gate (step_time_gate.hpp): gain_ms = (latency(current, load) -\n"
        "latency(target, load)) * residency_steps; passes when gain_ms >= switch_ms * (1 +\n"
        "margin). residency_steps <= 0 (unknown): not evaluated. EP 20 + 0.05 b, TP 10 + 0.1 b,\n"
        "EP -> TP at load 10 over 100 steps: gain 950 ms; a 949 ms switch passes, 951 does not.");
  m.def("weigh_switch", &weigh_switch, nb::arg("curves"), nb::arg("current"), nb::arg("target"),
        nb::arg("load"), nb::arg("switch_ms"), nb::arg("margin") = 0.0,
        nb::arg("terms") = gate_terms{},
        "The throughput gate (throughput_gate.hpp) on a ServingLoad: each mode runs the batch\n"
        "its pool admits; gain_ms = R * (lat_cur(B_cur) - B_cur * lat_tgt(B_tgt) / B_tgt).");
}

}  // namespace

void bind_policy(nb::module_& m) {
  bind_calibration(m);

  nb::enum_<down_rule>(m, "DownRule", "How the EP -> TP window decides 'below T_l'.")
      .value("mean", down_rule::mean)
      .value("every", down_rule::every);

  nb::enum_<decision_reason>(m, "DecisionReason")
      .value("hold", decision_reason::hold, "no rule fired")
      .value("above_high", decision_reason::above_high, "TP -> EP: load >= T_h")
      .value("below_low", decision_reason::below_low, "EP -> TP: window below T_l")
      .value("cooldown", decision_reason::cooldown, "a rule fired too soon after a switch")
      .value("capacity_refused", decision_reason::capacity_refused,
             "the target cannot hold the live KV (SwitchPricing.fits False)")
      .value("cost_exceeds_gain", decision_reason::cost_exceeds_gain,
             "the gate did not pass (SwitchPricing.gate)")
      .value("admission_blocked", decision_reason::admission_blocked,
             "TP -> EP: requests wait and TP's pool admits none")
      .value("sustained_gain", decision_reason::sustained_gain,
             "TP -> EP: the caller finds EP faster at the sustained load");

  nb::class_<switch_policy_config>(
      m, "SwitchPolicyConfig",
      "Asymmetric hysteresis: enter EP at load >= t_high for up_window steps; leave EP when\n"
      "the last down_window loads are below t_low; cooldown after any switch.")
      .def(nb::init<>())
      .def_rw("t_high", &switch_policy_config::t_high)
      .def_rw("t_low", &switch_policy_config::t_low)
      .def_rw("up_window", &switch_policy_config::up_window)
      .def_rw("down_window", &switch_policy_config::down_window)
      .def_rw("rule", &switch_policy_config::rule)
      .def_rw("cooldown_steps", &switch_policy_config::cooldown_steps)
      .def_rw("cooldown_s", &switch_policy_config::cooldown_s)
      .def_rw("expected_residency_steps", &switch_policy_config::expected_residency_steps,
              "the residency a gate weighs without a predictor (residency_steps; 0: unknown)")
      .def_rw("gate_margin", &switch_policy_config::gate_margin,
              "the share by which a switch's predicted gain must exceed its predicted cost")
      .def_rw("enter_on_blocked_admission", &switch_policy_config::enter_on_blocked_admission,
              "in TP, requests waiting with the pool full count as a load at or above t_high")
      .def_rw("enter_on_sustained_gain", &switch_policy_config::enter_on_sustained_gain,
              "in TP, the caller finding EP faster at the sustained load counts as a load at or\n"
              "above t_high")
      .def(
          "validate", [](const switch_policy_config& c) { validate(c); },
          "Raises moebius.Error(code='invalid_argument') naming the broken constraint.")
      .def("__repr__", &printed<switch_policy_config>);

  m.def("interactive_config", &interactive_config, nb::arg("t_high"),
        nb::arg("low_ratio") = 0.8, "T_l = round(0.8 * T_h): interactive_config(256) -> 256/205.");
  m.def("rollout_config", &rollout_config, nb::arg("t_high"), nb::arg("cooldown_steps") = 0,
        "RL rollout: T_l = T_h, W = 1: switch to TP at the first load < T_h.");

  nb::class_<residency_config>(
      m, "ResidencyConfig",
      "Residency prediction: window_steps (arrival-rate time constant), horizon_steps (the\n"
      "longest prediction).")
      .def(nb::init<>())
      .def_rw("window_steps", &residency_config::window_steps)
      .def_rw("horizon_steps", &residency_config::horizon_steps)
      .def("validate", [](const residency_config& c) { validate(c); })
      .def("__repr__", &printed<residency_config>);

  nb::class_<residency_predictor>(
      m, "ResidencyPredictor",
      "Steps the engine will stay in a mode, from recent arrival and completion rates\n"
      "(policy/residency.hpp). observe() once per engine step.")
      .def(nb::init<const residency_config&>(), nb::arg("config") = residency_config{})
      .def(
          "observe",
          [](residency_predictor& p, int64_t arrivals, int64_t completions,
             int64_t completed_steps, int64_t running) {
            p.observe({arrivals, completions, completed_steps, running});
          },
          nb::arg("arrivals"), nb::arg("completions"), nb::arg("completed_steps"),
          nb::arg("running"),
          "One step: requests arrived, requests finished, the steps those ran in all, and\n"
          "the sequences running after it.")
      .def("steps_until_cross", &residency_predictor::steps_until_cross, nb::arg("load"),
           nb::arg("boundary"))
      .def_prop_ro("arrival_rate", &residency_predictor::arrival_rate)
      .def_prop_ro("mean_lifetime_steps", &residency_predictor::mean_lifetime_steps)
      .def_prop_ro("drift", &residency_predictor::drift)
      .def("completion_rate", &residency_predictor::completion_rate, nb::arg("running"))
      .def("reset", &residency_predictor::reset)
      .def("__repr__", &printed<residency_predictor>);

  m.def("residency_boundary", &residency_boundary, nb::arg("config"), nb::arg("target"),
        "The load at which the residency a gate weighs ends: T_l after entering EP, T_h after\n"
        "entering TP. T_h 256, T_l 205: to EP -> 205, to TP -> 256.");
  m.def("residency_steps", &residency_steps, nb::arg("config"), nb::arg("predictor").none(),
        nb::arg("load"), nb::arg("target"),
        "The steps the engine is predicted to stay in `target` after switching at `load`:\n"
        "predictor.steps_until_cross(load, residency_boundary(config, target)), or without a\n"
        "predictor (None) config.expected_residency_steps (0: unknown).");

  bind_gates(m);

  record<switch_decision> decision(m, "SwitchDecision",
                                   "What SwitchPolicy.decide settled (truthy when it switches).");
  decision.field("do_switch", &switch_decision::do_switch, "switch to `target` now")
      .field("target", &switch_decision::target, "the mode a rule pointed at (unless hold)")
      .field("reason", &switch_decision::reason)
      .prop("blocked", &switch_decision::blocked,
            "a rule fired and was refused (cooldown, capacity_refused, cost_exceeds_gain)")
      .done();
  decision.def("__bool__", [](const switch_decision& d) { return d.do_switch; });

  record<switch_proposal> proposal(
      m, "SwitchProposal",
      "What the rules say at one step (SwitchPolicy.propose): a switch to `target` (reason\n"
      "above_high, below_low or admission_blocked), or stay (hold, cooldown). Truthy when a\n"
      "switch is proposed: plan it once, price it, and hand both to decide().");
  proposal.field("target", &switch_proposal::target)
      .field("reason", &switch_proposal::reason)
      .field("load", &switch_proposal::load, "the load it was proposed at")
      .field("step", &switch_proposal::step, "the policy's step index it was made at")
      .prop("proposed", &switch_proposal::proposed)
      .done();
  proposal.def("__bool__", &switch_proposal::proposed);

  record<switch_pricing> pricing(
      m, "SwitchPricing",
      "What the caller found pricing a proposed switch from its one plan: fits (the plan's\n"
      "capacity) and what a gate weighed (a GateEvaluation; not evaluated: no gate).");
  pricing.def(
      "__init__",
      [](switch_pricing* p, bool fits, const gate_evaluation& gate) {
        new (p) switch_pricing{fits, gate};
      },
      nb::arg("fits") = true, nb::arg("gate") = gate_evaluation{});
  pricing.field_rw("fits", &switch_pricing::fits, "the target holds every live sequence's KV")
      .field_rw("gate", &switch_pricing::gate, "a GateEvaluation")
      .done();

  record<switch_policy_stats> stats(m, "SwitchPolicyStats", "Counters for traces and tests.");
  stats.field("steps", &switch_policy_stats::steps)
      .field("switches", &switch_policy_stats::switches, "switches decided")
      .field("external_switches", &switch_policy_stats::external_switches,
             "mode changes not proposed by the policy")
      .prop(
          "by_reason",
          [](const switch_policy_stats& s) {
            nb::dict out;
            for (int r = 0; r < num_decision_reasons; ++r) {
              out[nb::cast(static_cast<decision_reason>(r))] = s.by_reason[r];
            }
            return out;
          },
          "{DecisionReason: decisions}")
      .done();

  nb::class_<switch_policy>(
      m, "SwitchPolicy",
      "Decides, once per engine step, whether to switch, in two phases:\n\n"
      "    p = policy.propose(load, sw.mode, now)\n"
      "    pricing, plan = moebius.SwitchPricing(), None\n"
      "    if p:                                  # a rule fired: plan it once, price it\n"
      "        plan = sw.plan(p.target)\n"
      "        pricing.fits = plan.capacity.fits\n"
      "        if pricing.fits:\n"
      "            pricing.gate = moebius.weigh_step_time(curves, sw.mode, p.target, p.load,\n"
      "                moebius.residency_steps(config, predictor, p.load, p.target),\n"
      "                switch_ms, config.gate_margin)\n"
      "    if policy.decide(p, pricing):\n"
      "        sw.switch_to(plan)\n\n"
      "Every propose() is followed by one decide() of its proposal; step() is both with an\n"
      "empty pricing (the rules alone).")
      .def(nb::init<const switch_policy_config&>(), nb::arg("config"))
      .def("propose", &switch_policy::propose, nb::arg("load"), nb::arg("current"),
           nb::arg("now_s"), nb::arg("admission_blocked") = false,
           nb::arg("sustained_gain") = false,
           "The rules at one engine step: `load` active sequences, the mode the engine runs\n"
           "now, a monotonic time in seconds, whether requests wait with the pool full (counts\n"
           "with enter_on_blocked_admission), whether the caller finds EP faster at the\n"
           "sustained load (counts with enter_on_sustained_gain). Returns a SwitchProposal;\n"
           "decide() settles it.\n"
           "Raises moebius.Error(code='invalid_argument') when the last proposal was not\n"
           "decided.")
      .def("decide", &switch_policy::decide, nb::arg("proposal"),
           nb::arg("pricing") = switch_pricing{},
           "Settles the last proposal: stay (hold, cooldown), refused (capacity_refused when\n"
           "not pricing.fits, else cost_exceeds_gain when pricing.gate was evaluated and did\n"
           "not pass) or switch (the cooldown starts). Returns a SwitchDecision.")
      .def("step", &switch_policy::step, nb::arg("load"), nb::arg("current"), nb::arg("now_s"),
           nb::arg("admission_blocked") = false, nb::arg("sustained_gain") = false,
           "The rules alone, no capacity check and no gate: decide(propose(...)).")
      .def("set_thresholds", &switch_policy::set_thresholds, nb::arg("t_high"), nb::arg("t_low"),
           "New thresholds from here on; the windows, cooldown and stats stay.")
      .def("reset", &switch_policy::reset, "Forgets history, cooldown and stats.")
      .def_prop_ro("config", [](const switch_policy& p) { return p.config(); })
      .def_prop_ro(
          "stats", [](const switch_policy& p) { return p.stats(); }, "a SwitchPolicyStats")
      .def("window_mean", &switch_policy::window_mean);
}

}  // namespace moebius::python
