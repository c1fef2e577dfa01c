// The simulated runtime's runs beyond the paper's (demo/runs.hpp, experiments.hpp): every run
// kind by name on its own deployment, the capacity line against the tokens worked out by hand,
// the sim clock saying which curves it measured and which it priced (and pricing a TEP-DCP2
// step as the fallback does, recomputed here from TP's region curve), and the designs verdict
// against fabricated runs whose answer is known.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <tuple>
#include <vector>

#include <unistd.h>

#include <moebius/error.hpp>
#include <nlohmann/json.hpp>

#include "catch.hpp"
#include "clock.hpp"
#include "experiments.hpp"
#include "designs_report.hpp"
#include "paper_report.hpp"
#include "run_json.hpp"
#include "runs.hpp"
#include "step_curves.hpp"

using namespace mini_engine;
using namespace mini_engine::demo;
using moebius::parallel_mode;

namespace {

// A served run of kind `k` whose metrics are a rollout of `total_s`, or an interactive trace
// with interactive goodput `goodput` and `tokens_per_s`.
struct fake_runs {
  std::vector<run_outcome> runs;
  std::vector<paper_metrics> m;
  void add(run_kind k, double total_s, double goodput = 0, double tokens_per_s = 0) {
    run_outcome r;
    r.kind = k;
    runs.push_back(r);
    paper_metrics x;
    x.rollout_total_s = total_s;
    x.goodput_rps[0] = goodput;
    x.tokens_per_s = tokens_per_s;
    x.quiet.mean_tpot_ms = 40;
    m.push_back(x);
  }
};

// A file removed when it goes out of scope.
struct temp_file {
  std::string path;
  ~temp_file() {
    std::error_code ignored;
    std::filesystem::remove(path, ignored);
  }
};

// The embedded region curves of Qwen3-235B at P = 8 for TP and EP alone, written to a file: a
// clock on it prices TP-DCP2 and TEP-DCP2 by the fallback whether or not their own measured
// curves are embedded.
temp_file tp_and_ep_region_file() {
  std::string text;
  for (const embedded_curves& f : step_curves::region_files()) {
    std::istringstream in(f.text);
    std::string first;
    while (std::getline(in, first) && first.find_first_not_of(" \t\r") == std::string::npos) {
    }
    const nlohmann::json j = nlohmann::json::parse(first);
    const std::string mode = j.value("mode", std::string());
    if (j.value("model", std::string()) != "qwen3_235b" || j.value("P", 0) != 8 ||
        (mode != "TP" && mode != "EP"))
      continue;
    text += f.text;
    if (text.back() != '\n') text += '\n';
  }
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() /
      ("moebius_test_tp_ep_region_" + std::to_string(::getpid()) + ".jsonl");
  std::ofstream(path) << text;
  return temp_file{path.string()};
}

size_t at(const fake_runs& f, run_kind k) {
  for (size_t i = 0; i < f.runs.size(); ++i)
    if (f.runs[i].kind == k) return i;
  return f.runs.size();
}

}  // namespace

TEST_CASE("the simulated runtime's runs: every kind once, by name, on its own deployment",
          "[cpu][demo]") {
  const run_settings s = sim_settings();
  const std::set<run_kind> kinds(s.runs.begin(), s.runs.end());
  CHECK(kinds.size() == s.runs.size());
  for (const run_kind k : {run_kind::static_tp, run_kind::static_ep, run_kind::static_tp_dcp2,
                           run_kind::static_tep_dcp2, run_kind::switching, run_kind::progressive,
                           run_kind::paper_policy, run_kind::by_cost, run_kind::switching_dcp2,
                           run_kind::experts_only})
    CHECK(kinds.count(k) == 1);
  std::set<std::string> labels;
  for (const run_kind k : s.runs) labels.insert(label_of(k));
  CHECK(labels.size() == s.runs.size());
  CHECK(std::string(label_of(run_kind::static_tep_dcp2)) == "static TEP-DCP2");
  CHECK(std::string(label_of(run_kind::experts_only)) == "ours experts");
  CHECK(deployment_of(run_kind::static_tp_dcp2) == deployment_kind::static_tp_dcp2);
  CHECK(deployment_of(run_kind::switching_dcp2) == deployment_kind::switching_dcp2);
  CHECK(deployment_of(run_kind::experts_only) == deployment_kind::experts_only);
  CHECK(deployment_of(run_kind::by_cost) == deployment_kind::switching);
  CHECK(is_static(run_kind::static_tep_dcp2));
  CHECK_FALSE(is_static(run_kind::experts_only));
  CHECK(is_other_design(run_kind::experts_only));
  CHECK_FALSE(is_other_design(run_kind::switching));
  // The layouts each design serves in, large-batch layout first.
  CHECK(layouts_of(sim_deployment_of(deployment_kind::experts_only)) == "TEP-DCP2 <-> TP-DCP2");
  CHECK(layouts_of(sim_deployment_of(deployment_kind::switching_dcp2)) == "EP <-> TP-DCP2");
  CHECK(layouts_of(sim_deployment_of(deployment_kind::static_tep_dcp2)) == "TEP-DCP2");
}

TEST_CASE("the capacity line: every deployment once, its tokens as worked out by hand",
          "[cpu][demo]") {
  // Tokens (test_serving_deployment works them out): static TP 1,439,278, TP-DCP2 and TEP-DCP2
  // 2,878,556, EP 2,301,072; the paper's design EP 2,275,968 / TP 1,137,987; EP <-> TP-DCP2
  // 2,275,968 / 2,275,974; experts only 2,853,456 in both.
  const std::string line = capacity_line(sim_settings().runs);
  CHECK(line ==
        "KV tokens: static TP 1.44M, static EP 2.30M, static TP-DCP2 2.88M, static TEP-DCP2 "
        "2.88M; switching EP 2.28M / TP 1.14M, switching DCP2 EP 2.28M / TP-DCP2 2.28M, experts "
        "only TEP-DCP2 2.85M / TP-DCP2 2.85M, dcp only TP-DCP2 2.88M / TP 1.44M");
  const std::vector<run_kind> paper = {run_kind::static_tp, run_kind::static_ep,
                                       run_kind::switching, run_kind::progressive};
  CHECK(capacity_line(paper) == "KV tokens: static TP 1.44M, static EP 2.30M; switching EP 2.28M / TP 1.14M");
}

TEST_CASE("the sim clock: TP and EP measured, TP-DCP2 priced from TP's and TEP-DCP2 from that by "
          "a measured ratio, said so",
          "[cpu][demo]") {
  const temp_file tp_ep_file = tp_and_ep_region_file();
  const std::string& tp_ep = tp_ep_file.path;
  options o;
  o.runtime = runtime_kind::sim;
  o.collectives = collective_pricing::link;
  o.curves = tp_ep;
  const demo_clock c = make_sim_clock(o);
  CHECK_THAT(c.curves_summary, Catch::Matchers::Contains("step curves: TP, EP measured") &&
                                   Catch::Matchers::Contains("TP-DCP2, TEP-DCP2 PRICED, not measured") &&
                                   Catch::Matchers::Contains("TEP-DCP2 that times TEP-DCP2/TP-DCP2"));
  // A TP-DCP2 decode step of 64 sequences at 4,096 tokens, recomputed from TP's region curve
  // at 2,048 tokens: plus 94 x DCP's exchange (3 x 10 us + (64 x 8 x 128 x 2 x 2 + 64 x 2 x 8 x 4)
  // B at 389 GB/s).
  const step_curves region = step_curves::from_file(tp_ep);
  const double tp_ms = region.step_ms(parallel_mode::tp, 64, 2048);
  const double exchange_ms = 94 * (30e-3 + (64.0 * 8 * 128 * 2 * 2 + 64.0 * 2 * 8 * 4) / 389e9 * 1e3);
  step_cost s;
  s.set(k_tp_dcp2);
  s.num_ranks = 8;
  s.num_sequences = s.new_tokens = 64;
  s.context_tokens = 64 * 4096;
  CHECK(c.clock->step_s(s, 0) * 1e3 == Approx(tp_ms + exchange_ms).epsilon(1e-9));
  // TEP-DCP2 at the same step: that times TEP-DCP2 / TP-DCP2 as the committed layouts' run
  // measured them (one H100, 40 layers), plus the busiest EP rank's expert load at batch 64
  // (each rank's 16 whole experts, 94 layers of 37,748,736 B each, at the H200's HBM rate).
  const std::optional<step_curves> ratios = step_curves::layout_ratios("qwen3_235b", 8);
  REQUIRE(ratios);
  const double ratio = ratios->step_ms_within(k_tep_dcp2, 64, 4096) /
                       ratios->step_ms_within(k_tp_dcp2, 64, 4096);
  CHECK(ratio > 0.9);  // measured: TEP's whole experts gain little at batch 64
  CHECK(ratio < 1.1);
  const double load_ms = expert_load_shift_ms(true, 64, 128, 8, 8, 94, 37'748'736.0,
                                              h200_params{}.hbm.bytes_per_s, routing_model{});
  s.set(k_tep_dcp2);
  CHECK(c.clock->step_s(s, 0) * 1e3 == Approx((tp_ms + exchange_ms) * ratio + load_ms).epsilon(1e-9));
  // The paper's configurations keep their measured curves.
  step_cost t = s;
  t.set(k_tp);
  t.context_tokens = 64 * 2048;
  CHECK(c.clock->step_s(t, 0) * 1e3 == Approx(tp_ms).epsilon(1e-12));
  // By default the collectives are priced from the cited table: each step moves by its
  // configuration's shift at its batch (step_collectives.hpp).
  options cited_options = o;
  cited_options.collectives = collective_pricing::cited;  // the default
  const demo_clock cited = make_sim_clock(cited_options);
  decode_step_shape shape;
  shape.batch = 64;
  shape.layers = 94;
  shape.hidden = 4096;
  shape.q_heads = 64;
  shape.head_dim = 128;
  const double tp_shift = collectives_shift_ms(shape, collective_pricing::link, collective_pricing::cited);
  shape.dcp = 2;
  const double dcp_shift = collectives_shift_ms(shape, collective_pricing::link, collective_pricing::cited);
  CHECK(dcp_shift > tp_shift);  // DCP's three exchanges at NCCL's latency, not 10 us
  CHECK(cited.clock->step_s(s, 0) * 1e3 ==
        Approx((tp_ms + exchange_ms) * ratio + dcp_shift + load_ms).epsilon(1e-9));
  CHECK(cited.clock->step_s(t, 0) * 1e3 == Approx(tp_ms + tp_shift).epsilon(1e-12));
  CHECK_THAT(cited.description, Catch::Matchers::Contains("collectives priced by cited measurements"));
}

TEST_CASE("the sim clock with --graph-buckets vllm: decode steps at vLLM's bucket of the rank "
          "batch, prefill steps as before",
          "[cpu][demo]") {
  options o;
  o.runtime = runtime_kind::sim;
  const demo_clock plain = make_sim_clock(o);
  o.vllm_graph_buckets = true;
  const demo_clock padded = make_sim_clock(o);
  CHECK_THAT(padded.description, Catch::Matchers::Contains("CUDA-graph bucket (67 buckets, 1-512"));
  // TP: 9 sequences replay the graph of 16 (vLLM: 1, 2, 4, 8, 16, ...); 3 that of 4; 512 its own.
  const auto tp = [](int64_t seqs, int64_t new_tokens) {
    step_cost s;
    s.set(k_tp);
    s.num_ranks = 8;
    s.num_sequences = seqs;
    s.new_tokens = new_tokens;
    s.context_tokens = seqs * 2048;
    return s;
  };
  const auto same = [](const demo_clock& a, const step_cost& x, const demo_clock& b,
                       const step_cost& y) {
    return a.clock->step_s(x, 0) == Approx(b.clock->step_s(y, 0)).epsilon(1e-12);
  };
  CHECK(same(padded, tp(9, 9), plain, tp(16, 16)));
  CHECK(same(padded, tp(3, 3), plain, tp(4, 4)));
  CHECK(same(padded, tp(512, 512), plain, tp(512, 512)));
  CHECK(padded.clock->step_s(tp(9, 9), 0) > plain.clock->step_s(tp(9, 9), 0));
  // Beyond the largest bucket: eager at its own batch (the penalty 1: no measured one).
  CHECK(same(padded, tp(600, 600), plain, tp(600, 600)));
  // A step that prefills is not padded.
  CHECK(same(padded, tp(9, 500), plain, tp(9, 500)));
  // EP: the bucket of each rank's own sequences (5 -> 8 on the busiest rank: as if 8 each).
  step_cost ep;
  ep.set(k_ep);
  ep.num_ranks = 8;
  ep.ranks.assign(8, rank_work{2, 2, 2 * 2048});
  ep.ranks[3] = {5, 5, 5 * 2048};
  ep.num_sequences = ep.new_tokens = 19;
  ep.context_tokens = 19 * 2048;
  step_cost ep8 = ep;
  ep8.ranks.assign(8, rank_work{8, 8, 8 * 2048});
  ep8.num_sequences = ep8.new_tokens = 64;
  ep8.context_tokens = 64 * 2048;
  CHECK(same(padded, ep, plain, ep8));
}

TEST_CASE("the designs verdict: the best switching design against the paper's baselines and "
          "every static configuration",
          "[cpu][demo]") {
  fake_runs f;
  f.add(run_kind::static_tp, 100);
  f.add(run_kind::static_ep, 80);
  f.add(run_kind::static_tp_dcp2, 60);
  f.add(run_kind::static_tep_dcp2, 70);
  f.add(run_kind::switching, 78);
  f.add(run_kind::progressive, 50);  // a style of the paper's design, not a design of its own
  f.add(run_kind::switching_dcp2, 65);
  f.add(run_kind::experts_only, 58);
  std::optional<designs_verdict> v = designs_verdict_of(f.runs, f.m, true);
  REQUIRE(v.has_value());
  CHECK(v->design == at(f, run_kind::experts_only));
  CHECK(v->paper == at(f, run_kind::static_ep));
  CHECK(v->best_static == at(f, run_kind::static_tp_dcp2));
  // 80 / 58 = 1.379x static EP; 60 / 58 = 1.034x static TP-DCP2.
  CHECK(v->line ==
        "designs: the best switching design is ours experts (58 s): 1.379x static EP (the better "
        "of static TP and EP); 1.034x static TP-DCP2 (the best of the 4 static configurations)");
  // Interactive: by interactive goodput, then tokens/s; static TP ties the design and is the
  // best of the statics.
  fake_runs g;
  g.add(run_kind::static_tp, 0, 3.4, 1543);
  g.add(run_kind::static_ep, 0, 0.15, 1481);
  g.add(run_kind::static_tp_dcp2, 0, 0.64, 1515);
  g.add(run_kind::switching, 0, 3.4, 1543);
  g.add(run_kind::switching_dcp2, 0, 0.27, 1512);
  g.add(run_kind::experts_only, 0, 3.4, 1500);
  v = designs_verdict_of(g.runs, g.m, false);
  REQUIRE(v.has_value());
  CHECK(v->design == at(g, run_kind::switching));
  CHECK(v->paper == at(g, run_kind::static_tp));
  CHECK(v->best_static == v->paper);
  CHECK_THAT(v->line, Catch::Matchers::Contains("is ours, against static TP: goodput 3.40 vs 3.40/s") &&
                          Catch::Matchers::Contains("and the best of the 3 static configurations"));
  // The dcp-only design ties the paper's: the tie names it (the default design), and the
  // verdicts lead with it whenever it was served.
  CHECK(default_design(g.runs) == run_kind::switching);
  g.add(run_kind::dcp_only, 0, 3.4, 1543);
  v = designs_verdict_of(g.runs, g.m, false);
  REQUIRE(v.has_value());
  CHECK(v->design == at(g, run_kind::dcp_only));
  CHECK_THAT(v->line, Catch::Matchers::Contains("is ours dcp, against static TP"));
  CHECK(default_design(g.runs) == run_kind::dcp_only);
  // Only the paper's runs: nothing to say.
  fake_runs p;
  p.add(run_kind::static_tp, 100);
  p.add(run_kind::static_ep, 80);
  p.add(run_kind::switching, 78);
  CHECK_FALSE(designs_verdict_of(p.runs, p.m, true).has_value());
}

namespace {

// A run of `n` steps at random times (gaps of 1-120 ms, some of several seconds: a window with
// no step), each with a random queue, batch, KV reserved and written, ratio and retractions.
// The fields of one CSV line.
std::vector<std::string> csv_fields(const std::string& line) {
  std::vector<std::string> out(1);
  for (const char c : line) {
    if (c == ',')
      out.emplace_back();
    else
      out.back() += c;
  }
  return out;
}

run_result random_admission_run(std::mt19937_64& rng, int64_t n) {
  run_result r;
  std::uniform_int_distribution<int64_t> count(0, 3000), tokens(0, int64_t{3} << 30);
  std::uniform_int_distribution<int> coin(0, 49);
  std::uniform_real_distribution<double> gap_s(0.001, 0.120), ratio(0.0, 1.0);
  double t = std::uniform_real_distribution<double>(0, 3)(rng);
  for (int64_t i = 0; i < n; ++i) {
    step_record s;
    s.step = i;
    s.start_s = t;
    s.waiting = coin(rng) < 10 ? 0 : count(rng);  // an empty queue often: floods' windows end
    s.running = count(rng);
    s.kv_reserved_tokens = tokens(rng);  // past 2^31: 64-bit counts
    s.kv_written_tokens = tokens(rng);
    s.new_token_ratio = ratio(rng);
    s.preempted = coin(rng) == 0 ? count(rng) % 7 : 0;
    r.steps.push_back(s);
    t += coin(rng) == 0 ? gap_s(rng) * 40 : gap_s(rng);
  }
  r.end_s = t;
  return r;
}

}  // namespace

TEST_CASE("admission over time: each window's longest queue, most running, most reserved and "
          "written, last ratio and retractions, against a brute-force count",
          "[cpu][demo]") {
  std::mt19937_64 rng(Catch::rngSeed() + 17);
  for (int trial = 0; trial < 20; ++trial) {
    const run_result r = random_admission_run(rng, 1 + static_cast<int64_t>(rng() % 3000));
    const double bucket_s = std::uniform_real_distribution<double>(0.05, 4)(rng);
    const nlohmann::json j = admission_over_time_json(r, bucket_s);
    CHECK(j["bucket_s"].get<double>() == bucket_s);
    CHECK(j["columns"] ==
          "start_s,waiting_max,running_max,kv_reserved_tokens_max,kv_written_tokens_max,"
          "new_token_ratio_last,retracted");
    // The reference: every window index once, its steps found by scanning all of them.
    std::set<int64_t> windows;
    for (const step_record& s : r.steps)
      windows.insert(static_cast<int64_t>(std::floor(s.start_s / bucket_s)));
    REQUIRE(j["rows"].size() == windows.size());
    size_t row = 0;
    for (const int64_t w : windows) {
      int64_t waiting = -1, running = -1, reserved = -1, written = -1, retracted = 0;
      double ratio = -1, last_t = -1;
      for (const step_record& s : r.steps) {
        if (static_cast<int64_t>(std::floor(s.start_s / bucket_s)) != w) continue;
        waiting = std::max(waiting, s.waiting);
        running = std::max(running, s.running);
        reserved = std::max(reserved, s.kv_reserved_tokens);
        written = std::max(written, s.kv_written_tokens);
        retracted += s.preempted;
        if (s.start_s > last_t) last_t = s.start_s, ratio = s.new_token_ratio;
      }
      const std::vector<std::string> x = csv_fields(j["rows"][row++].get<std::string>());
      REQUIRE(x.size() == 7);
      CHECK(std::stod(x[0]) == Approx(static_cast<double>(w) * bucket_s).epsilon(1e-9));
      CHECK(std::stoll(x[1]) == waiting);
      CHECK(std::stoll(x[2]) == running);
      CHECK(std::stoll(x[3]) == reserved);
      CHECK(std::stoll(x[4]) == written);
      CHECK(std::stod(x[5]) == Approx(ratio).epsilon(1e-5).margin(1e-12));
      CHECK(std::stoll(x[6]) == retracted);
    }
  }
  // By hand: steps at 0.2, 0.9, 2.5 s in windows of 1 s: two rows, the second at 2 s.
  run_result h;
  for (const auto& [t, waiting, reserved, ratio, pre] :
       std::vector<std::tuple<double, int64_t, int64_t, double, int64_t>>{
           {0.2, 5, 100, 0.7, 1}, {0.9, 3, 400, 0.6, 2}, {2.5, 0, 50, 0.1, 0}}) {
    step_record s;
    s.start_s = t, s.waiting = waiting, s.kv_reserved_tokens = reserved;
    s.new_token_ratio = ratio, s.preempted = pre;
    h.steps.push_back(s);
  }
  const nlohmann::json j = admission_over_time_json(h, 1.0);
  CHECK(j["rows"] == nlohmann::json::parse(R"(["0,5,0,400,0,0.6,3","2,0,0,50,0,0.1,0"])"));
  CHECK(admission_over_time_json(run_result{}, 1.0)["rows"].empty());
  // The window: 1 s up to 200 s, then at most 200 rows a run, whole seconds.
  CHECK(admission_bucket_s(150) == 1.0);
  CHECK(admission_bucket_s(200) == 1.0);
  CHECK(admission_bucket_s(374.9) == 2.0);
  CHECK(admission_bucket_s(35284) == 177.0);
  CHECK(admission_bucket_s(35284) * 200 >= 35284);
  // A window that is no window, named.
  for (const double bad : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    CHECK_THROWS_WITH(admission_over_time_json(h, bad),
                      Catch::Matchers::Contains("bucket_s") &&
                          Catch::Matchers::Contains("not > 0"));
    CHECK_THROWS_AS(admission_over_time_json(h, bad), moebius::error);
  }
}

TEST_CASE("admission in each flood: from its first arrival until the queue empties after its "
          "last, against a brute-force scan",
          "[cpu][demo]") {
  std::mt19937_64 rng(Catch::rngSeed() + 29);
  for (int trial = 0; trial < 20; ++trial) {
    const run_result r = random_admission_run(rng, 2 + static_cast<int64_t>(rng() % 3000));
    std::vector<arrival_period> floods;
    std::uniform_real_distribution<double> at(0, r.end_s), len(0.5, 8);
    for (int k = 0; k < 3; ++k) {
      const double a = at(rng);
      floods.push_back({a, a + len(rng)});
    }
    floods.push_back({r.end_s + 10, r.end_s + 12});  // no step starts in it
    const nlohmann::json j = flood_admission_json(r, floods);
    REQUIRE(j.size() == floods.size());
    for (size_t f = 0; f < floods.size(); ++f) {
      // The reference: the steps from the first arrival on, up to the first one past the last
      // arrival that finds the queue empty.
      std::vector<const step_record*> in;
      double to_s = floods[f].end_s;
      for (const step_record& s : r.steps) {
        if (s.start_s < floods[f].start_s) continue;
        if (s.start_s >= floods[f].end_s && s.waiting == 0) {
          to_s = std::max(to_s, s.start_s);
          break;
        }
        in.push_back(&s);
        to_s = std::max(to_s, s.start_s);
      }
      const nlohmann::json& x = j[f];
      CHECK(x["from_s"].get<double>() == floods[f].start_s);
      CHECK(x["arrivals_to_s"].get<double>() == floods[f].end_s);
      CHECK(x["to_s"].get<double>() == to_s);
      if (in.empty()) {
        CHECK(x["peak_waiting"].get<int64_t>() == 0);
        CHECK(x["peak_kv_reserved_tokens"].get<int64_t>() == 0);
        CHECK(x["new_token_ratio_at_start"].get<double>() == 0);
        CHECK(x["retractions_or_preemptions"].get<int64_t>() == 0);
        continue;
      }
      int64_t waiting = -1, running = -1, reserved = -1, retracted = 0;
      double waiting_at = 0, written_then = 0, ratio_then = 0;
      for (const step_record* s : in) {
        if (s->waiting > waiting) waiting = s->waiting, waiting_at = s->start_s;
        if (s->kv_reserved_tokens > reserved) {
          reserved = s->kv_reserved_tokens;
          written_then = static_cast<double>(s->kv_written_tokens);
          ratio_then = s->new_token_ratio;
        }
        running = std::max(running, s->running);
        retracted += s->preempted;
      }
      CHECK(x["new_token_ratio_at_start"].get<double>() == in.front()->new_token_ratio);
      CHECK(x["kv_reserved_tokens_at_start"].get<int64_t>() == in.front()->kv_reserved_tokens);
      CHECK(x["peak_waiting"].get<int64_t>() == waiting);
      CHECK(x["peak_waiting_at_s"].get<double>() == waiting_at);
      CHECK(x["peak_running"].get<int64_t>() == running);
      CHECK(x["peak_kv_reserved_tokens"].get<int64_t>() == reserved);
      CHECK(static_cast<double>(x["peak_kv_reserved_written_tokens"].get<int64_t>()) ==
            written_then);
      CHECK(x["new_token_ratio_at_peak_reserved"].get<double>() == ratio_then);
      CHECK(x["retractions_or_preemptions"].get<int64_t>() == retracted);
    }
  }
  CHECK(flood_admission_json(run_result{}, {}).empty());
}

TEST_CASE("the paper-production trace option: parsed for the simulated runtime, named, not a default",
          "[cpu][demo]") {
  const auto parse = [](std::vector<const char*> args) {
    args.insert(args.begin(), "moebius_demo");
    return parse_options(static_cast<int>(args.size()), args.data());
  };
  const options o = parse({"--runtime", "sim", "--trace", "paper-production"});
  REQUIRE(o.traces.size() == 1);
  CHECK(o.traces.front() == trace_kind::paper_production);
  CHECK(std::string(to_string(trace_kind::paper_production)) == "paper-production");
  const options both = parse({"--runtime", "sim", "--trace", "paper-steady", "--trace",
                              "paper-production"});
  CHECK(both.traces == std::vector<trace_kind>{trace_kind::paper_steady,
                                               trace_kind::paper_production});
  // Not in the simulated runtime's default set (the paper's bursty, steady and rollout).
  const options sim = parse({"--runtime", "sim"});
  CHECK(std::find(sim.traces.begin(), sim.traces.end(), trace_kind::paper_production) ==
        sim.traces.end());
  CHECK(sim.traces.size() == 3);
  // A paper-scale trace: the host runtime refuses it, naming --runtime sim.
  CHECK_THROWS_WITH(parse({"--runtime", "host", "--trace", "paper-production"}),
                    Catch::Matchers::Contains("--runtime sim"));
  CHECK(usage_text().find("paper-production") != std::string::npos);
  // --rate replaces the Little's-law rate of paper-steady and paper-production.
  CHECK(o.rate == 0);
  CHECK(parse({"--runtime", "sim", "--trace", "paper-production", "--rate", "7.9"}).rate == 7.9);
  // Drawn at paper-steady's rate rule: make_trace takes the rate it is given as the mean rate.
  const std::vector<request> at20 = make_trace(o, trace_kind::paper_production, 1024, 20);
  const std::vector<request> at40 = make_trace(o, trace_kind::paper_production, 1024, 40);
  CHECK(at40.size() > at20.size() + at20.size() / 2);
  CHECK(at20.size() == paper_production_trace(o.seed, [] {
          paper_production_options p;
          p.mean_rate = 20;
          return p;
        }()).size());
}
