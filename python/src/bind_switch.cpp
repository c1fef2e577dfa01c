// The switcher (switch/switcher.hpp), its progressive-switch session (switch/progressive.hpp) and the layout-independent checksums (switch/checksum.hpp).

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <span>
#include <stdexcept>
#include <vector>

#include "common.hpp"

namespace moebius::python {
namespace {

nb::dict to_dict(const switch_workload& w) {
  nb::dict d;
  d["num_ranks"] = w.num_ranks;
  d["weight_bytes_per_rank"] = w.weight_bytes_per_rank;
  d["kv_bytes_per_rank"] = w.kv_bytes_per_rank;
  d["weight_phases"] = w.weight_phases;
  d["kv_rounds"] = w.kv_rounds;
  return d;
}

nb::dict to_dict(const layer_bytes& b) {
  nb::dict d;
  d["weight_bytes_sent"] = nb::cast(b.weight_bytes_sent);
  d["kv_bytes_sent"] = nb::cast(b.kv_bytes_sent);
  d["busiest"] = b.busiest();
  return d;
}

}  // namespace

nb::dict metrics_dict(const switch_report& r) {
  nb::dict d;
  for (const switch_metric& m : metrics_of(r)) d[nb::str(m.name.data(), m.name.size())] = m.value;
  return d;
}

nb::dict to_dict(const switch_report& r) {
  nb::dict d;
  d["from"] = to_string(r.from);
  d["to"] = to_string(r.to);
  d["outcome"] = to_string(r.outcome);
  d["error"] = r.error;
  d["cursor"] = r.cursor.tp_layers;
  d["weight_phases"] = r.weight_phases;
  d["weight_phases_completed"] = r.weight_phases_completed;
  d["kv_rounds"] = r.kv_rounds;
  d["kv_rounds_completed"] = r.kv_rounds_completed;
  d["weight_bytes_sent"] = nb::cast(r.weight_bytes_sent);
  d["kv_bytes_sent"] = nb::cast(r.kv_bytes_sent);
  d["workload"] = to_dict(r.workload);
  d["kv_stats"] = to_dict(r.kv_stats);
  d["capacity"] = to_dict(r.capacity);
  d["capacity_ms"] = r.capacity_ms;
  d["plan_ms"] = r.plan_ms;
  d["weights_ms"] = r.weights_ms;
  d["kv_ms"] = r.kv_ms;
  d["verify_ms"] = r.verify_ms;
  d["undo_ms"] = r.undo_ms;
  d["total_ms"] = r.total_ms;
  d["verified"] = r.verified;
  d["summary"] = printed(r);
  d["metrics"] = metrics_dict(r);
  return d;
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

void bind_switch(nb::module_& m) {
  nb::enum_<switch_outcome>(m, "SwitchOutcome")
      .value("committed", switch_outcome::committed)
      .value("already_there", switch_outcome::already_there)
      .value("refused_capacity", switch_outcome::refused_capacity)
      .value("rolled_back", switch_outcome::rolled_back)
      .value("inconsistent", switch_outcome::inconsistent)
      .value("in_progress", switch_outcome::in_progress);

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
      .def_prop_ro("report", [](const progressive_switch& p) { return to_dict(p.report()); })
      .def_prop_ro("layers_remaining", &progressive_switch::layers_remaining)
      .def_prop_ro("bytes_per_layer",
                   [](const progressive_switch& p) { return to_dict(p.bytes_per_layer()); })
      .def_prop_ro("cursor", [](const progressive_switch& p) { return p.view().cursor().tp_layers; },
                   "Layers below it run TP (their copies are complete), the rest EP.")
      .def("mode_of", [](const progressive_switch& p, int64_t layer) { return p.view().mode_of(layer); },
           nb::arg("layer"))
      .def("tables", [](const progressive_switch& p, parallel_mode m) { return p.view().tables(m); },
           nb::arg("mode"), "The (frozen) page tables layers of `mode` read, as a copy.")
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
            switch_report report;
            {
              nb::gil_scoped_release release;
              report = p.finish();
            }
            return to_dict(report);
          },
          "Advances every remaining layer, waits, verifies and commits (or rolls back).")
      .def(
          "abort",
          [](progressive_switch& p) {
            switch_report report;
            {
              nb::gil_scoped_release release;
              report = p.abort();
            }
            return to_dict(report);
          },
          "Waits for an outstanding advance, then puts every moved layer back.")
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
      "Runs a switch end to end between two decode steps: capacity check, expert weights\n"
      "layer by layer, KV migration in rounds, new page tables, then on_commit(mode) flips\n"
      "the engine's runtime selector. A failure is undone (outcome 'rolled_back'); a failed\n"
      "undo or a timeout is 'inconsistent' and further switches are refused.")
      .def(
          "__init__",
          [](switcher* self, const arena_geometry& weights, const kv_geometry& kv, transport& t,
             kv_state tables, int64_t cursor, nb::object on_commit, nb::object verify,
             bool stage_kv_in_free_slot, int64_t max_kv_rounds) {
            switcher_options o;
            o.stage_kv_in_free_slot = stage_kv_in_free_slot;
            o.max_kv_rounds = max_kv_rounds;
            if (!on_commit.is_none()) {
              o.on_commit = [f = py_callback(on_commit)](parallel_mode mode) {
                f.call<void>(mode);
              };
            }
            if (!verify.is_none()) {
              o.verify = [f = py_callback(verify)](arena_cursor c, const kv_state& s) {
                return f.call<uint64_t>(c.tp_layers, s);
              };
            }
            new (self) switcher(weights, kv, t, std::move(tables), arena_cursor{cursor}, o);
          },
          nb::arg("weights"), nb::arg("kv"), nb::arg("transport"), nb::arg("kv_tables"),
          nb::arg("cursor") = 0, nb::kw_only(), nb::arg("on_commit") = nb::none(),
          nb::arg("verify") = nb::none(), nb::arg("stage_kv_in_free_slot") = true,
          nb::arg("max_kv_rounds") = 4096, nb::keep_alive<1, 4>(),
          "weights/kv: one rank's arena and KV geometry; transport: any Transport over the\n"
          "same ranks (kept alive by the switcher); kv_tables: the KV state now (its mode is\n"
          "the current mode); cursor: where the arena rests (0 with EP tables, L with TP).\n"
          "on_commit(mode) is called when every byte has moved; verify(cursor, kv_state) ->\n"
          "int is an optional checksum compared before and after (see weight_checksum).")
      .def_prop_ro("mode", &switcher::mode, "the mode the engine must run in now")
      .def_prop_ro("cursor", [](const switcher& s) { return s.cursor().tp_layers; })
      .def_prop_rw(
          "kv_tables", [](const switcher& s) { return s.kv_tables(); },
          [](switcher& s, kv_state state) { s.mutable_kv_tables() = std::move(state); },
          "The KV tables now (a copy). Assign the engine's tables after adding or retiring\n"
          "sequences; they must stay valid and in the current mode.")
      .def_prop_ro("consistent", &switcher::consistent)
      .def(
          "check", [](const switcher& s, parallel_mode target) { return to_dict(s.check(target)); },
          nb::arg("target"), "The capacity check of a switch to `target` (a dict); moves nothing.")
      .def(
          "switch_to",
          [](switcher& s, parallel_mode target) {
            switch_report report;
            {
              nb::gil_scoped_release release;
              report = s.switch_to(target);
            }
            return to_dict(report);
          },
          nb::arg("target"),
          "Switches to `target`; returns the report as a dict: outcome ('committed',\n"
          "'already_there', 'refused_capacity', 'rolled_back', 'inconsistent'), error, cursor,\n"
          "phases and rounds, bytes sent per rank, kv_stats, capacity, *_ms timings, verified,\n"
          "summary (the C++ operator<< text). Failures end in the report, not in an exception.")
      // Progressive switch: a session that moves a few layers per decode step.
      .def(
          "begin",
          [](switcher& s, parallel_mode target) {
            nb::gil_scoped_release release;
            return s.begin(target);
          },
          nb::arg("target"), nb::keep_alive<0, 1>(),
          "Opens a progressive switch (a ProgressiveSwitch; it keeps the switcher alive):\n"
          "capacity check and plans, nothing moves. It is open when report['outcome'] is\n"
          "'in_progress'; otherwise the report says why not ('already_there',\n"
          "'refused_capacity', 'inconsistent', or 'rolled_back' when verify failed).")
      .def_prop_ro("in_progress", &switcher::in_progress)
      .def_prop_ro("last_report", [](const switcher& s) { return to_dict(s.last_report()); },
                   "The report of the last switch that ended (either style).")
      .def(
          "layer_bytes_of",
          [](const switcher& s, parallel_mode target) { return to_dict(s.layer_bytes_of(target)); },
          nb::arg("target"),
          "What each layer of a progressive switch to `target` sends per rank (the pacing\n"
          "input, planned with this switcher's options): {'weight_bytes_sent', 'kv_bytes_sent',\n"
          "'busiest'}.")
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
      [](const kv_geometry& g, const kv_state& s, const std::vector<nb::handle>& ranks) {
        return kv_checksum(g, s, host_spans(ranks, memory_space::kv_pool));
      },
      nb::arg("geometry"), nb::arg("state"), nb::arg("ranks"),
      "Layout-independent checksum of every live sequence's K and V (host memory).");
}

}  // namespace moebius::python
