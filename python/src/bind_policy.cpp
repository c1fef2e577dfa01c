// The switch policy (policy/switch_policy.hpp): when to switch.

#include <nanobind/stl/string.h>

#include "common.hpp"

namespace moebius::python {

namespace {

// switch_policy plus the Python capacity callable its capacity_check points at. The policy
// holds a pointer to `capacity`, so this object never moves (nanobind constructs it in place).
struct py_switch_policy {
  nb::object capacity;
  switch_policy policy;

  static bool call_capacity(void* context, parallel_mode target) {
    // step() runs with the GIL held (it is cheap: no release), so calling back is safe.
    return nb::cast<bool>((*static_cast<nb::object*>(context))(target));
  }

  py_switch_policy(const switch_policy_config& config, nb::object capacity_fn)
      : capacity(std::move(capacity_fn)),
        policy(config, capacity.is_none() ? capacity_check{}
                                          : capacity_check{&call_capacity, &capacity}) {}
};

nb::dict to_dict(const switch_policy_stats& s) {
  nb::dict by_reason;
  for (int r = 0; r < num_decision_reasons; ++r) {
    by_reason[to_string(static_cast<decision_reason>(r))] = s.by_reason[r];
  }
  nb::dict d;
  d["steps"] = s.steps;
  d["switches"] = s.switches;
  d["external_switches"] = s.external_switches;
  d["by_reason"] = by_reason;
  return d;
}

}  // namespace

void bind_policy(nb::module_& m) {
  nb::enum_<down_rule>(m, "DownRule", "How the EP -> TP window decides 'below T_l'.")
      .value("mean", down_rule::mean)
      .value("every", down_rule::every);

  nb::enum_<decision_reason>(m, "DecisionReason")
      .value("hold", decision_reason::hold)
      .value("above_high", decision_reason::above_high)
      .value("below_low", decision_reason::below_low)
      .value("cooldown", decision_reason::cooldown)
      .value("capacity_refused", decision_reason::capacity_refused)
      .value("cost_exceeds_gain", decision_reason::cost_exceeds_gain)
      .value("admission_blocked", decision_reason::admission_blocked);

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
      .def_rw("expected_residency_steps", &switch_policy_config::expected_residency_steps)
      .def_rw("gate_margin", &switch_policy_config::gate_margin,
              "the share by which a switch's predicted gain must exceed its predicted cost")
      .def_rw("enter_on_blocked_admission", &switch_policy_config::enter_on_blocked_admission,
              "in TP, requests waiting with the pool full count as a load at or above t_high")
      .def("validate", [](const switch_policy_config& c) { validate(c); },
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

  nb::class_<switch_decision>(m, "SwitchDecision")
      .def_ro("do_switch", &switch_decision::do_switch, "switch to `target` now")
      .def_ro("target", &switch_decision::target, "the mode a rule pointed at (unless hold)")
      .def_ro("reason", &switch_decision::reason)
      .def_prop_ro("blocked", &switch_decision::blocked)
      .def("__bool__", [](const switch_decision& d) { return d.do_switch; })
      .def("__repr__", &printed<switch_decision>);

  nb::class_<py_switch_policy>(m, "SwitchPolicy",
                               "Decides, once per engine step, whether to switch.")
      .def(nb::init<const switch_policy_config&, nb::object>(), nb::arg("config"),
           nb::arg("capacity") = nb::none(),
           "capacity(target: Mode) -> bool is asked before a switch is proposed (e.g.\n"
           "lambda m: switcher.check(m)['fits']); None: always fits.")
      .def(
          "step",
          [](py_switch_policy& p, int64_t load, parallel_mode current, double now_s,
             bool admission_blocked) {
            return p.policy.step(load, current, now_s, admission_blocked);
          },
          nb::arg("load"), nb::arg("current"), nb::arg("now_s"),
          nb::arg("admission_blocked") = false,
          "One engine step: `load` active sequences, the mode the engine runs now, a\n"
          "monotonic time in seconds, whether requests wait with the pool full (counts with\n"
          "enter_on_blocked_admission). Returns a SwitchDecision (truthy when it says switch).")
      .def(
          "set_residency_predictor",
          [](py_switch_policy& p, const residency_predictor* r) {
            p.policy.set_residency_predictor(r);
          },
          nb::arg("predictor").none(), nb::keep_alive<1, 2>(),
          "The gate's residency prediction (None: expected_residency_steps).")
      .def_prop_ro(
          "last_gate",
          [](const py_switch_policy& p) {
            const gate_evaluation& g = p.policy.last_gate();
            nb::dict d;
            d["evaluated"] = g.evaluated;
            d["target"] = g.target;
            d["load"] = g.load;
            d["residency_steps"] = g.residency_steps;
            d["gain_ms"] = g.gain_ms;
            d["cost_ms"] = g.cost_ms;
            d["passed"] = g.passed;
            return d;
          },
          "{evaluated, target, load, residency_steps, gain_ms, cost_ms, passed}")
      .def("reset", [](py_switch_policy& p) { p.policy.reset(); })
      .def_prop_ro("config", [](const py_switch_policy& p) { return p.policy.config(); })
      .def_prop_ro("stats", [](const py_switch_policy& p) { return to_dict(p.policy.stats()); },
                   "{steps, switches, external_switches, by_reason: {reason: count}}")
      .def("window_mean", [](const py_switch_policy& p) { return p.policy.window_mean(); });
}

}  // namespace moebius::python
