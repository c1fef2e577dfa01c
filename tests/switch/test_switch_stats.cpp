// The per-switch stats record and its metrics: every stage's bytes and time come from the
// report, in the documented order, with the documented names.
#include <map>
#include <random>
#include <string>
#include <vector>

#include "moebius/switch/switch_stats.hpp"
#include "support/catch.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"

using namespace moebius;
using moebius::testing::test_seed;
using moebius::testing::uniform;

TEST_CASE("switch stats and metrics follow the report", "[switch][stats]") {
  std::mt19937_64 rng(test_seed());
  for (int iter = 0; iter < 50; ++iter) {
    switch_report r;
    const int P = static_cast<int>(uniform(rng, 1, 8));
    int64_t wsum = 0, ksum = 0;
    for (int i = 0; i < P; ++i) {
      r.weight_bytes_sent.push_back(uniform(rng, 0, int64_t{1} << 40));
      r.kv_bytes_sent.push_back(uniform(rng, 0, int64_t{1} << 30));
      wsum += r.weight_bytes_sent.back();
      ksum += r.kv_bytes_sent.back();
    }
    auto ms = [&] { return static_cast<double>(uniform(rng, 0, 1'000'000)) / 1000.0; };
    r.capacity_ms = ms();
    r.plan_ms = ms();
    r.weights_ms = ms();
    r.kv_ms = ms();
    r.verify_ms = ms();
    r.undo_ms = ms();
    r.total_ms = ms();
    r.weight_phases = uniform(rng, 0, 94);
    r.kv_rounds = uniform(rng, 0, 40);
    r.weight_phases_completed = uniform(rng, 0, r.weight_phases);
    r.kv_rounds_completed = uniform(rng, 0, r.kv_rounds);
    r.kv_stats.pages_moved = uniform(rng, 0, int64_t{1} << 33);
    r.verified = uniform(rng, 0, 1) == 1;
    r.outcome = static_cast<switch_outcome>(uniform(rng, 0, 4));

    const switch_stats s = stats_of(r);
    CHECK(s[switch_stage::weights].bytes == wsum);
    CHECK(s[switch_stage::kv].bytes == ksum);
    CHECK(s[switch_stage::plan].bytes == 0);
    CHECK(s[switch_stage::capacity].ms == r.capacity_ms);
    CHECK(s[switch_stage::plan].ms == r.plan_ms);
    CHECK(s[switch_stage::weights].ms == r.weights_ms);
    CHECK(s[switch_stage::kv].ms == r.kv_ms);
    CHECK(s[switch_stage::verify].ms == r.verify_ms);
    CHECK(s[switch_stage::undo].ms == r.undo_ms);
    CHECK(s.total_ms == r.total_ms);

    std::vector<std::string> names;
    std::map<std::string, double> m;
    for_each_metric(r, [&](std::string_view n, double v) {
      names.emplace_back(n);
      m[std::string(n)] = v;
    });
    const std::vector<std::string> expected = {
        "moebius_switch_capacity_bytes", "moebius_switch_capacity_ms",
        "moebius_switch_plan_bytes",     "moebius_switch_plan_ms",
        "moebius_switch_weights_bytes",  "moebius_switch_weights_ms",
        "moebius_switch_kv_bytes",       "moebius_switch_kv_ms",
        "moebius_switch_verify_bytes",   "moebius_switch_verify_ms",
        "moebius_switch_undo_bytes",     "moebius_switch_undo_ms",
        "moebius_switch_total_ms",       "moebius_switch_weight_phases",
        "moebius_switch_kv_rounds",      "moebius_switch_committed",
        "moebius_switch_rolled_back",    "moebius_switch_inconsistent",
        "moebius_switch_weight_phases_completed", "moebius_switch_kv_rounds_completed",
        "moebius_switch_kv_pages_moved", "moebius_switch_refused_capacity",
        "moebius_switch_already_there",  "moebius_switch_verified"};
    REQUIRE(names == expected);
    CHECK(m["moebius_switch_weights_bytes"] == static_cast<double>(wsum));
    CHECK(m["moebius_switch_kv_bytes"] == static_cast<double>(ksum));
    CHECK(m["moebius_switch_weights_ms"] == r.weights_ms);
    CHECK(m["moebius_switch_kv_ms"] == r.kv_ms);
    CHECK(m["moebius_switch_undo_ms"] == r.undo_ms);
    CHECK(m["moebius_switch_total_ms"] == r.total_ms);
    CHECK(m["moebius_switch_weight_phases"] == static_cast<double>(r.weight_phases));
    CHECK(m["moebius_switch_kv_rounds"] == static_cast<double>(r.kv_rounds));
    CHECK(m["moebius_switch_committed"] == (r.outcome == switch_outcome::committed ? 1.0 : 0.0));
    CHECK(m["moebius_switch_rolled_back"] ==
          (r.outcome == switch_outcome::rolled_back ? 1.0 : 0.0));
    CHECK(m["moebius_switch_inconsistent"] ==
          (r.outcome == switch_outcome::inconsistent ? 1.0 : 0.0));
    CHECK(m["moebius_switch_weight_phases_completed"] ==
          static_cast<double>(r.weight_phases_completed));
    CHECK(m["moebius_switch_kv_rounds_completed"] == static_cast<double>(r.kv_rounds_completed));
    CHECK(m["moebius_switch_kv_pages_moved"] == static_cast<double>(r.kv_stats.pages_moved));
    CHECK(m["moebius_switch_refused_capacity"] ==
          (r.outcome == switch_outcome::refused_capacity ? 1.0 : 0.0));
    CHECK(m["moebius_switch_already_there"] ==
          (r.outcome == switch_outcome::already_there ? 1.0 : 0.0));
    CHECK(m["moebius_switch_verified"] == (r.verified ? 1.0 : 0.0));
    // metrics_of: the same names and values, in the same order.
    const std::vector<switch_metric> list = metrics_of(r);
    REQUIRE(list.size() == names.size());
    for (size_t i = 0; i < list.size(); ++i) {
      CHECK(list[i].name == names[i]);
      CHECK(list[i].value == m[names[i]]);
    }
  }
}
