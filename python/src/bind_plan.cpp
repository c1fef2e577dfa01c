// Plans: copy ops, phases, weight-switch plans and rollback (plan/).

#include <nanobind/operators.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "common.hpp"

namespace moebius::python {

void bind_plan(nb::module_& m) {
  record<plan_traffic> traffic(m, "PlanTraffic", "Bytes a plan moves per rank (Plan.traffic()).");
  traffic.field("bytes_sent", &plan_traffic::bytes_sent, "[P] leaving rank r for another rank")
      .field("bytes_received", &plan_traffic::bytes_received, "[P] arriving at rank r")
      .field("bytes_local", &plan_traffic::bytes_local, "[P] copied within rank r")
      .field("num_ops", &plan_traffic::num_ops)
      .field("num_remote_ops", &plan_traffic::num_remote_ops)
      .prop("max_bytes_sent", &plan_traffic::max_bytes_sent, "the busiest rank's bytes_sent")
      .prop("total_bytes_sent", &plan_traffic::total_bytes_sent)
      .done();

  record<switch_workload> workload(
      m, "SwitchWorkload",
      "What one switch moves, in the cost model's terms: the busiest rank's bytes and the\n"
      "number of barriers (plan/switch_workload.hpp).");
  workload.def(
      "__init__",
      [](switch_workload* w, int num_ranks, int64_t weight_bytes_per_rank,
         int64_t kv_bytes_per_rank, int64_t weight_phases, int64_t kv_rounds) {
        new (w) switch_workload{num_ranks, weight_bytes_per_rank, kv_bytes_per_rank,
                                weight_phases, kv_rounds};
      },
      nb::arg("num_ranks") = 1, nb::arg("weight_bytes_per_rank") = 0,
      nb::arg("kv_bytes_per_rank") = 0, nb::arg("weight_phases") = 0, nb::arg("kv_rounds") = 0);
  workload.field("num_ranks", &switch_workload::num_ranks)
      .field("weight_bytes_per_rank", &switch_workload::weight_bytes_per_rank,
             "expert bytes leaving the busiest rank")
      .field("kv_bytes_per_rank", &switch_workload::kv_bytes_per_rank,
             "KV bytes leaving the busiest rank")
      .field("weight_phases", &switch_workload::weight_phases, "one per layer switched")
      .field("kv_rounds", &switch_workload::kv_rounds, "KV migration rounds (each a barrier)")
      .done();

  nb::enum_<memory_space>(m, "MemorySpace", "Which per-rank allocation an offset refers to.")
      .value("arena", memory_space::arena)
      .value("kv_pool", memory_space::kv_pool);

  nb::class_<copy_op>(m, "CopyOp",
                      "One strided copy: `rows` rows of `row_bytes` bytes, row j from\n"
                      "src_rank's src_space + src_offset + j*src_pitch to dst_rank's\n"
                      "dst_space + dst_offset + j*dst_pitch.")
      .def(
          "__init__",
          [](copy_op* op, int32_t src_rank, int64_t src_offset, int32_t dst_rank,
             int64_t dst_offset, int64_t rows, int64_t row_bytes, int64_t src_pitch,
             int64_t dst_pitch, memory_space src_space, memory_space dst_space) {
            new (op) copy_op{src_offset, dst_offset, rows, row_bytes,
                             src_pitch == 0 && rows == 1 ? row_bytes : src_pitch,
                             dst_pitch == 0 && rows == 1 ? row_bytes : dst_pitch,
                             src_rank, dst_rank, src_space, dst_space};
          },
          nb::arg("src_rank") = 0, nb::arg("src_offset") = 0, nb::arg("dst_rank") = 0,
          nb::arg("dst_offset") = 0, nb::arg("rows") = 1, nb::arg("row_bytes") = 0,
          nb::arg("src_pitch") = 0, nb::arg("dst_pitch") = 0,
          nb::arg("src_space") = memory_space::arena, nb::arg("dst_space") = memory_space::arena)
      .def_rw("src_rank", &copy_op::src_rank)
      .def_rw("src_offset", &copy_op::src_offset)
      .def_rw("dst_rank", &copy_op::dst_rank)
      .def_rw("dst_offset", &copy_op::dst_offset)
      .def_rw("rows", &copy_op::rows)
      .def_rw("row_bytes", &copy_op::row_bytes)
      .def_rw("src_pitch", &copy_op::src_pitch)
      .def_rw("dst_pitch", &copy_op::dst_pitch)
      .def_rw("src_space", &copy_op::src_space)
      .def_rw("dst_space", &copy_op::dst_space)
      .def_prop_ro("bytes", &copy_op::bytes)
      .def_prop_ro("is_local", &copy_op::is_local)
      .def(nb::self == nb::self)
      .def("__repr__", &printed<copy_op>)
      .attr("__hash__") = nb::none();

  nb::class_<plan_phase>(m, "PlanPhase",
                         "One phase: ops that may run in any order; a barrier follows it.")
      .def(
          "__init__",
          [](plan_phase* p, std::string label, std::vector<copy_op> ops,
             std::vector<copy_op> restores) {
            new (p) plan_phase{std::move(label), std::move(ops), std::move(restores)};
          },
          nb::arg("label") = "", nb::arg("ops") = std::vector<copy_op>{},
          nb::arg("restores") = std::vector<copy_op>{})
      .def_rw("label", &plan_phase::label)
      .def_rw("ops", &plan_phase::ops, "the phase's copy ops (a copy: assign to change)")
      .def_rw("restores", &plan_phase::restores,
              "copies the undo runs after undoing `ops` (never run by transports)")
      .def(nb::self == nb::self)
      .def("__repr__",
           [](const plan_phase& p) {
             return "PlanPhase('" + p.label + "', " + std::to_string(p.ops.size()) + " ops)";
           })
      .attr("__hash__") = nb::none();

  nb::class_<plan>(m, "Plan",
                   "Ordered phases of copy ops. Data: printable (the C++ operator<<),\n"
                   "comparable, and the same plan runs on every transport.")
      .def(
          "__init__",
          [](plan* p, int num_ranks, std::vector<plan_phase> phases) {
            new (p) plan{num_ranks, std::move(phases)};
          },
          nb::arg("num_ranks") = 0, nb::arg("phases") = std::vector<plan_phase>{})
      .def_rw("num_ranks", &plan::num_ranks)
      .def_rw("phases", &plan::phases, "the phases (a copy: assign to change)")
      .def_prop_ro("num_phases", [](const plan& p) { return static_cast<int64_t>(p.phases.size()); })
      .def("num_ops", &plan::num_ops)
      .def("__len__", [](const plan& p) { return p.phases.size(); })
      .def("traffic", &traffic_of,
           "Bytes the plan moves per rank (a PlanTraffic: bytes_sent, bytes_received,\n"
           "bytes_local per rank, num_ops, num_remote_ops, max_bytes_sent, total_bytes_sent).")
      .def("workload", &workload_of,
           "The busiest rank's bytes and the barriers (a SwitchWorkload), as a cost model\n"
           "prices them: phases writing the KV pool count as KV rounds.")
      .def(
          "validate",
          [](const plan& p, int64_t arena_bytes, int64_t kv_pool_bytes) {
            const int64_t sizes[num_memory_spaces] = {arena_bytes, kv_pool_bytes};
            validate(p, sizes);
          },
          nb::arg("arena_bytes"), nb::arg("kv_pool_bytes") = 0,
          "Raises moebius.Error (invalid_argument / out_of_range) unless every op fits.")
      .def("find_phase_hazard", &find_phase_hazard,
           "'' when no destination of a phase overlaps another destination or a source of the\n"
           "same phase; else the first hazard.")
      .def(
          "format",
          [](const plan& p, bool ops) {
            std::ostringstream os;
            print(os, p, ops);
            return os.str();
          },
          nb::arg("ops") = false, "One line per phase, and with ops=True one line per op.")
      .def(nb::self == nb::self)
      .def("__str__", &printed<plan>)
      .def("__repr__", &printed<plan>)
      .attr("__hash__") = nb::none();  // the C++ side has no hash

  m.def(
      "plan_weight_switch",
      [](const arena_geometry& g, int64_t from_cursor, int64_t to_cursor) {
        return plan_weight_switch(g, arena_cursor{from_cursor}, arena_cursor{to_cursor});
      },
      nb::arg("geometry"), nb::arg("from_cursor"), nb::arg("to_cursor"),
      "The plan that moves the arena from cursor `from_cursor` to `to_cursor` (cursor k:\n"
      "layers [0, k) TP, the rest EP; 0 = all EP, L = all TP), one phase per layer.");

  m.def("rollback_plan", &rollback_plan, nb::arg("executed"), nb::arg("completed_phases"),
        "The plan that undoes the first `completed_phases` phases of `executed`.");
}

}  // namespace moebius::python
