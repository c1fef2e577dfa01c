// Fuzzes the weight-plan builder: a shape, alignments, optional edits of the built geometry
// and two cursors. Any input must give a moebius::error or a plan that validates against the
// arena, has no hazard in any phase, moves every byte of each switched layer exactly once,
// and whose rollback at every completed phase count is hazard-free too.
#include <string>

#include "fuzz_input.hpp"
#include "moebius/error.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/plan/rollback.hpp"
#include "moebius/plan/weight_plan.hpp"

using namespace moebius;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::input in(data, size);
  try {
    const int P = static_cast<int>(in.mostly(1, 8));
    expert_shape s;
    s.num_layers = in.mostly(1, 6);
    s.num_experts = in.mostly(1, 16);
    s.hidden = in.mostly(1, 64);
    s.intermediate = in.mostly(1, 64);
    s.weight_dtype = static_cast<dtype>(in.range(0, 5));
    s.ep_order = static_cast<gate_up_order>(in.range(0, 2));
    s.tp_order = static_cast<gate_up_order>(in.range(0, 2));
    s.block_scales = in.coin();
    s.scale_block_n = in.mostly(1, 8);
    s.scale_block_k = in.mostly(1, 8);
    s.scale_dtype = static_cast<dtype>(in.range(0, 5));
    const int64_t tensor_align = int64_t{1} << in.range(0, 10);
    const int64_t slot_align = tensor_align << in.range(0, 4);
    arena_geometry g = make_arena_geometry(s, P, tensor_align, slot_align);
    // Edit one field after construction: the builder must re-validate.
    switch (in.range(0, 7)) {
      case 0: g.num_ranks = static_cast<int>(in.mostly(0, 16)); break;
      case 1: g.slot_bytes = in.mostly(0, g.slot_bytes); break;
      case 2: g.tensor_offset[in.range(0, 3)] = in.mostly(0, g.slot_bytes); break;
      case 3: g.tensor_bytes[in.range(0, 3)] = in.mostly(0, g.slot_bytes); break;
      case 4: g.shape.num_layers = in.mostly(0, 8); break;
      default: break;
    }
    const arena_cursor from{in.mostly(0, g.shape.num_layers)};
    const arena_cursor to{in.mostly(0, g.shape.num_layers)};
    // A plan holds one phase per switched layer: a valid shape of 2^40 layers is a valid
    // request for more memory than there is, not a bug. Keep plans small.
    // (Negative cursors go through: the builder must refuse them.)
    if (from.tp_layers >= 0 && to.tp_layers >= 0 &&
        (from.tp_layers - to.tp_layers > 64 || to.tp_layers - from.tp_layers > 64))
      return 0;
    const plan p = plan_weight_switch(g, from, to);

    // Reaching here: the geometry and cursors were valid.
    const int64_t spaces[num_memory_spaces] = {g.total_bytes(), 0};
    validate(p, spaces);
    const int64_t rows_limit = int64_t{1} << 20;  // find_phase_hazard is O(rows log rows)
    int64_t rows = 0;
    for (const plan_phase& ph : p.phases)
      for (const copy_op& op : ph.ops) rows += op.rows;
    const int64_t layers = from.tp_layers > to.tp_layers ? from.tp_layers - to.tp_layers
                                                         : to.tp_layers - from.tp_layers;
    MOEBIUS_FUZZ_REQUIRE(static_cast<int64_t>(p.phases.size()) == layers, "one phase per layer");
    for (const plan_phase& ph : p.phases) {
      int64_t bytes = 0;
      for (const copy_op& op : ph.ops) bytes += op.bytes();
      MOEBIUS_FUZZ_REQUIRE(bytes == g.layer_bytes_per_rank() * P,
                           "a phase moves every byte of its layer on every rank once");
    }
    if (rows <= rows_limit) {
      const std::string hazard = find_phase_hazard(p);
      MOEBIUS_FUZZ_REQUIRE(hazard.empty(), hazard);
      for (int64_t k = 0; k <= static_cast<int64_t>(p.phases.size()); ++k) {
        const plan undo = rollback_plan(p, k);
        validate(undo, spaces);
        const std::string h = find_phase_hazard(undo);
        MOEBIUS_FUZZ_REQUIRE(h.empty(), h);
      }
    }
  } catch (const error&) {
    // A clear error is a valid answer.
  }
  return 0;
}
