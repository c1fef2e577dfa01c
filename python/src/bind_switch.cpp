// The switcher (switch/switcher.hpp): its options, the plan it makes once per decision
// (switch/switch_plan.hpp), the reports, the progressive-switch session
// (switch/progressive.hpp) and the layout-independent checksums (switch/checksum.hpp).

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <vector>

#include "common.hpp"

namespace moebius::python {

nb::dict metrics_dict(const switch_report& r) {
  nb::dict out;
  for (const switch_metric& m : metrics_of(r)) out[nb::str(m.name.data(), m.name.size())] = m.value;
  return out;
}

namespace {

// A Python callable that C++ may copy and call without holding the GIL: calls acquire it,
// and the last copy releases the object under the GIL. A Python exception becomes a
// std::runtime_error with its text (the switcher turns it into a rolled-back report).
class py_callback {
 public:
  explicit py_callback(nb::object f)
      : f_(new nb::object(std::move(f)), [](nb::object* o) {
          nb::gil_scoped_acquire gil;
          delete o;
        }) {}

  template <class R, class... Args>
  R call(Args&&... args) const {
    nb::gil_scoped_acquire gil;
    std::string failure;
    try {
      nb::object result = (*f_)(std::forward<Args>(args)...);
      if constexpr (!std::is_void_v<R>) return nb::cast<R>(result);
      else return;
    } catch (nb::python_error& e) {
      failure = e.what();
    } catch (nb::cast_error&) {
      failure = "callback returned a value of the wrong type";
    }
    throw std::runtime_error("Python callback failed: " + failure);
  }

 private:
  std::shared_ptr<nb::object> f_;
};

std::vector<std::span<const std::byte>> host_spans(const std::vector<nb::handle>& ranks,
                                                   memory_space s) {
  std::vector<std::span<const std::byte>> spans;
  for (nb::handle r : ranks) {
    const py_rank_memory& mem = nb::cast<const py_rank_memory&>(r);
    MOEBIUS_CHECK(!mem.on_device(), errc::invalid_argument,
                  "checksums read host memory; copy device memory to the host first");
    const memory_span& span = mem.memory.space(s);
    spans.emplace_back(span.data(), static_cast<size_t>(span.bytes));
  }
  return spans;
}

}  // namespace

namespace {

// The switcher_options of Switcher(...)'s keywords: every field, each callable wrapped so that
// C++ may call it without the GIL. Arguments that reach a callable are copies (a callable may
// keep them).
switcher_options options_of(nb::object on_commit, nb::object verify, nb::object verify_layer,
                            nb::object ep_placement, std::optional<kv_pool_layout> kv_layout,
                            bool stage_kv_in_free_slot, int64_t max_kv_rounds) {
  switcher_options o;
  o.stage_kv_in_free_slot = stage_kv_in_free_slot;
  o.max_kv_rounds = max_kv_rounds;
  if (!on_commit.is_none()) {
    o.on_commit = [f = py_callback(on_commit)](parallel_layout l) { f.call<void>(l); };
  }
  if (!verify.is_none()) {
    o.verify = [f = py_callback(verify)](arena_cursor c, const kv_state& s) {
      return f.call<uint64_t>(c.tp_layers, kv_state(s));
    };
  }
  if (!verify_layer.is_none()) {
    o.verify_layer = [f = py_callback(verify_layer)](int64_t layer, parallel_mode mode,
                                                      const kv_state& tables) {
      return f.call<uint64_t>(layer, mode, kv_state(tables));
    };
  }
  if (!ep_placement.is_none()) {
    o.ep_placement = [f = py_callback(ep_placement)](const kv_state& tp_tables) {
      return f.call<kv_placement>(kv_state(tp_tables));
    };
  }
  o.kv_layout = std::move(kv_layout);
  return o;
}

std::optional<kv_migration> migration_of(const std::shared_ptr<const kv_migration>& k) {
  return k ? std::optional<kv_migration>(*k) : std::nullopt;
}

void bind_reports(nb::module_& m) {
  nb::enum_<switch_outcome>(m, "SwitchOutcome", "How a switch ended (SwitchReport.outcome).")
      .value("committed", switch_outcome::committed,
             "weights, KV and tables are in the target mode; the selector flipped")
      .value("already_there", switch_outcome::already_there, "nothing moved")
      .value("refused_capacity", switch_outcome::refused_capacity,
             "the target cannot hold the live KV: nothing moved")
      .value("rolled_back", switch_outcome::rolled_back,
             "a failure; everything is back as before the call")
      .value("inconsistent", switch_outcome::inconsistent,
             "a failure and a failed undo: recover() rebuilds a consistent state")
      .value("in_progress", switch_outcome::in_progress,
             "a progressive switch has begun and not yet ended");

  nb::enum_<switch_style>(m, "SwitchStyle", "How a switch ran (SwitchEvent.style).")
      .value("whole", switch_style::whole, "switch_to: stop the world")
      .value("progressive", switch_style::progressive, "begin ... finish / abort");

  record<layer_bytes> bytes(
      m, "LayerBytes",
      "What one layer of a progressive switch sends per rank (the pacing input).");
  bytes.field("weight_bytes_sent", &layer_bytes::weight_bytes_sent, "[P] leaving rank r")
      .field("kv_bytes_sent", &layer_bytes::kv_bytes_sent, "[P]")
      .prop("busiest", &layer_bytes::busiest,
            "the busiest rank's weights + KV: the bytes per layer pacing takes")
      .done();

  record<switch_report> report(
      m, "SwitchReport",
      "What a switch did (switch/switch_report.hpp): its outcome, how far it got, what it\n"
      "moved and how long each stage took; str() is the C++ summary line.");
  report.prop("from_", [](const switch_report& r) { return r.from; }, "the ParallelLayout it left")
      .field("to", &switch_report::to, "the ParallelLayout it went to")
      .field("from_dcp", &switch_report::from_dcp, "the TP view's dcp before")
      .field("to_dcp", &switch_report::to_dcp, "the TP view's dcp after")
      .field("outcome", &switch_report::outcome, "a SwitchOutcome")
      .field("error", &switch_report::error, "the failure (and the undo's), '' when none")
      .prop("cursor", [](const switch_report& r) { return r.cursor.tp_layers; },
            "where the arena rests after the call (layers below it in TP)")
      .field("weight_phases", &switch_report::weight_phases, "one per layer")
      .field("weight_phases_completed", &switch_report::weight_phases_completed)
      .field("kv_rounds", &switch_report::kv_rounds)
      .field("kv_rounds_completed", &switch_report::kv_rounds_completed)
      .field("weight_bytes_sent", &switch_report::weight_bytes_sent,
             "[P] bytes leaving rank r for other ranks")
      .field("kv_bytes_sent", &switch_report::kv_bytes_sent, "[P]")
      .field("workload", &switch_report::workload, "a SwitchWorkload (the cost model's terms)")
      .field("kv_stats", &switch_report::kv_stats, "a KvMigrationStats")
      .field("capacity", &switch_report::capacity, "a KvCapacityReport")
      .field("capacity_ms", &switch_report::capacity_ms)
      .field("plan_ms", &switch_report::plan_ms)
      .field("weights_ms", &switch_report::weights_ms)
      .field("kv_ms", &switch_report::kv_ms)
      .field("verify_ms", &switch_report::verify_ms)
      .field("undo_ms", &switch_report::undo_ms)
      .field("total_ms", &switch_report::total_ms)
      .field("verified", &switch_report::verified,
             "the verify hook ran and its checksums matched")
      .prop("metrics", &metrics_dict,
            "The flat metrics (switch_stats.hpp metrics_of), Prometheus-style names to float:\n"
            "{'moebius_switch_total_ms': ..., 'moebius_switch_weights_bytes': ...}.")
      .done();
  report.def("__str__", &printed<switch_report>);

  record<switch_plan_origin> origin(m, "SwitchPlanOrigin",
                                    "The switcher state a SwitchPlan was made on.");
  origin.field("switcher_id", &switch_plan_origin::switcher_id)
      .field("generation", &switch_plan_origin::generation, "its state generation then")
      .done();

  record<switch_plan> plan(
      m, "SwitchPlan",
      "A switch planned once (Switcher.plan; switch/switch_plan.hpp): the capacity verdicts,\n"
      "the bytes per layer (pacing), the EP placement and the weight and KV plans, stamped\n"
      "with the switcher state it was made on. Hand the same plan to the capacity check, the\n"
      "cost estimate, the pacing and Switcher.switch_to(plan) / begin(plan), which run exactly\n"
      "it. Valid for that state only: Switcher.why_stale(plan) says why not.");
  plan.field("origin", &switch_plan::origin)
      .prop("from_", [](const switch_plan& p) { return p.from; },
            "the ParallelLayout the switcher was in")
      .field("to", &switch_plan::to, "the target ParallelLayout")
      .field("from_dcp", &switch_plan::from_dcp, "the TP view's dcp before")
      .field("to_dcp", &switch_plan::to_dcp, "the TP view's dcp after (Switcher.plan_dcp)")
      .prop("start", [](const switch_plan& p) { return p.start.tp_layers; },
            "the cursor the arena rests at now")
      .prop("goal", [](const switch_plan& p) { return p.goal.tp_layers; },
            "the cursor in the target")
      .field("capacity", &switch_plan::capacity,
             "stop the world (switch_to): all layers' KV in one migration (Switcher.check)")
      .field("layer_capacity", &switch_plan::layer_capacity,
             "progressive (begin): one layer's migration")
      .field("bytes_per_layer", &switch_plan::bytes_per_layer,
             "a LayerBytes (Switcher.layer_bytes_of); empty when layer_capacity refused")
      .field("ep_placement", &switch_plan::ep_placement,
             "TP -> EP with an ep_placement callable: the owners it gave; empty otherwise")
      .prop("weights", [](const switch_plan& p) { return p.weights ? *p.weights : moebius::plan{}; },
            "every layer's weights from start to goal, one phase per layer (a copy)")
      .prop("kv", [](const switch_plan& p) { return migration_of(p.kv); },
            "the all-layers KvMigration (a copy); None when capacity refused")
      .prop("layer_kv", [](const switch_plan& p) { return migration_of(p.layer_kv); },
            "layer 0's KvMigration (a copy); None when layer_capacity refused or not planned")
      .field("plan_ms", &switch_plan::plan_ms, "host time it took")
      .prop("already_there", &switch_plan::already_there)
      .prop("moves_kv", &switch_plan::moves_kv,
            "the KV's view changes (the attention's layout, or the TP attention's dcp)")
      .prop("changes_dcp", &switch_plan::changes_dcp, "from_dcp != to_dcp")
      .prop("moves_experts", &switch_plan::moves_experts, "the experts' layout changes")
      .done(/*comparable=*/false);

  nb::enum_<plan_scope>(m, "PlanScope", "What Switcher.plan plans.")
      .value("both", plan_scope::both,
             "the all-layers KV plan and the one-layer plan a progressive switch runs")
      .value("stop_the_world", plan_scope::stop_the_world,
             "the all-layers plan only (begin() refuses it): for a caller that never runs a\n"
             "progressive switch");

  record<recovery_report> recovery(m, "RecoveryReport", "What Switcher.recover did.");
  recovery.field("recovered", &recovery_report::recovered)
      .field("layout", &recovery_report::layout)
      .prop("cursor", [](const recovery_report& r) { return r.cursor.tp_layers; })
      .field("kept", &recovery_report::kept, "sequences whose K/V was intact")
      .field("lost", &recovery_report::lost,
             "sequences whose K/V a layer lost: removed, their pages freed")
      .field("kv_plans_run", &recovery_report::kv_plans_run)
      .field("error", &recovery_report::error, "why not recovered; '' when recovered")
      .field("total_ms", &recovery_report::total_ms)
      .done();
}

}  // namespace

void bind_switch(nb::module_& m) {
  bind_reports(m);

  nb::enum_<switch_fault::stage>(m, "SwitchStage", "Stage of a switch (fault injection).")
      .value("weights", switch_fault::stage::weights)
      .value("kv", switch_fault::stage::kv)
      .value("undo", switch_fault::stage::undo);

  nb::class_<progressive_switch>(
      m, "ProgressiveSwitch",
      "A progressive switch in flight (Switcher.begin): advance() a few layers per decode\n"
      "step on the caller's streams, serve hybrid steps (layer l in TP iff l < cursor, with\n"
      "tables(mode) of its mode), poll() until 'ready' (or wait()), finish() or abort(). Leaving a\n"
      "`with` block (or dropping the last reference) while it is open aborts it.")
      .def_prop_ro("open", &progressive_switch::open)
      .def_prop_ro("report", [](const progressive_switch& p) { return p.report(); },
                   "a SwitchReport (outcome in_progress while open)")
      .def_prop_ro("layers_remaining", &progressive_switch::layers_remaining)
      .def_prop_ro("bytes_per_layer", [](const progressive_switch& p) { return p.bytes_per_layer(); },
                   "a LayerBytes: what each layer sends per rank (the plan's)")
      .def_prop_ro("cursor", [](const progressive_switch& p) { return p.view().cursor().tp_layers; },
                   "Layers below it run TP (their copies are complete), the rest EP.")
      .def("mode_of", [](const progressive_switch& p, int64_t layer) { return p.view().mode_of(layer); },
           nb::arg("layer"), "The experts' mode of `layer` (TP below the cursor).")
      .def("layout_of", [](const progressive_switch& p, int64_t layer) { return p.view().layout_of(layer); },
           nb::arg("layer"),
           "The ParallelLayout `layer` runs in: its attention moves with its experts when the\n"
           "switch moves the KV, and stays where it rests when the experts move alone.")
      .def_prop_ro("moves_kv", [](const progressive_switch& p) { return p.view().moves_kv(); })
      .def("tables", [](const progressive_switch& p, parallel_mode m) { return p.view().tables(m); },
           nb::arg("mode"), "The (frozen) page tables attention of `mode` reads, as a copy.")
      .def(
          "advance",
          [](progressive_switch& p, int64_t layers, const std::vector<uintptr_t>& streams) {
            std::vector<stream_handle> handles;
            for (uintptr_t h : streams) handles.push_back(stream_of_int(h));
            const layer_completion* c = nullptr;
            {
              nb::gil_scoped_release release;
              c = &p.advance(layers, handles);
            }
            return std::vector<int64_t>(c->layers().begin(), c->layers().end());
          },
          nb::arg("layers"), nb::arg("streams") = std::vector<uintptr_t>{},
          "Enqueues the next `layers` layers (weights, then that layer's KV) on `streams` (one\n"
          "cudaStream_t as int per local rank, or empty) and returns the layers enqueued, in\n"
          "the order they move. Never waits.")
      .def(
          "poll",
          [](progressive_switch& p) {
            nb::gil_scoped_release release;
            return std::string(to_string(p.poll()));
          },
          "'in_flight' (copies running), 'ready' (the cursor moved past the advance's layers)\n"
          "or 'ended' (the advance failed and was rolled back, or left the switcher\n"
          "inconsistent: see report).")
      .def(
          "wait",
          [](progressive_switch& p) {
            nb::gil_scoped_release release;
            return std::string(to_string(p.wait()));
          },
          "Blocks until the outstanding advance has finished: 'ready', or 'ended' when it\n"
          "failed (as poll() would say). Without one outstanding, returns at once.")
      .def(
          "finish",
          [](progressive_switch& p) {
            nb::gil_scoped_release release;
            return p.finish();
          },
          "Advances every remaining layer, waits, verifies and commits (or rolls back);\n"
          "returns the SwitchReport.")
      .def(
          "abort",
          [](progressive_switch& p) {
            nb::gil_scoped_release release;
            return p.abort();
          },
          "Waits for an outstanding advance, then puts every moved layer back; returns the\n"
          "SwitchReport.")
      .def("__enter__", [](nb::handle self) { return self; })
      .def(
          "__exit__",
          [](progressive_switch& p, nb::args) {
            if (!p.open()) return;
            nb::gil_scoped_release release;
            p.abort();
          });

  nb::class_<switcher>(
      m, "Switcher",
      "Runs a switch end to end: plan (once per decision: capacity verdicts, bytes per layer,\n"
      "weight and KV plans; moves nothing), then switch_to(plan) between two decode steps or\n"
      "begin(plan) for a progressive switch: expert weights layer by layer, KV migration in\n"
      "rounds, new page tables, then on_commit(mode) flips the engine's runtime selector. A\n"
      "failure is undone (outcome rolled_back); a failed undo or a timeout is inconsistent and\n"
      "further switches are refused until recover().")
      .def(
          "__init__",
          [](switcher* self, const arena_geometry& weights, const kv_geometry& kv, transport& t,
             kv_state tables, int64_t cursor, nb::object on_commit, nb::object verify,
             nb::object verify_layer, nb::object ep_placement,
             std::optional<kv_pool_layout> kv_layout, bool stage_kv_in_free_slot,
             int64_t max_kv_rounds) {
            new (self) switcher(weights, kv, t, std::move(tables), arena_cursor{cursor},
                                options_of(std::move(on_commit), std::move(verify),
                                           std::move(verify_layer), std::move(ep_placement),
                                           std::move(kv_layout), stage_kv_in_free_slot,
                                           max_kv_rounds));
          },
          nb::arg("weights"), nb::arg("kv"), nb::arg("transport"), nb::arg("kv_tables"),
          nb::arg("cursor") = 0, nb::kw_only(), nb::arg("on_commit") = nb::none(),
          nb::arg("verify") = nb::none(), nb::arg("verify_layer") = nb::none(),
          nb::arg("ep_placement") = nb::none(), nb::arg("kv_layout") = nb::none(),
          nb::arg("stage_kv_in_free_slot") = true, nb::arg("max_kv_rounds") = 4096,
          nb::keep_alive<1, 4>(),
          "weights/kv: one rank's arena and KV geometry; transport: any Transport over the\n"
          "same ranks (kept alive by the switcher); kv_tables: the KV state now (its mode is\n"
          "the attention's mode); cursor: where the arena rests (0: EP experts, L: TP; any of\n"
          "the four layouts).\n"
          "The options (switcher_options, every field):\n"
          "  on_commit(layout): called with the new ParallelLayout when every byte has moved\n"
          "    (flip the runtime selector);\n"
          "  verify(cursor, kv_state) -> int: a checksum compared before and after;\n"
          "  verify_layer(layer, mode, kv_state) -> int: one layer's checksum, before anything\n"
          "    moves and as each layer lands (weight_checksum + kv_layer_checksum);\n"
          "  ep_placement(tp_tables: KvState) -> KvPlacement: owners for TP -> EP instead of\n"
          "    longest-first by pages in use;\n"
          "  kv_layout: the pool's KvPoolLayout (vllm_flashinfer_layout(kv), ...; None: the\n"
          "    present one), so that pages land where the engine's kernels read them;\n"
          "  stage_kv_in_free_slot: lend the arena's free slot to the KV migration;\n"
          "  max_kv_rounds: give up (refused_capacity) beyond this many KV rounds.\n"
          "Callables get copies of what they are passed.")
      .def_prop_ro("layout", &switcher::layout,
                   "the ParallelLayout the engine must run in now (the runtime selector)")
      .def_prop_ro("mode", &switcher::mode,
                   "the attention's mode (layout.attention); for the uniform layouts, the mode")
      .def_prop_ro("cursor", [](const switcher& s) { return s.cursor().tp_layers; })
      .def_prop_ro("kv_layout", [](const switcher& s) { return s.kv_layout(); },
                   "the KvPoolLayout every plan is made over")
      .def_prop_rw(
          "kv_tables", [](const switcher& s) { return s.kv_tables(); },
          [](switcher& s, kv_state state) { s.mutable_kv_tables() = std::move(state); },
          "The KV tables now (a copy). Assign the engine's tables after adding or retiring\n"
          "sequences; they must stay valid and in the current mode. Assigning makes every plan\n"
          "made before it stale.")
      .def_prop_ro("consistent", &switcher::consistent)
      .def_prop_ro("dcp", &switcher::dcp,
                   "the TP view's KV-parallel degree (KvGeometry.dcp) the tables are at")
      .def(
          "plan_dcp",
          [](const switcher& s, int64_t dcp) {
            nb::gil_scoped_release release;
            return s.plan_dcp(dcp);
          },
          nb::arg("dcp"),
          "Plans a change of the TP view's dcp to `dcp` (a SwitchPlan): the KV alone moves,\n"
          "TP(dcp a) -> TP(dcp b), stop the world (begin() refuses it); under EP attention\n"
          "nothing moves and the dcp of the next switch to TP is committed. Raises\n"
          "moebius.Error(code='invalid_argument') for a dcp the KV geometry does not allow.")
      .def(
          "switch_dcp",
          [](switcher& s, int64_t dcp) {
            nb::gil_scoped_release release;
            return s.switch_dcp(dcp);
          },
          nb::arg("dcp"), "switch_to(plan_dcp(dcp)): the SwitchReport.")
      .def(
          "plan",
          [](const switcher& s, parallel_layout target, plan_scope scope) {
            nb::gil_scoped_release release;
            return s.plan(target, scope);
          },
          nb::arg("target"), nb::arg("scope") = plan_scope::both,
          "Plans a switch to `target` (a Mode, or a ParallelLayout: the experts alone move no\n"
          "KV) from today's tables and cursor (a SwitchPlan); moves\n"
          "nothing. A refusal is in the plan (capacity.fits, layer_capacity.fits False), not\n"
          "raised. scope=PlanScope.stop_the_world skips the per-layer half (begin() refuses\n"
          "such a plan). P=2, L=4, EP -> TP: start 0, goal 4, weights 4 phases.")
      .def("why_stale", &switcher::why_stale, nb::arg("plan"),
           "'' when `plan` can run now; otherwise why it is stale (planned on another\n"
           "switcher, or before the state moved on: a kv_tables assignment, a switch, a\n"
           "recover()).")
      .def(
          "check",
          [](const switcher& s, parallel_layout target) {
            nb::gil_scoped_release release;
            return s.check(target);
          },
          nb::arg("target"),
          "The capacity check of a switch to `target` (a KvCapacityReport): plan(target).capacity.\n"
          "An engine that goes on to switch plans once and reads plan.capacity instead.")
      .def(
          "switch_to",
          [](switcher& s, const switch_plan& p) {
            nb::gil_scoped_release release;
            return s.switch_to(p);
          },
          nb::arg("plan"),
          "Switches everything as `plan` says, running its weight plan and all-layers KV plan\n"
          "(no planning of its own); returns the SwitchReport. Failures end in the report\n"
          "(rolled_back, inconsistent; refused_capacity when the plan's capacity refused), not\n"
          "in an exception. Raises moebius.Error(code='invalid_argument') for a stale plan\n"
          "(why_stale) or while a progressive switch is open.")
      .def(
          "switch_to",
          [](switcher& s, parallel_layout target) {
            nb::gil_scoped_release release;
            return s.switch_to(target);
          },
          nb::arg("target"), "switch_to(plan(target)).")
      .def(
          "begin",
          [](switcher& s, const switch_plan& p) {
            nb::gil_scoped_release release;
            return s.begin(p);
          },
          nb::arg("plan"), nb::keep_alive<0, 1>(),
          "Opens a progressive switch as `plan` says (a ProgressiveSwitch; it keeps the\n"
          "switcher alive); nothing moves. It is open when report.outcome is in_progress;\n"
          "otherwise the report says why not (already_there, refused_capacity when\n"
          "plan.layer_capacity refused, inconsistent, or rolled_back when verify failed).\n"
          "Raises moebius.Error(code='invalid_argument') for a stale plan.")
      .def(
          "begin",
          [](switcher& s, parallel_layout target) {
            nb::gil_scoped_release release;
            return s.begin(target);
          },
          nb::arg("target"), nb::keep_alive<0, 1>(), "begin(plan(target)).")
      .def_prop_ro("in_progress", &switcher::in_progress)
      .def_prop_ro("last_report", [](const switcher& s) { return s.last_report(); },
                   "The SwitchReport of the last switch that ended (either style).")
      .def(
          "layer_bytes_of",
          [](const switcher& s, parallel_layout target) {
            nb::gil_scoped_release release;
            return s.layer_bytes_of(target);
          },
          nb::arg("target"),
          "What each layer of a progressive switch to `target` sends per rank (a LayerBytes,\n"
          "the pacing input): plan(target).bytes_per_layer. Raises moebius.Error(code=\n"
          "'capacity') when the target cannot hold the live KV.")
      .def(
          "recover",
          [](switcher& s, parallel_layout layout, nb::object reload_experts) {
            recovery_request request;
            request.layout = layout;
            if (!reload_experts.is_none()) {
              request.reload_experts = [f = py_callback(reload_experts)](arena_cursor c) {
                f.call<void>(c.tp_layers);
              };
            }
            nb::gil_scoped_release release;
            return s.recover(request);
          },
          nb::arg("layout"), nb::arg("reload_experts"),
          "After an inconsistent switch: rebuilds a consistent state in `layout` (a Mode or a\n"
          "ParallelLayout) without a\n"
          "restart (the intact KV kept, the rest named lost) and calls reload_experts(cursor)\n"
          "to write every layer's experts where cursor (0: EP, L: TP) places them. Returns a\n"
          "RecoveryReport.")
      .def(
          "inject_fault",
          [](switcher& s, std::optional<switch_fault::stage> stage, int64_t phase, int64_t op) {
            if (stage) {
              s.inject_fault(switch_fault{*stage, fault_point{phase, op}});
            } else {
              s.inject_fault(std::nullopt);
            }
          },
          nb::arg("stage").none(), nb::arg("phase") = 0, nb::arg("op") = 0,
          "Test hook: a one-shot fault in `stage` of the next switch (None disarms all).");

  m.def(
      "weight_checksum",
      [](const arena_geometry& g, int64_t cursor, int64_t layer,
         const std::vector<nb::handle>& ranks) {
        return weight_checksum(g, arena_cursor{cursor}, layer, host_spans(ranks, memory_space::arena));
      },
      nb::arg("geometry"), nb::arg("cursor"), nb::arg("layer"), nb::arg("ranks"),
      "Layout-independent checksum of `layer`'s experts as held by the host RankMemory list.");
  m.def(
      "kv_checksum",
      [](const kv_geometry& g, const kv_state& s, const std::vector<nb::handle>& ranks,
         const std::optional<kv_pool_layout>& layout) {
        const auto spans = host_spans(ranks, memory_space::kv_pool);
        return layout ? kv_checksum(g, *layout, s, spans) : kv_checksum(g, s, spans);
      },
      nb::arg("geometry"), nb::arg("state"), nb::arg("ranks"), nb::arg("layout") = nb::none(),
      "Layout-independent checksum of every live sequence's K and V (host memory), read\n"
      "where `layout` (a KvPoolLayout; None: the present one) puts them.");
  m.def(
      "kv_layer_checksum",
      [](const kv_geometry& g, const kv_state& s, int64_t layer,
         const std::vector<nb::handle>& ranks, const std::optional<kv_pool_layout>& layout) {
        const auto spans = host_spans(ranks, memory_space::kv_pool);
        return layout ? kv_layer_checksum(g, *layout, s, layer, spans)
                      : kv_layer_checksum(g, s, layer, spans);
      },
      nb::arg("geometry"), nb::arg("state"), nb::arg("layer"), nb::arg("ranks"),
      nb::arg("layout") = nb::none(),
      "The part of kv_checksum that `layer` contributes (for a verify_layer callable).");
}

}  // namespace moebius::python
