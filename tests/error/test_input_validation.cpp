// Classes of bad input, each tried at every public entry it can reach: enum values cast from
// out-of-range integers, extreme but representable integers, non-finite floats, descriptors
// edited after construction, repeated pages and negative capacities. Each must give a clear
// moebius::error (or, where documented, a correct answer) and never undefined behaviour; the
// sanitizer stage of scripts/test runs these under ASan + UBSan.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fixtures.hpp"
#include "layout/error_matchers.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "moebius/kv/placement.hpp"
#include "moebius/memory/memory_budget.hpp"
#include "moebius/plan/rollback.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "moebius/policy/calibration.hpp"
#include "moebius/policy/cost_model.hpp"
#include "moebius/policy/step_time_gate.hpp"
#include "moebius/policy/switch_policy.hpp"
#include "moebius/switch/switcher.hpp"
#include "support/catch.hpp"

namespace {

using namespace moebius;
using testing::small_arena;
using testing::small_ep_state;
using testing::small_kv;
using testing::small_shape;

constexpr int64_t i64_max = std::numeric_limits<int64_t>::max();
constexpr double nan_v = std::numeric_limits<double>::quiet_NaN();
constexpr double inf_v = std::numeric_limits<double>::infinity();

// Out-of-range values of a uint8_t enum: just past the last value, and far past it.
template <class Enum>
std::vector<Enum> bad_values(int first_invalid) {
  return {static_cast<Enum>(first_invalid), static_cast<Enum>(first_invalid + 5),
          static_cast<Enum>(255)};
}

// --- enums ---------------------------------------------------------------------------------

TEST_CASE("is_valid accepts exactly the declared values of every public enum") {
  for (int v = 0; v < 256; ++v) {
    const auto u = static_cast<uint8_t>(v);
    CHECK(is_valid(static_cast<dtype>(u)) == (v <= 4));
    CHECK(is_valid(static_cast<gate_up_order>(u)) == (v <= 1));
    CHECK(is_valid(static_cast<parallel_mode>(u)) == (v <= 1));
    CHECK(is_valid(static_cast<weight_tensor>(u)) == (v <= 3));
    CHECK(is_valid(static_cast<memory_space>(u)) == (v <= 1));
    CHECK(is_valid(static_cast<kv_layout>(u)) == (v <= 1));
    CHECK(is_valid(static_cast<kv_tensor>(u)) == (v <= 1));
    CHECK(is_valid(static_cast<down_rule>(u)) == (v <= 1));
    CHECK(is_valid(static_cast<decision_reason>(u)) == (v <= 7));
    CHECK(is_valid(static_cast<curve_fit>(u)) == (v <= 1));
    CHECK(is_valid(static_cast<crossover_status>(u)) == (v <= 3));
    CHECK(is_valid(static_cast<switch_outcome>(u)) == (v <= 5));
  }
}

TEST_CASE("to_string of an out-of-range enum value says unknown, never another value") {
  for (int v : {2, 5, 77, 255}) {
    const auto u = static_cast<uint8_t>(v);
    INFO("value " << v);
    CHECK(std::string(to_string(static_cast<parallel_mode>(u))) == "unknown");
    CHECK(std::string(to_string(static_cast<gate_up_order>(u))) == "unknown");
    CHECK(std::string(to_string(static_cast<memory_space>(u))) == "unknown");
    CHECK(std::string(to_string(static_cast<kv_layout>(u))) == "unknown");
    CHECK(std::string(to_string(static_cast<down_rule>(u))) == "unknown");
    CHECK(std::string(to_string(static_cast<curve_fit>(u))) == "unknown");
    if (v >= 5) {
      CHECK(std::string(to_string(static_cast<dtype>(u))) == "unknown");
    }
    if (v >= 6) CHECK(std::string(to_string(static_cast<switch_outcome>(u))) == "unknown");
    if (v >= 8) CHECK(std::string(to_string(static_cast<decision_reason>(u))) == "unknown");
    if (v >= 4) {
      CHECK(std::string(to_string(static_cast<weight_tensor>(u))) == "unknown");
      CHECK(std::string(to_string(static_cast<crossover_status>(u))) == "unknown");
    }
  }
}

TEST_CASE("out-of-range enums inside descriptors are refused by their validate") {
  for (auto bad : bad_values<gate_up_order>(2)) {
    expert_shape s = small_shape();
    s.ep_order = bad;
    REQUIRE_MOEBIUS_ERROR(validate(s, 2), errc::invalid_argument, "ep_order (gate_up_order)");
    REQUIRE_MOEBIUS_ERROR(make_arena_geometry(s, 2), errc::invalid_argument, "out of range");
    s = small_shape();
    s.tp_order = bad;
    REQUIRE_MOEBIUS_ERROR(validate(s, 2), errc::invalid_argument, "tp_order (gate_up_order)");
  }
  for (auto bad : bad_values<dtype>(5)) {
    expert_shape s = small_shape();
    s.weight_dtype = bad;
    REQUIRE_MOEBIUS_ERROR(validate(s, 2), errc::invalid_argument, "unknown weight dtype");
    kv_geometry g = small_kv();
    g.type = bad;
    REQUIRE_MOEBIUS_ERROR(validate(g), errc::invalid_argument, "type (dtype)");
  }
  for (auto bad : bad_values<kv_layout>(2)) {
    kv_geometry g = small_kv();
    g.layout = bad;
    REQUIRE_MOEBIUS_ERROR(validate(g), errc::invalid_argument, "layout (kv_layout)");
  }
  for (auto bad : bad_values<down_rule>(2)) {
    switch_policy_config c;
    c.rule = bad;
    REQUIRE_MOEBIUS_ERROR(validate(c), errc::invalid_argument, "rule (down_rule)");
    REQUIRE_MOEBIUS_ERROR(switch_policy(c), errc::invalid_argument, "rule (down_rule)");
  }
  for (auto bad : bad_values<curve_fit>(2)) {
    calibration_options o;
    o.fit = bad;
    REQUIRE_MOEBIUS_ERROR(validate(o), errc::invalid_argument, "fit (curve_fit)");
    const latency_sample samples[] = {{1, 10}, {2, 12}};
    REQUIRE_MOEBIUS_ERROR(latency_curve::fit(samples, bad), errc::invalid_argument,
                          "kind (curve_fit)");
  }
}

TEST_CASE("an out-of-range parallel_mode is refused at every entry that takes one") {
  const kv_geometry g = small_kv();
  for (auto bad : bad_values<parallel_mode>(2)) {
    INFO("mode " << static_cast<int>(bad));
    kv_state s = small_ep_state(g);
    s.mode = bad;
    REQUIRE_MOEBIUS_ERROR(validate(g, s), errc::invalid_argument, "mode (parallel_mode)");
    REQUIRE_MOEBIUS_ERROR(check_kv_capacity(g, s, parallel_mode::tp), errc::invalid_argument,
                          "mode (parallel_mode)");
    REQUIRE_MOEBIUS_ERROR(plan_kv_migration(g, s, parallel_mode::tp), errc::invalid_argument,
                          "mode (parallel_mode)");
    std::vector<kv_demand> demands;
    std::vector<int64_t> groups;
    REQUIRE_MOEBIUS_ERROR(kv_demands_of(g, s, demands, groups), errc::invalid_argument,
                          "mode (parallel_mode)");
    REQUIRE_MOEBIUS_ERROR(make_kv_state(g, bad, {{}, {}}), errc::invalid_argument,
                          "mode (parallel_mode)");

    switch_policy policy(switch_policy_config{});
    REQUIRE_MOEBIUS_ERROR(policy.step(10, bad, 0.0), errc::invalid_argument,
                          "current (parallel_mode)");
    CHECK(policy.stats().steps == 0);  // refused before it counted the step

    latency_curves curves;
    const latency_sample samples[] = {{1, 10}, {2, 12}};
    curves.ep = curves.tp = latency_curve::fit(samples, curve_fit::least_squares_line);
    REQUIRE_MOEBIUS_ERROR(curves.latency_ms(bad, 1.0), errc::invalid_argument,
                          "latency_curves mode (parallel_mode)");
    REQUIRE_MOEBIUS_ERROR(curves.of(bad), errc::invalid_argument,
                          "latency_curves mode (parallel_mode)");

    const arena_geometry a = small_arena();
    testing::host_world w(a, g);
    host_transport t(w.memory);
    switcher sw(a, g, t, small_ep_state(g), arena_cursor{0});
    REQUIRE_MOEBIUS_ERROR(sw.check(bad), errc::invalid_argument,
                          "target attention (parallel_mode)");
    REQUIRE_MOEBIUS_ERROR(sw.switch_to(bad), errc::invalid_argument,
                          "target attention (parallel_mode)");
    // Each half of a layout is checked on its own.
    REQUIRE_MOEBIUS_ERROR(sw.switch_to(parallel_layout{parallel_mode::tp, bad}),
                          errc::invalid_argument, "target experts (parallel_mode)");
    REQUIRE_MOEBIUS_ERROR(sw.plan(parallel_layout{bad, parallel_mode::ep}),
                          errc::invalid_argument, "target attention (parallel_mode)");
    // Refused before anything moved: the switcher still rests where it was and works.
    CHECK(sw.mode() == parallel_mode::ep);
    CHECK(sw.cursor() == arena_cursor{0});
    CHECK(sw.switch_to(parallel_mode::tp).outcome == switch_outcome::committed);
  }
}

// The KV planners take `target` directly and check it themselves: an out-of-range target must
// not reach the TP->EP planner with an EP state (a fuzzer finding).
TEST_CASE("KV planners refuse an out-of-range target", "[error][kv]") {
  const kv_geometry g = small_kv();
  const kv_state s = small_ep_state(g);
  for (auto bad : bad_values<parallel_mode>(2)) {
    REQUIRE_MOEBIUS_ERROR(check_kv_capacity(g, s, bad), errc::invalid_argument, "target");
    REQUIRE_MOEBIUS_ERROR(plan_kv_migration(g, s, bad), errc::invalid_argument, "target");
  }
}

TEST_CASE("plans with out-of-range memory spaces are refused before anything indexes by them") {
  plan p;
  p.num_ranks = 2;
  copy_op op;
  op.row_bytes = 8;
  op.src_pitch = op.dst_pitch = 8;
  const int64_t spaces[num_memory_spaces] = {1024, 1024};
  for (auto bad : bad_values<memory_space>(2)) {
    for (int side = 0; side < 2; ++side) {
      copy_op o = op;
      (side ? o.dst_space : o.src_space) = bad;
      p.phases = {plan_phase{"bad", {o}, {}}};
      REQUIRE_MOEBIUS_ERROR(validate(p, spaces), errc::invalid_argument,
                            "out-of-range memory_space");
      REQUIRE_MOEBIUS_ERROR(rollback_plan(p, 1), errc::invalid_argument,
                            "out-of-range memory_space");
      if (side) {
        REQUIRE_MOEBIUS_ERROR(workload_of(p), errc::invalid_argument, "dst_space (memory_space)");
      }
      std::ostringstream os;
      os << o;  // printing an invalid op must not read past a table
      CHECK(os.str().find("unknown") != std::string::npos);
    }
  }
}

// --- extreme integers ----------------------------------------------------------------------

__extension__ typedef __int128 int128;  // exact sums of up to 256 int64 loads

// The policy's decision rules with exact (128-bit) window sums, no cooldown, no gates.
struct reference_policy {
  switch_policy_config c;
  parallel_mode mode = parallel_mode::tp;
  std::deque<int64_t> window;
  int64_t above = 0;

  bool step(int64_t load) {
    above = load >= c.t_high ? above + 1 : 0;
    window.push_back(load);
    if (static_cast<int64_t>(window.size()) > c.down_window) window.pop_front();
    bool fire = false;
    if (mode == parallel_mode::tp) {
      fire = above >= c.up_window;
    } else if (static_cast<int64_t>(window.size()) == c.down_window) {
      int128 sum = 0;
      for (int64_t l : window) sum += l;
      fire = sum < static_cast<int128>(c.t_low) * c.down_window;
    }
    if (fire) {
      mode = mode == parallel_mode::tp ? parallel_mode::ep : parallel_mode::tp;
      above = 0;
      window.clear();
    }
    return fire;
  }
};

TEST_CASE("the policy decides exactly with loads up to INT64_MAX (saturated window sums)") {
  std::mt19937_64 rng(20240611);
  for (int trial = 0; trial < 300; ++trial) {
    switch_policy_config c;
    const int64_t big = std::uniform_int_distribution<int>(0, 1)(rng) ? int64_t{1} << 40 : 1000;
    c.t_high = std::uniform_int_distribution<int64_t>(1, big)(rng);
    c.t_low = std::uniform_int_distribution<int64_t>(1, c.t_high)(rng);
    c.up_window = std::uniform_int_distribution<int64_t>(1, 4)(rng);
    c.down_window = std::uniform_int_distribution<int64_t>(1, switch_policy_config::max_window)(rng);
    c.cooldown_steps = 0;
    c.cooldown_s = 0.0;
    switch_policy policy(c);
    reference_policy ref;
    ref.c = c;
    parallel_mode current = parallel_mode::tp;
    for (int i = 0; i < 600; ++i) {
      int64_t load = 0;
      switch (std::uniform_int_distribution<int>(0, 3)(rng)) {
        case 0: load = i64_max - std::uniform_int_distribution<int64_t>(0, 3)(rng); break;
        case 1: load = std::uniform_int_distribution<int64_t>(0, i64_max)(rng); break;
        case 2: load = std::uniform_int_distribution<int64_t>(0, 2 * c.t_high)(rng); break;
        default: load = std::uniform_int_distribution<int64_t>(0, c.t_low)(rng); break;
      }
      const switch_decision d = policy.step(load, current, static_cast<double>(i));
      const bool want = ref.step(load);
      INFO("trial " << trial << " step " << i << " load " << load << " " << c);
      REQUIRE(d.do_switch == want);
      if (d.do_switch) current = d.target;
      REQUIRE(current == ref.mode);
      // The window's mean: its loads since the last switch, each saturated at 2^48.
      int128 sum = 0;
      for (int64_t l : ref.window) sum += std::min(l, int64_t{1} << 48);
      const double mean = ref.window.empty()
                              ? 0.0
                              : static_cast<double>(sum) / static_cast<double>(ref.window.size());
      REQUIRE(policy.window_mean() == Catch::Approx(mean).epsilon(1e-12));
    }
  }
}

TEST_CASE("a window full of INT64_MAX loads never leaves EP") {
  switch_policy_config c;
  c.t_high = int64_t{1} << 40;
  c.t_low = c.t_high;
  c.down_window = switch_policy_config::max_window;
  c.cooldown_s = 0.0;
  switch_policy policy(c);
  for (int i = 0; i < 1000; ++i) {
    CHECK_FALSE(policy.step(i64_max, parallel_mode::ep, i).do_switch);
  }
}

TEST_CASE("thresholds beyond the policy's range are refused, not wrapped") {
  REQUIRE_MOEBIUS_ERROR(interactive_config(i64_max), errc::invalid_argument, "T_h must lie");
  REQUIRE_MOEBIUS_ERROR(rollout_config(i64_max), errc::invalid_argument, "T_h must lie");
  // A crossover so large that T_h would pass 2^40 (or int64) is an error, not a cast.
  const latency_sample ep[] = {{1e15, 2e15}, {2e15, 2.5e15}};
  const latency_sample tp[] = {{1e15, 1e15}, {2e15, 3e15}};
  REQUIRE_MOEBIUS_ERROR(calibrate(ep, tp), errc::overflow, "exceeds the policy's limit");
}

TEST_CASE("cost model sums of extreme counts do not wrap") {
  cost_model m;
  switch_workload w;
  w.num_ranks = 2;
  w.weight_phases = i64_max;
  w.kv_rounds = i64_max;
  const switch_cost c = m.predict(w);
  // (weight_phases + kv_rounds) sync points of 10 us barrier + 5 us launch (the defaults),
  // summed in floating point: 2 (2^63 - 1) of them, not a wrapped or saturated count.
  const double syncs = 2.0 * 9223372036854775807.0;
  CHECK(c.barrier_ms == Catch::Approx(syncs * 10e-3));
  CHECK(c.launch_ms == Catch::Approx(syncs * 5e-3));
  CHECK(c.weight_ms == 0);
  CHECK(c.kv_ms == 0);
  CHECK(c.total_ms() == Catch::Approx(syncs * 15e-3));
  plan p;
  p.num_ranks = 2;
  copy_op op;
  op.src_rank = 0;
  op.dst_rank = 1;
  op.rows = i64_max / 2;
  op.row_bytes = 4;
  op.src_pitch = op.dst_pitch = 4;
  p.phases = {plan_phase{"huge", {op}, {}}};
  REQUIRE_MOEBIUS_ERROR(workload_of(p), errc::overflow, "bytes of a plan op");
  REQUIRE_MOEBIUS_ERROR(traffic_of(p), errc::overflow, "traffic_of op bytes");
}

TEST_CASE("traffic_of refuses ops naming ranks outside the plan") {
  plan p;
  p.num_ranks = 2;
  copy_op op;
  op.row_bytes = 8;
  for (int32_t bad : {-1, 2, 1000}) {
    op.src_rank = bad;
    op.dst_rank = 0;
    p.phases = {plan_phase{"bad", {op}, {}}};
    REQUIRE_MOEBIUS_ERROR(traffic_of(p), errc::invalid_argument, "names a rank outside");
    op.src_rank = 0;
    op.dst_rank = bad;
    p.phases = {plan_phase{"bad", {op}, {}}};
    REQUIRE_MOEBIUS_ERROR(traffic_of(p), errc::invalid_argument, "names a rank outside");
    REQUIRE_MOEBIUS_ERROR(rollback_plan(p, 1), errc::invalid_argument, "names a rank outside");
  }
}

// --- non-finite floats ---------------------------------------------------------------------

TEST_CASE("non-finite times, costs and parameters are refused with the field's name") {
  for (double bad : {nan_v, inf_v, -inf_v}) {
    INFO("value " << bad);
    switch_policy policy(switch_policy_config{});
    REQUIRE_MOEBIUS_ERROR(policy.step(10, parallel_mode::ep, bad), errc::invalid_argument,
                          "now_s must be finite");
    CHECK(policy.stats().steps == 0);
    const latency_sample line[] = {{1, 10}, {2, 11}};
    const latency_curves curves = calibrate(line, line).curves;
    REQUIRE_MOEBIUS_ERROR(weigh_step_time(curves, parallel_mode::tp, parallel_mode::ep, 10, 100,
                                          bad, 0.5),
                          errc::invalid_argument, "switch cost estimate must be finite");
    REQUIRE_MOEBIUS_ERROR(weigh_step_time(curves, parallel_mode::tp, parallel_mode::ep, 10, 100,
                                          1.0, bad),
                          errc::invalid_argument, "margin must be finite");
    switch_policy_config c;
    c.cooldown_s = bad;
    REQUIRE_MOEBIUS_ERROR(validate(c), errc::invalid_argument, "cooldown_s must be finite");
    REQUIRE_MOEBIUS_ERROR(interactive_config(256, bad), errc::invalid_argument, "low_ratio");
    calibration_options o;
    o.margin = bad;
    REQUIRE_MOEBIUS_ERROR(validate(o), errc::invalid_argument, "margin must be finite");
    o = {};
    o.low_ratio = bad;
    REQUIRE_MOEBIUS_ERROR(validate(o), errc::invalid_argument, "low_ratio");
    const latency_sample samples[] = {{1, 10}, {2, bad}};
    REQUIRE_MOEBIUS_ERROR(latency_curve::fit(samples, curve_fit::piecewise_linear),
                          errc::invalid_argument, "finite batch");
    const latency_sample batches[] = {{bad, 10}, {2, 12}};
    REQUIRE_MOEBIUS_ERROR(latency_curve::fit(batches, curve_fit::least_squares_line),
                          errc::invalid_argument, "finite batch");
    link_params l;
    l.bandwidth = link_rate{bad};
    REQUIRE_MOEBIUS_ERROR(cost_model(l), errc::invalid_argument, "bandwidth");
    l = {};
    l.barrier_us = bad;
    REQUIRE_MOEBIUS_ERROR(validate(l), errc::invalid_argument, "");
    cost_model m;
    REQUIRE_MOEBIUS_ERROR(m.update(switch_measurement{switch_workload{}, bad}),
                          errc::invalid_argument, "measured switch time must be finite");
  }
}

TEST_CASE("a NaN time cannot disable the cooldown") {
  switch_policy_config c;
  c.cooldown_s = 5.0;
  c.down_window = 1;
  switch_policy policy(c);
  REQUIRE(policy.step(1000, parallel_mode::tp, 0.0).do_switch);  // -> EP, cooldown starts
  REQUIRE_MOEBIUS_ERROR(policy.step(1, parallel_mode::ep, nan_v), errc::invalid_argument,
                        "now_s");
  // Still cooling at 1 s: the load wants TP but the cooldown holds.
  CHECK(policy.step(1, parallel_mode::ep, 1.0).reason == decision_reason::cooldown);
  CHECK(policy.step(1, parallel_mode::ep, 6.0).do_switch);
}

// --- descriptors edited after construction -------------------------------------------------

TEST_CASE("every plan builder re-validates an arena geometry edited after construction") {
  const arena_geometry good = small_arena();
  struct edit {
    const char* what;
    void (*apply)(arena_geometry&);
    errc code;
  };
  const edit edits[] = {
      {"w13 holds", [](arena_geometry& g) { g.num_ranks = 4; }, errc::invalid_argument},
      {"num_ranks must be >= 1", [](arena_geometry& g) { g.num_ranks = 0; }, errc::invalid_argument},
      {"must divide num_experts", [](arena_geometry& g) { g.num_ranks = 3; }, errc::invalid_argument},
      {"slot_bytes", [](arena_geometry& g) { g.slot_bytes = 700; }, errc::invalid_argument},
      {"slot_bytes", [](arena_geometry& g) { g.slot_bytes = 0; }, errc::invalid_argument},
      {"w2 offset", [](arena_geometry& g) { g.tensor_offset[1] = 256; }, errc::invalid_argument},
      {"w2 offset", [](arena_geometry& g) { g.tensor_offset[1] = 520; }, errc::invalid_argument},
      {"w13 holds", [](arena_geometry& g) { g.tensor_bytes[0] = 256; }, errc::invalid_argument},
      {"w13 holds", [](arena_geometry& g) { g.shape.hidden = 16; }, errc::invalid_argument},
      {"w13_scale holds", [](arena_geometry& g) { g.shape.block_scales = true;
                                                  g.shape.scale_block_n = g.shape.scale_block_k = 4; },
       errc::invalid_argument},
      {"tensor_alignment", [](arena_geometry& g) { g.tensor_alignment = 48; }, errc::invalid_argument},
      {"tensor_alignment", [](arena_geometry& g) { g.tensor_alignment = 0; }, errc::invalid_argument},
      {"arena bytes per rank", [](arena_geometry& g) { g.slot_bytes = i64_max / 2; }, errc::overflow},
      {"num_layers", [](arena_geometry& g) { g.shape.num_layers = 0; }, errc::invalid_argument},
  };
  for (const edit& e : edits) {
    arena_geometry g = good;
    e.apply(g);
    INFO("edit: " << e.what);
    REQUIRE_MOEBIUS_ERROR(validate(g), e.code, e.what);
    REQUIRE_MOEBIUS_ERROR(plan_weight_switch(g, arena_cursor{0}, arena_cursor{1}), e.code, e.what);
    REQUIRE_MOEBIUS_ERROR(plan_weight_switch(g, arena_cursor{0}, arena_cursor{0}), e.code, e.what);
    REQUIRE_MOEBIUS_ERROR(weight_switch_workload(g, 1), e.code, e.what);
    REQUIRE_MOEBIUS_ERROR(make_memory_budget(g, attention_shape{}, dense_shape{}, 0, {}), e.code,
                          e.what);
    const kv_geometry k = small_kv();
    testing::host_world w(good, k);
    host_transport t(w.memory);
    REQUIRE_MOEBIUS_ERROR(switcher(g, k, t, small_ep_state(k), arena_cursor{0}), e.code, e.what);
  }
  // The untouched geometry passes everywhere.
  validate(good);
  CHECK(plan_weight_switch(good, arena_cursor{0}, arena_cursor{2}).phases.size() == 2);
}

TEST_CASE("a shrunk slot would have given a self-overlapping plan; it is refused instead") {
  arena_geometry g = small_arena();
  g.slot_bytes = 512;  // smaller than w13 + w2 (768): slot i+1 would overlap slot i's w2
  REQUIRE_MOEBIUS_ERROR(plan_weight_switch(g, arena_cursor{0}, arena_cursor{2}),
                        errc::invalid_argument, "slot_bytes 512 is smaller than its tensors");
}

// --- page tables and placement -------------------------------------------------------------

TEST_CASE("a page repeated inside one sequence is refused, shared prefix or not") {
  const kv_geometry g = small_kv();
  const int64_t ps = g.page_size;
  using testing::sequence;
  struct bad_case {
    const char* what;
    std::vector<std::vector<kv_sequence>> ep_tables;
  };
  const bad_case cases[] = {
      {"plain", {{sequence(1, {2, 2}, 1, ps)}, {}}},
      {"inside the shared prefix", {{sequence(1, {2, 2, 3}, 1, ps, 2)}, {}}},
      {"all shared", {{sequence(1, {4, 5, 4}, ps, ps, 3)}, {}}},
      {"shared then own", {{sequence(1, {2, 2}, 1, ps, 1)}, {}}},
      {"beside a legal share",
       {{sequence(1, {6, 7}, 1, ps, 1), sequence(2, {6, 6, 1}, 1, ps, 2)}, {}}},
  };
  for (const bad_case& c : cases) {
    INFO(c.what);
    REQUIRE_MOEBIUS_ERROR(make_kv_state(g, parallel_mode::ep, c.ep_tables),
                          errc::invalid_argument, "twice");
  }
  // The same in TP (rank 1 mirrors rank 0's sharing with other ids).
  REQUIRE_MOEBIUS_ERROR(make_kv_state(g, parallel_mode::tp,
                                      {{sequence(1, {3, 3, 4}, 1, ps, 2)},
                                       {sequence(1, {9, 9, 10}, 1, ps, 2)}}),
                        errc::invalid_argument, "twice");
  // A state edited after make_kv_state is refused by every entry that reads it.
  kv_state s = small_ep_state(g);
  s.ranks[0].sequences[0].pages = {0, 0};
  s.ranks[0].free_pages.insert(s.ranks[0].free_pages.begin() + 0, 1);
  REQUIRE_MOEBIUS_ERROR(validate(g, s), errc::invalid_argument, "twice");
  REQUIRE_MOEBIUS_ERROR(check_kv_capacity(g, s, parallel_mode::tp), errc::invalid_argument, "twice");
  REQUIRE_MOEBIUS_ERROR(plan_kv_migration(g, s, parallel_mode::tp), errc::invalid_argument, "twice");
  std::vector<kv_demand> demands;
  std::vector<int64_t> groups;
  REQUIRE_MOEBIUS_ERROR(kv_demands_of(g, s, demands, groups), errc::invalid_argument, "twice");
  // Legal sharing across sequences still passes.
  const kv_state ok = make_kv_state(
      g, parallel_mode::ep,
      {{sequence(1, {6, 7}, 1, ps, 1), sequence(2, {6, 1}, 1, ps, 1)}, {}});
  CHECK(used_pages(g, ok, 0) == 3);
}

TEST_CASE("kv_demands_of refuses page ids outside the pool instead of indexing with them") {
  const kv_geometry g = small_kv();
  kv_state s = make_kv_state(g, parallel_mode::tp,
                             {{testing::sequence(1, {0}, 1, g.page_size)},
                              {testing::sequence(1, {0}, 1, g.page_size)}});
  s.ranks[0].sequences[0].pages[0] = 1 << 20;
  std::vector<kv_demand> demands;
  std::vector<int64_t> groups;
  REQUIRE_MOEBIUS_ERROR(kv_demands_of(g, s, demands, groups), errc::invalid_argument, "outside");
}

TEST_CASE("placement refuses negative capacity and counts; extreme counts never wrap") {
  const kv_demand d[] = {{1, 3, -1}, {2, 2, 0}, {3, 1, 0}};
  const int64_t groups[] = {2};
  for (int64_t bad : {int64_t{-1}, std::numeric_limits<int64_t>::min()}) {
    const int64_t capacity[] = {10, bad};
    REQUIRE_MOEBIUS_ERROR(place_longest_first(d, groups, capacity), errc::invalid_argument,
                          "capacity of rank 1");
    const int64_t neg_group[] = {bad};
    const int64_t cap[] = {10, 10};
    REQUIRE_MOEBIUS_ERROR(place_longest_first(d, neg_group, cap), errc::invalid_argument,
                          "shared pages");
    const kv_demand neg[] = {{1, bad, -1}};
    REQUIRE_MOEBIUS_ERROR(place_longest_first(neg, groups, cap), errc::invalid_argument,
                          "own_pages");
  }
  // A share group whose pages pass 2^63.
  const kv_demand huge_group[] = {{1, i64_max, 0}, {2, i64_max, 0}};
  const int64_t cap[] = {i64_max, i64_max};
  REQUIRE_MOEBIUS_ERROR(place_longest_first(huge_group, groups, cap), errc::overflow,
                        "pages of a share group");
  // Loads near 2^63 on full ranks: nothing placed past capacity, imbalance finite.
  const kv_demand big[] = {{1, i64_max, -1}, {2, i64_max - 1, -1}, {3, 1, -1}};
  const kv_placement p = place_longest_first(big, {}, cap);
  CHECK(p.fits);
  CHECK(p.owner[0] != p.owner[1]);
  for (size_t r = 0; r < 2; ++r) CHECK(p.load[r] <= cap[r]);
  // Longest first: the two near-2^63 demands on different ranks, the 1-page one on the rank
  // of the (2^63 - 2)-page one: both ranks hold exactly 2^63 - 1, imbalance max / mean = 1.
  CHECK(p.owner[2] == p.owner[1]);
  CHECK(p.load[0] == i64_max);
  CHECK(p.load[1] == i64_max);
  CHECK(p.imbalance == Catch::Approx(1.0));
  const int64_t small_cap[] = {i64_max - 2, 3};
  const kv_placement q = place_longest_first(big, {}, small_cap);
  CHECK_FALSE(q.fits);
  for (size_t r = 0; r < 2; ++r) CHECK(q.load[r] <= small_cap[r]);
}

}  // namespace

namespace {

// Found by fuzz/fuzz_placement: repeated seq ids made the radix sort's key -> item map
// collapse items, so some demands were never placed while `fits` still said true.
TEST_CASE("placement with repeated seq ids places every demand (fuzz regression)") {
  std::vector<moebius::kv_demand> demands(32, moebius::kv_demand{0, 0, -1});
  for (size_t i = 0; i < demands.size(); i += 3) demands[i].own_pages = 2;
  const int64_t capacity[] = {int64_t{584393728697827327}, 25, 0, 0, 0, 0, 0};
  const moebius::kv_placement p = moebius::place_longest_first(demands, {}, capacity);
  CHECK(p.fits);
  int64_t load0 = 0, load1 = 0;
  for (size_t i = 0; i < demands.size(); ++i) {
    INFO("demand " << i);
    REQUIRE(p.owner[i] >= 0);
    (p.owner[i] == 0 ? load0 : load1) += demands[i].own_pages;
  }
  CHECK(load0 == p.load[0]);
  CHECK(load1 == p.load[1]);
}

}  // namespace

namespace {

// Found by fuzz/fuzz_weight_plan: validate(expert_shape) computed w13's 2I rows (signed
// overflow, undefined behaviour) before checking any byte count.
TEST_CASE("an intermediate size whose 2I overflows is refused before anything computes it (fuzz regression)") {
  moebius::expert_shape s = moebius::testing::small_shape();
  s.intermediate = int64_t{4702111237672473088};
  s.num_experts = 1;
  REQUIRE_MOEBIUS_ERROR(validate(s, 1), moebius::errc::overflow, "w13 rows (2I)");
  REQUIRE_MOEBIUS_ERROR(moebius::make_arena_geometry(s, 1), moebius::errc::overflow, "2I");
}

}  // namespace

namespace {

// Found by fuzz/fuzz_kv: validate(kv_geometry) multiplied L by 2 (K and V) unchecked.
TEST_CASE("a KV layer count whose L x 2 tensors overflows is refused (fuzz regression)") {
  moebius::kv_geometry g = moebius::testing::small_kv();
  g.num_layers = int64_t{6925117155258272263};
  REQUIRE_MOEBIUS_ERROR(validate(g), moebius::errc::overflow, "KV tensors (L x K|V)");
  g.num_ep_pages = 0;  // an empty pool does not excuse it
  REQUIRE_MOEBIUS_ERROR(validate(g), moebius::errc::overflow, "KV tensors (L x K|V)");
}

}  // namespace

namespace {

// Found by fuzz/fuzz_kv: a geometry with 0 pages passed validate() although one page over
// all its tensors (a staging slot) overflowed; the KV planner then computed it.
TEST_CASE("a KV page over all tensors must fit in 64 bits even in an empty pool (fuzz regression)") {
  moebius::kv_geometry g = moebius::testing::small_kv();
  g.num_ep_pages = 0;
  g.head_dim = int64_t{1} << 50;  // page 2^50 * 4 tokens * 2 heads * 2 B = 2^54, x 4 tensors
  g.num_layers = 64;              // x 128 tensors = 2^61 ... x 2^4 more overflows
  g.page_size = 64;
  REQUIRE_MOEBIUS_ERROR(validate(g), moebius::errc::overflow, "KV page bytes");
  const moebius::kv_state s{moebius::parallel_mode::ep, {{}, {}}};
  REQUIRE_MOEBIUS_ERROR(plan_kv_migration(g, s, moebius::parallel_mode::tp),
                        moebius::errc::overflow, "KV page bytes");
}

}  // namespace
