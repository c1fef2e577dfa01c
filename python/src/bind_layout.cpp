// Descriptors: dtypes, modes, expert shapes and the arena geometry (layout/).

#include <nanobind/operators.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <iterator>
#include <sstream>

#include "common.hpp"

namespace moebius::python {

namespace {

bool same_shape(const expert_shape& a, const expert_shape& b) {
  return a.num_layers == b.num_layers && a.num_experts == b.num_experts && a.hidden == b.hidden &&
         a.intermediate == b.intermediate && a.weight_dtype == b.weight_dtype &&
         a.ep_order == b.ep_order && a.tp_order == b.tp_order &&
         a.block_scales == b.block_scales && a.scale_block_n == b.scale_block_n &&
         a.scale_block_k == b.scale_block_k && a.scale_dtype == b.scale_dtype;
}

}  // namespace

void bind_layout(nb::module_& m) {
  nb::enum_<dtype>(m, "DType", "Element type of expert weights, scales and KV.")
      .value("bf16", dtype::bf16)
      .value("fp16", dtype::fp16)
      .value("fp32", dtype::fp32)
      .value("fp8_e4m3", dtype::fp8_e4m3)
      .value("fp8_e5m2", dtype::fp8_e5m2);
  m.def("dtype_bytes", [](dtype t) { return dtype_bytes(t); }, nb::arg("dtype"),
        "Bytes per element: bf16 -> 2, fp8_e4m3 -> 1.");

  nb::enum_<parallel_mode>(m, "Mode", "Parallel mode of a layer: EP (experts whole on E/P "
                                      "ranks each) or TP (every expert sliced over P ranks).")
      .value("EP", parallel_mode::ep)
      .value("TP", parallel_mode::tp);

  nb::class_<parallel_layout>(
      m, "ParallelLayout",
      "The attention's and the experts' layouts, each a Mode (layout/parallel_layout.hpp):\n"
      "attention EP is data-parallel attention (the EP KV view), TP tensor-parallel (the TP\n"
      "view); experts EP whole on E/P ranks, TP sliced. A Mode converts to its uniform layout,\n"
      "so every call that takes a layout takes a Mode: ParallelLayout(TP) == TP.\n"
      "ParallelLayout(TP, EP): TP attention with EP experts (switching its experts moves no KV).")
      .def(nb::init<parallel_mode, parallel_mode>(), nb::arg("attention"), nb::arg("experts"))
      .def(nb::init_implicit<parallel_mode>(), nb::arg("mode"))
      .def_rw("attention", &parallel_layout::attention)
      .def_rw("experts", &parallel_layout::experts)
      .def_prop_ro("uniform", &parallel_layout::uniform, "attention and experts in one mode")
      .def_prop_ro("name", [](const parallel_layout& l) { return std::string(to_string(l)); },
                   "'EP', 'TP', 'TP attention, EP experts', 'DP attention, TP experts'")
      .def(nb::self == nb::self)
      .def("__hash__", [](const parallel_layout& l) {
        return static_cast<int>(l.attention) * 2 + static_cast<int>(l.experts);
      })
      .def("__str__", [](const parallel_layout& l) { return std::string(to_string(l)); })
      .def("__repr__", [](const parallel_layout& l) {
        return std::string("ParallelLayout(") + to_string(l.attention) + ", " +
               to_string(l.experts) + ")";
      });

  nb::enum_<gate_up_order>(m, "GateUpOrder",
                           "Order of the halves of the fused w13 ([gate; up] in vLLM/SGLang).")
      .value("gate_first", gate_up_order::gate_first)
      .value("up_first", gate_up_order::up_first);

  nb::enum_<weight_tensor>(m, "WeightTensor", "The four expert tensors of one layer.")
      .value("w13", weight_tensor::w13)
      .value("w2", weight_tensor::w2)
      .value("w13_scale", weight_tensor::w13_scale)
      .value("w2_scale", weight_tensor::w2_scale);

  nb::class_<expert_shape>(m, "ExpertShape",
                           "The shape of a stack of MoE layers: L layers, E experts, hidden H,\n"
                           "intermediate I, weight dtype; w13 is [E, 2I, H], w2 [E, H, I].")
      .def(
          "__init__",
          [](expert_shape* s, int64_t num_layers, int64_t num_experts, int64_t hidden,
             int64_t intermediate, dtype weight_dtype, gate_up_order ep_order,
             gate_up_order tp_order, bool block_scales, int64_t scale_block_n,
             int64_t scale_block_k, dtype scale_dtype) {
            new (s) expert_shape{num_layers, num_experts, hidden, intermediate, weight_dtype,
                                 ep_order, tp_order, block_scales, scale_block_n,
                                 scale_block_k, scale_dtype};
          },
          nb::arg("num_layers") = 0, nb::arg("num_experts") = 0, nb::arg("hidden") = 0,
          nb::arg("intermediate") = 0, nb::arg("weight_dtype") = dtype::bf16,
          nb::arg("ep_order") = gate_up_order::gate_first,
          nb::arg("tp_order") = gate_up_order::gate_first, nb::arg("block_scales") = false,
          nb::arg("scale_block_n") = 128, nb::arg("scale_block_k") = 128,
          nb::arg("scale_dtype") = dtype::fp32)
      .def_rw("num_layers", &expert_shape::num_layers, "L: MoE layers in the stack")
      .def_rw("num_experts", &expert_shape::num_experts, "E: routed experts per layer")
      .def_rw("hidden", &expert_shape::hidden, "H: hidden size (w13 columns, w2 rows)")
      .def_rw("intermediate", &expert_shape::intermediate,
              "I: expert intermediate size (w13 holds 2I rows, w2 I columns)")
      .def_rw("weight_dtype", &expert_shape::weight_dtype)
      .def_rw("ep_order", &expert_shape::ep_order, "w13 half order the EP runtime reads")
      .def_rw("tp_order", &expert_shape::tp_order, "w13 half order of each TP slice")
      .def_rw("block_scales", &expert_shape::block_scales,
              "block-scaled FP8: scale tensors beside the weights")
      .def_rw("scale_block_n", &expert_shape::scale_block_n)
      .def_rw("scale_block_k", &expert_shape::scale_block_k)
      .def_rw("scale_dtype", &expert_shape::scale_dtype)
      .def("validate", [](const expert_shape& s, int num_ranks) { validate(s, num_ranks); },
           nb::arg("num_ranks"),
           "Raises moebius.Error (invalid_argument / overflow) unless the shape can be sharded\n"
           "over num_ranks ranks in both views (P | E, P | I, whole scale blocks, 64-bit sizes).")
      .def("__eq__", &same_shape)
      .def("__repr__", &printed<expert_shape>)
      .attr("__hash__") = nb::none();  // mutable, and the C++ side has no hash
  m.def("qwen3_235b_a22b", &qwen3_235b_a22b,
        "Qwen3-235B-A22B: L=94, E=128, H=4096, I=1536, bf16.");

  nb::class_<arena_geometry>(m, "ArenaGeometry",
                             "One rank's expert arena: L+1 equal slots; TP layer i in slot i,\n"
                             "EP layer i in slot i+1 (make_arena_geometry builds it).")
      .def_ro("shape", &arena_geometry::shape)
      .def_ro("num_ranks", &arena_geometry::num_ranks)
      .def_ro("tensor_alignment", &arena_geometry::tensor_alignment)
      .def_prop_ro("tensor_offset",
                   [](const arena_geometry& g) {
                     return std::vector<int64_t>(std::begin(g.tensor_offset),
                                                 std::end(g.tensor_offset));
                   },
                   "byte offset of each tensor (w13, w2, w13_scale, w2_scale) within a slot")
      .def_prop_ro("tensor_bytes",
                   [](const arena_geometry& g) {
                     return std::vector<int64_t>(std::begin(g.tensor_bytes),
                                                 std::end(g.tensor_bytes));
                   },
                   "bytes of each tensor per rank per layer")
      .def_ro("slot_bytes", &arena_geometry::slot_bytes)
      .def_prop_ro("num_slots", &arena_geometry::num_slots)
      .def_prop_ro("total_bytes", &arena_geometry::total_bytes,
                   "bytes of one rank's arena: slot_bytes * (L + 1)")
      .def_prop_ro("layer_bytes_per_rank", &arena_geometry::layer_bytes_per_rank)
      .def_prop_ro("static_bytes_per_rank", &arena_geometry::static_bytes_per_rank)
      .def_prop_ro("overhead_bytes", &arena_geometry::overhead_bytes)
      .def_prop_ro("overhead_fraction", &arena_geometry::overhead_fraction)
      .def("slot_offset", &arena_geometry::slot_offset, nb::arg("slot"))
      .def_static("slot_of", &arena_geometry::slot_of, nb::arg("mode"), nb::arg("layer"),
                  "Slot that holds `layer` in `mode`: TP layer i -> slot i, EP -> slot i+1.")
      .def("tensor_base", &arena_geometry::tensor_base, nb::arg("mode"), nb::arg("layer"),
           nb::arg("tensor"),
           "Byte offset of `tensor` of `layer` within one rank's arena when in `mode`.")
      .def(
          "validate_cursor",
          [](const arena_geometry& g, int64_t cursor) { validate(g, arena_cursor{cursor}); },
          nb::arg("cursor"), "Raises moebius.Error unless 0 <= cursor <= L.")
      .def("__eq__",
           [](const arena_geometry& a, const arena_geometry& b) {
             return same_shape(a.shape, b.shape) && a.num_ranks == b.num_ranks &&
                    a.tensor_alignment == b.tensor_alignment && a.slot_bytes == b.slot_bytes &&
                    std::equal(std::begin(a.tensor_offset), std::end(a.tensor_offset),
                               std::begin(b.tensor_offset)) &&
                    std::equal(std::begin(a.tensor_bytes), std::end(a.tensor_bytes),
                               std::begin(b.tensor_bytes));
           })
      .def("__repr__", &printed<arena_geometry>)
      .attr("__hash__") = nb::none();

  m.def(
      "make_arena_geometry",
      [](const expert_shape& shape, int num_ranks, int64_t tensor_alignment,
         int64_t slot_alignment) {
        return make_arena_geometry(shape, num_ranks, tensor_alignment, slot_alignment);
      },
      nb::arg("shape"), nb::arg("num_ranks"),
      nb::arg("tensor_alignment") = default_tensor_alignment,
      nb::arg("slot_alignment") = default_slot_alignment,
      "Validates `shape` over `num_ranks` and lays out one rank's arena (allocates nothing).\n"
      "Qwen3-235B, P=8: slot 603,979,776 B, 95 slots, overhead 1.06%.");

  m.def(
      "weight_view_shape",
      [](const expert_shape& shape, int num_ranks, parallel_mode mode, weight_tensor t) {
        const layout3 l = mode == parallel_mode::ep
                              ? make_view<parallel_mode::ep>(shape, t, num_ranks).local_layout()
                              : make_view<parallel_mode::tp>(shape, t, num_ranks).local_layout();
        return std::array<int64_t, 3>{l.shape[0], l.shape[1], l.shape[2]};
      },
      nb::arg("shape"), nb::arg("num_ranks"), nb::arg("mode"), nb::arg("tensor"),
      "Shape one rank holds of `tensor` in `mode`: w13 EP [E/P, 2I, H], TP [E, 2I/P, H].");
}

}  // namespace moebius::python
