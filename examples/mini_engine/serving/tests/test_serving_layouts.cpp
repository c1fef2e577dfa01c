// Configurations beyond the paper's two (configuration.hpp) served by the simulated runtime:
// their names parsed back and refused by name; step curves keyed by them, measured or priced
// from TP's (with_priced_layouts, against values worked out by hand); a static TEP-DCP2 run
// priced from its own curve; the experts-only design, whose switches move no KV byte and are
// priced as the expert weights alone; the EP <-> TP-DCP2 design, whose TP view holds what
// its EP view does; and the dcp-only design (TP-DCP2 <-> TP on static TP's footprint), whose
// switches move the KV alone, forced, refused for capacity, and under the policy.
// Last, the gate pricing the decodes SGLang's prefill-first steps hold, in a run of the paper's
// design under each preset.
#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <moebius/error.hpp>
#include <moebius/transport/dry_run_transport.hpp>

#include "catch.hpp"
#include "configuration.hpp"
#include "curves_step_clock.hpp"
#include "deployment.hpp"
#include "engine.hpp"
#include "sim_deployment.hpp"
#include "sim_runtime.hpp"
#include "step_curves.hpp"

using namespace mini_engine;
using moebius::parallel_layout;
using moebius::parallel_mode;

namespace {

std::string line(const char* mode, int64_t context, int64_t batch, double ms) {
  std::ostringstream os;
  os << "{\"model\": \"qwen3_235b\", \"P\": 8, \"layers\": 94, \"mode\": \"" << mode
     << "\", \"context\": " << context << ", \"batch\": " << batch << ", \"step_ms\": " << ms
     << "}\n";
  return os.str();
}

step_curves parse(const std::string& text) {
  std::istringstream in(text);
  return step_curves::from_jsonl(in, "layouts.jsonl");
}

// Flat curves (every batch and context the same step): TP 10 ms, EP 20 ms, TP-DCP2 9 ms,
// TEP-DCP2 7 ms, written as bench_rank_share writes the modes ("TP-dcp2", "TEP-dcp2").
std::string flat_file() {
  std::string t;
  for (const int64_t b : {1, 4096}) {
    t += line("TP", 512, b, 10);
    t += line("EP", 512, b, 20);
    t += line("TP-dcp2", 512, b, 9);
    t += line("TEP-dcp2", 512, b, 7);
  }
  return t;
}

priced_model paper_model() {
  priced_model m = qwen3_235b_a22b_priced();
  m.context_scale = 1;
  return m;
}

// The simulated runtime serving deployment `k` of the paper's model, on `clock`.
struct sim_world {
  sim_geometry geometry;
  std::unique_ptr<sim_runtime> rt;
  std::unique_ptr<moebius::dry_run_transport> transport;
  std::unique_ptr<engine> eng;
  sim_world(deployment_kind k, const step_clock& clock)
      : geometry(make_sim_geometry(make_deployment(qwen3_235b_a22b(), k))) {
    rt = std::make_unique<sim_runtime>(geometry.arena, geometry.kv, 1024);
    transport = std::make_unique<moebius::dry_run_transport>(geometry.kv.num_ranks, rt->spaces());
    eng = std::make_unique<engine>(*rt, *transport, geometry.arena, geometry.kv, clock,
                                   moebius::arena_cursor{0});
  }
};

// `n` requests at t = 0: prompts of `prompt` tokens, `output` tokens each.
std::vector<request> burst(int64_t n, int64_t prompt, int64_t output) {
  std::vector<request> t;
  for (int64_t i = 0; i < n; ++i) {
    request r;
    r.id = i;
    r.prompt.assign(static_cast<size_t>(prompt), 5);
    r.output_tokens = output;
    t.push_back(std::move(r));
  }
  return t;
}

engine_options options_of(const deployment& d) {
  engine_options o;
  o.scheduler.max_running = 256;
  o.scheduler.max_step_tokens = 8192;
  o.layouts = d.modes();
  o.start_mode = d.start_mode();
  o.validate_every_step = true;
  return o;
}

// options_of(d), switching to the other mode before each of `steps` (from `start`).
engine_options forced_options(const deployment& d, parallel_mode start,
                              std::vector<int64_t> steps) {
  engine_options o = options_of(d);
  o.start_mode = start;
  o.how = switching::forced;
  o.forced_steps = std::move(steps);
  return o;
}

// The priced expert bytes of a switch (h200_step_model::switch_s), by hand: each rank's 16 of
// 128 experts of 3 x 4096 x 1536 bf16 (603,979,776 B a layer), 7/8 of them leaving it, 94
// layers: 49,677,336,576 B at the fitted 395 GB/s = 125.7654 ms, plus 94 phases of one barrier
// (10 us) and one launch (5 us) = 1.41 ms, plus the fitted 3.9 ms a switch.
constexpr double k_weights_only_ms = 49'677'336'576.0 / 395e9 * 1e3 + 94 * 0.015 + 3.9;


// The dcp-only design's deployment, priced by flat_file()'s curves (no overlap curve).
struct dcp_only_fixture {
  h200_step_model model{paper_model(), h200_params{}, 8, 2 * 4 * 4 * 128 * 2, nullptr};
  curves_step_clock clock{parse(flat_file()), model};
  deployment d = make_deployment(qwen3_235b_a22b(), deployment_kind::dcp_only);
};

}  // namespace

TEST_CASE("configurations: names parse back, case-insensitive; errors name the text",
          "[cpu][curves]") {
  CHECK(name_of(k_tp) == "TP");
  CHECK(name_of(k_ep) == "EP");
  CHECK(name_of(k_tep) == "TEP");
  CHECK(name_of(k_tp_dcp2) == "TP-DCP2");
  CHECK(name_of(k_tep_dcp2) == "TEP-DCP2");
  for (const configuration& c : {k_tp, k_ep, k_tep, k_tp_dcp2, k_tep_dcp2})
    CHECK(parse_configuration(name_of(c)) == c);
  CHECK(parse_configuration("tep-dcp2") == k_tep_dcp2);
  CHECK(parse_configuration("TP-dcp2") == k_tp_dcp2);  // as bench_rank_share writes it
  CHECK(parse_configuration("ep") == k_ep);
  CHECK(parse_configuration("TP-DCP4") == configuration{parallel_mode::tp, 4});
  CHECK(parse_configuration("Tep") == configuration{{parallel_mode::tp, parallel_mode::ep}});
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(parse_configuration("EP-DCP2"),
                    Contains("configuration \"EP-DCP2\"") && Contains("EP attention"));
  CHECK_THROWS_WITH(parse_configuration("XP"), Contains("\"XP\": not a configuration") &&
                                                   Contains("accepted: TP, EP, TEP"));
  CHECK_THROWS_WITH(parse_configuration("TP-DCP"), Contains("positive integer"));
  CHECK_THROWS_WITH(parse_configuration("TP-DCPx"), Contains("positive integer"));
  CHECK_THROWS_WITH(parse_configuration("TP-DCP0"), Contains("positive integer"));
  CHECK_THROWS_WITH(parse_configuration(""), Contains("not a configuration"));
  // Data-parallel attention with TP experts has no name: printable, never parsed.
  const configuration dpa{{parallel_mode::ep, parallel_mode::tp}};
  CHECK_FALSE(is_named(dpa));
  CHECK(name_of(dpa) == "DP attention, TP experts");
  // A step's configuration: dcp under TP attention only.
  CHECK(configuration_of(parallel_mode::ep, 2) == k_ep);
  CHECK(configuration_of(parallel_layout{parallel_mode::tp, parallel_mode::ep}, 2) == k_tep_dcp2);
  const mode_layouts x{{parallel_mode::tp, parallel_mode::ep}, parallel_mode::tp};
  CHECK(x.mode_of(parallel_layout{parallel_mode::tp, parallel_mode::ep}, 1) == parallel_mode::ep);
  CHECK(x.mode_of(parallel_mode::tp, 1) == parallel_mode::tp);
  CHECK(x.mode_of(parallel_mode::ep, 1) == parallel_mode::ep);  // not in the map: its experts'
}

TEST_CASE("step curves keyed by configuration: every key read back, a missing one an error",
          "[cpu][curves]") {
  const step_curves c = parse(flat_file());
  CHECK(c.step_ms(k_tp, 64, 512) == Approx(10));
  CHECK(c.step_ms(k_ep, 64, 512) == Approx(20));
  CHECK(c.step_ms(k_tp_dcp2, 64, 8192) == Approx(9));
  CHECK(c.step_ms(k_tep_dcp2, 1, 512) == Approx(7));
  CHECK_FALSE(c.priced(k_tep_dcp2));
  CHECK(c.source_of(k_tep_dcp2) == c.deployment());
  const std::vector<configuration> all = c.configurations();
  REQUIRE(all.size() == 4);
  CHECK(all[0] == k_tp);  // TP and EP first, then by name
  CHECK(all[1] == k_ep);
  CHECK(all[2] == k_tep_dcp2);
  CHECK(all[3] == k_tp_dcp2);
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(c.step_ms(k_tep, 1, 512),
                    Contains("no curve of TEP") && Contains("curves of TP, EP, TEP-DCP2, TP-DCP2"));
  // A key twice (any case), a bad key, a configuration without TP or EP: errors naming them.
  auto error_of = [](const std::string& text) -> std::string {
    try {
      parse(text);
    } catch (const moebius::error& e) {
      return e.what();
    }
    return "";
  };
  CHECK_THAT(error_of(flat_file() + line("tp-DCP2", 512, 1, 3)),
             Contains("TP-DCP2 context 512 batch 1 twice"));
  CHECK_THAT(error_of(flat_file() + line("ep-dcp2", 512, 2, 3)),
             Contains("line 9 of layouts.jsonl") && Contains("configuration \"ep-dcp2\""));
  CHECK_THAT(error_of(line("TP", 512, 1, 3) + line("TEP-DCP2", 512, 1, 3)),
             Contains("no EP point"));
  // Repriced collectives: TP attention with dcp has DCP's three collectives a layer more.
  const step_curves slow = c.with_collective_latency(20, 10);
  CHECK(slow.step_ms(k_tp, 1, 512) == Approx(10 + 2 * 94 * 0.010));
  CHECK(slow.step_ms(k_tp_dcp2, 1, 512) == Approx(9 + 5 * 94 * 0.010));
  CHECK(slow.step_ms(k_tep_dcp2, 1, 512) == Approx(7 + 5 * 94 * 0.010));
  CHECK(slow.step_ms(k_ep, 1, 512) == Approx(20));
}

TEST_CASE("the priced fallback: TP-DCP2 and TEP-DCP2 from TP's curve, by hand", "[cpu][curves]") {
  // TP: 10 ms at batch 1 and 14 at 4 (context 512); 20 and 28 at 1536. EP: 12 flat.
  const step_curves measured = parse(line("TP", 512, 1, 10) + line("TP", 512, 4, 14) +
                                     line("TP", 1536, 1, 20) + line("TP", 1536, 4, 28) +
                                     line("EP", 512, 1, 12));
  const h200_step_model model(paper_model(), h200_params{}, 8, 2 * 94 * 4 * 128 * 2, nullptr);
  const configuration wanted[] = {k_tp_dcp2, k_tep_dcp2, k_tep};
  const step_curves c = with_priced_layouts(measured, model, wanted);
  CHECK(c.priced(k_tp_dcp2));
  CHECK(c.priced(k_tep_dcp2));
  CHECK_FALSE(c.priced(k_tp));
  CHECK_THAT(c.source_of(k_tp_dcp2), Catch::Matchers::Contains("priced from TP's curve"));
  // DCP's exchange a layer at batch 1, hq = 64/8 = 8, D = 128, d = 2: a q all-gather of
  // 1 x 8 x 128 x 2 = 2,048 B, an LSE all-gather of 2 x 8 x 4 = 64 B, a reduce-scatter of
  // 2,048 B: 4,160 B at 389 GB/s = 0.0107 us, plus 3 x 10 us; 94 layers: 2.82101 ms.
  const double x1 = 94 * (30e-3 + 4160 / 389e9 * 1e3);
  CHECK(model.dcp_exchange_s(1, 2) * 94e3 == Approx(x1));
  CHECK(model.dcp_exchange_s(64, 1) == 0);
  // TP-DCP2 at context 1024 is TP at 512 (10 ms), at 3072 TP at 1536 (20), at 2048 TP at
  // 1024 (15, halfway), each plus the exchange.
  CHECK(c.step_ms(k_tp_dcp2, 1, 1024) == Approx(10 + x1));
  CHECK(c.step_ms(k_tp_dcp2, 1, 3072) == Approx(20 + x1));
  CHECK(c.step_ms(k_tp_dcp2, 1, 2048) == Approx(15 + x1));
  CHECK(c.step_ms(k_tp_dcp2, 1, 300) == Approx(10 + x1));  // below: the smallest context
  // EP's expert term instead of TP's at batch 1 (top-8 of 128, experts of 3 x 4096 x 1536 x
  // 2 B = 37,748,736 B, 94 layers, 4 TB/s): TP reads the 8 touched experts' 1/8 slices,
  // 94 x 8 x 37,748,736 / 8 B = 0.887096 ms; EP the busiest rank's whole experts, mean
  // m = 16 x 8/128 = 1, m + sqrt(m) = 2: 94 x 2 x 37,748,736 B = 1.774193 ms; +0.887096 ms.
  const double expert_bytes = 3.0 * 4096 * 1536 * 2;
  const double tp1 = 94 * 8 * expert_bytes / 8 / 4e12 * 1e3;
  const double ep1 = 94 * 2 * expert_bytes / 4e12 * 1e3;
  CHECK(ep1 - tp1 == Approx(0.887096).epsilon(1e-5));
  CHECK(c.step_ms(k_tep_dcp2, 1, 1024) == Approx(10 + x1 + ep1 - tp1));
  CHECK(c.step_ms(k_tep, 1, 512) == Approx(10 + ep1 - tp1));  // no dcp: no exchange
  // At batch 4096 every expert is touched in both: the same bytes (the roofline's TEP term is
  // TP's); the exchange grows with the tokens.
  CHECK(model.experts_s(parallel_mode::ep, 4096) == Approx(model.experts_s(parallel_mode::tp, 4096)));
  // Measured curves are never replaced; EP attention cannot be priced from TP's.
  const step_curves both = parse(flat_file());
  CHECK_FALSE(with_priced_layouts(both, model, wanted).priced(k_tp_dcp2));
  CHECK(with_priced_layouts(both, model, wanted).step_ms(k_tp_dcp2, 1, 512) == Approx(9));
  const configuration ep_only[] = {configuration{{parallel_mode::ep, parallel_mode::tp}}};
  CHECK_THROWS_WITH(with_priced_layouts(measured, model, ep_only),
                    Catch::Matchers::Contains("cannot be priced from TP's curve"));
  // The roofline clock prices the same configurations (a TEP step is TP's with EP's experts).
  step_cost s;
  s.set(k_tep_dcp2);
  s.num_ranks = 8;
  s.num_sequences = s.new_tokens = 1;
  s.context_tokens = 1024;
  step_cost t = s;
  t.set(k_tp);
  t.context_tokens = 512;
  CHECK(model.step_s(s, 0) - model.step_s(t, 0) ==
        Approx((ep1 - tp1 + x1) * 1e-3).epsilon(1e-9));
}

TEST_CASE("a static TEP-DCP2 run: every step priced from the TEP-DCP2 curve", "[cpu][layouts]") {
  const h200_step_model model(paper_model(), h200_params{}, 8, 2 * 4 * 4 * 128 * 2, nullptr);
  const curves_step_clock clock(parse(flat_file()), model);
  const deployment d = make_deployment(qwen3_235b_a22b(), deployment_kind::static_tep_dcp2);
  sim_world w(deployment_kind::static_tep_dcp2, clock);
  CHECK(w.geometry.kv.dcp == 2);
  const run_result r = w.eng->run(burst(48, 300, 12), options_of(d), "static TEP-DCP2");
  REQUIRE(!r.steps.empty());
  CHECK(r.switches.empty());
  for (const step_record& s : r.steps) {
    CHECK(s.config == k_tep_dcp2);
    CHECK(s.mode == parallel_mode::ep);  // the large-batch layout
    CHECK(s.step_ms == Approx(7));       // flat: prefill rows add nothing
  }
  CHECK(w.eng->get_switcher().layout() == parallel_layout{parallel_mode::tp, parallel_mode::ep});
  // The same trace on static TP-DCP2's deployment: its own curve.
  const deployment d2 = make_deployment(qwen3_235b_a22b(), deployment_kind::static_tp_dcp2);
  sim_world w2(deployment_kind::static_tp_dcp2, clock);
  const run_result r2 = w2.eng->run(burst(48, 300, 12), options_of(d2), "static TP-DCP2");
  for (const step_record& s : r2.steps) CHECK(s.step_ms == Approx(9));
  CHECK(r2.steps.size() == r.steps.size());
}

TEST_CASE("experts only: switches move no KV byte and are priced as the expert weights alone",
          "[cpu][layouts]") {
  const h200_step_model model(paper_model(), h200_params{}, 8, 2 * 4 * 4 * 128 * 2, nullptr);
  const curves_step_clock clock(parse(flat_file()), model);
  const deployment d = make_deployment(qwen3_235b_a22b(), deployment_kind::experts_only);
  sim_world w(deployment_kind::experts_only, clock);
  const engine_options o = forced_options(d, parallel_mode::tp, {3, 6});
  const run_result r = w.eng->run(burst(48, 300, 12), o, "experts only");
  REQUIRE(r.switches.size() == 2);
  const parallel_layout tep{parallel_mode::tp, parallel_mode::ep};
  CHECK(r.switches[0].from == parallel_layout{parallel_mode::tp});
  CHECK(r.switches[0].to == tep);
  CHECK(r.switches[1].from == tep);
  CHECK(r.switches[1].to == parallel_layout{parallel_mode::tp});
  for (const switch_record& s : r.switches) {
    CHECK(s.outcome == moebius::switch_outcome::committed);
    CHECK(s.running > 0);  // live KV that stayed where it was
    CHECK(s.clock_ms == Approx(k_weights_only_ms).epsilon(1e-9));
  }
  const moebius::switch_report& last = w.eng->get_switcher().last_report();
  CHECK(last.kv_rounds == 0);
  for (const int64_t b : last.kv_bytes_sent) CHECK(b == 0);
  // Steps 0-2 in TP-DCP2 (9 ms), 3-5 in TEP-DCP2 (7 ms), then TP-DCP2; TP attention throughout.
  REQUIRE(r.steps.size() > 6);
  for (const step_record& s : r.steps) {
    const bool tep_step = s.step >= 3 && s.step < 6;
    CHECK(s.config == (tep_step ? k_tep_dcp2 : k_tp_dcp2));
    CHECK(s.mode == (tep_step ? parallel_mode::ep : parallel_mode::tp));
    CHECK(s.step_ms == Approx(tep_step ? 7 : 9));
  }
  // The paper's design switching at the same step moves the live KV too: priced above.
  const deployment a = make_deployment(qwen3_235b_a22b(), deployment_kind::switching);
  sim_world wa(deployment_kind::switching, clock);
  const engine_options oa = forced_options(a, parallel_mode::tp, {3});
  const run_result ra = wa.eng->run(burst(48, 300, 12), oa, "paper design");
  REQUIRE(ra.switches.size() == 1);
  CHECK(ra.switches[0].outcome == moebius::switch_outcome::committed);
  CHECK(wa.eng->get_switcher().last_report().kv_rounds > 0);
  CHECK(ra.switches[0].clock_ms > k_weights_only_ms + 0.1);  // + the live KV, priced
}

TEST_CASE("experts only, progressive: the steps keep TP-DCP2 attention and move the experts alone",
          "[cpu][layouts]") {
  const h200_step_model model(paper_model(), h200_params{}, 8, 2 * 4 * 4 * 128 * 2);
  const curves_step_clock clock(parse(flat_file()), model);
  const deployment d = make_deployment(qwen3_235b_a22b(), deployment_kind::experts_only);
  sim_world w(deployment_kind::experts_only, clock);
  engine_options o = forced_options(d, parallel_mode::tp, {3});
  o.style = switch_style::progressive;
  const run_result r = w.eng->run(burst(48, 300, 40), o, "experts only, progressive");
  REQUIRE(r.switches.size() == 1);
  CHECK(r.switches[0].outcome == moebius::switch_outcome::committed);
  CHECK(r.switches[0].progressive);
  CHECK(w.eng->get_switcher().last_report().kv_rounds == 0);
  int64_t during = 0;
  for (const step_record& s : r.steps) {
    CHECK(s.config.attention() == parallel_mode::tp);
    CHECK(s.config.dcp == 2);
    during += s.in_switch;
    // A step during the switch is priced as the layout of most of its layers.
    if (s.in_switch)
      CHECK(s.config == (s.cursor * 2 >= w.geometry.arena.shape.num_layers ? k_tp_dcp2 : k_tep_dcp2));
  }
  CHECK(during > 0);
  CHECK(r.steps.back().config == k_tep_dcp2);
}

TEST_CASE("EP <-> TP-DCP2: the TP view holds the EP view's tokens; a switch moves the KV",
          "[cpu][layouts]") {
  const h200_step_model model(paper_model(), h200_params{}, 8, 2 * 4 * 4 * 128 * 2, nullptr);
  const curves_step_clock clock(parse(flat_file()), model);
  const deployment d = make_deployment(qwen3_235b_a22b(), deployment_kind::switching_dcp2);
  sim_world w(deployment_kind::switching_dcp2, clock);
  // 17,781 EP pages of 16 tokens a rank (2,275,968 / 8 / 16); TP view: 4 x as many pages of
  // one head, each token on one of two ranks: 71,124 x 16 x 2 = 2,275,968.
  CHECK(w.geometry.kv.num_ep_pages == 17'781);
  CHECK(w.geometry.kv.max_tokens(parallel_mode::tp) == 2'275'968);
  CHECK(w.geometry.kv.max_tokens(parallel_mode::ep) == 2'275'968);
  // The paper's design on the same footprint: half of it in TP.
  const sim_geometry a = make_sim_geometry(make_deployment(qwen3_235b_a22b(), deployment_kind::switching));
  CHECK(a.kv.num_ep_pages == 17'781);
  CHECK(a.kv.max_tokens(parallel_mode::tp) == 1'137'984);
  const engine_options o = forced_options(d, d.start_mode(), {3});
  const run_result r = w.eng->run(burst(48, 300, 12), o, "EP <-> TP-DCP2");
  REQUIRE(r.switches.size() == 1);
  CHECK(r.switches[0].outcome == moebius::switch_outcome::committed);
  CHECK(r.switches[0].to == parallel_layout{parallel_mode::tp});
  CHECK(w.eng->get_switcher().last_report().kv_rounds > 0);
  CHECK(r.switches[0].clock_ms > k_weights_only_ms);
  for (const step_record& s : r.steps) {
    CHECK(s.config == (s.step < 3 ? k_ep : k_tp_dcp2));
    CHECK(s.step_ms == Approx(s.step < 3 ? 20 : 9));
  }
}

TEST_CASE("dcp only: its modes name TP at dcp 2 and at dcp 1, the same layout", "[cpu][layouts]") {
  const deployment d = make_deployment(qwen3_235b_a22b(), deployment_kind::dcp_only);
  const mode_layouts m = d.modes();
  CHECK(m.ep == parallel_layout{parallel_mode::tp});
  CHECK(m.tp == parallel_layout{parallel_mode::tp});
  CHECK(m.differ_in_dcp_alone());
  CHECK(m.dcp_of(parallel_mode::ep, 1) == 2);
  CHECK(m.dcp_of(parallel_mode::tp, 2) == 1);
  CHECK(m.mode_of(parallel_mode::tp, 2) == parallel_mode::ep);
  CHECK(m.mode_of(parallel_mode::tp, 1) == parallel_mode::tp);
  // Every other design serves at its KV's dcp, whatever it is.
  for (const deployment_kind k : {deployment_kind::switching, deployment_kind::switching_dcp2,
                                  deployment_kind::experts_only, deployment_kind::static_tp_dcp2}) {
    const mode_layouts o = make_deployment(qwen3_235b_a22b(), k).modes();
    CHECK_FALSE(o.differ_in_dcp_alone());
    for (const int64_t dcp : {1, 2}) {
      CHECK(o.dcp_of(parallel_mode::ep, dcp) == dcp);
      CHECK(o.dcp_of(parallel_mode::tp, dcp) == dcp);
    }
  }
  // Static TP's footprint: its weights, and at each dcp the tokens of the static configuration.
  const deployment tp = make_deployment(qwen3_235b_a22b(), deployment_kind::static_tp);
  const deployment tp2 = make_deployment(qwen3_235b_a22b(), deployment_kind::static_tp_dcp2);
  CHECK(d.tp.weight_bytes == tp.tp.weight_bytes);
  CHECK(d.ep.weight_bytes == tp.tp.weight_bytes);
  CHECK(d.tp.tokens == tp.tp.tokens);
  CHECK(d.ep.tokens == tp2.tp.tokens);
  const sim_geometry g = make_sim_geometry(d);
  CHECK(g.kv.dcp == 2);
  CHECK(g.kv.max_tokens(parallel_mode::tp) ==
        make_sim_geometry(tp2).kv.max_tokens(parallel_mode::tp));
  CHECK(moebius::with_dcp(g.kv, 1).max_tokens(parallel_mode::tp) ==
        make_sim_geometry(tp).kv.max_tokens(parallel_mode::tp));
}

TEST_CASE_METHOD(
    dcp_only_fixture,
    "dcp only: a switch moves the KV alone (dcp 2 -> 1 copies each live page once, back "
    "moves nothing), priced without expert bytes",
    "[cpu][layouts]") {
  sim_world w(deployment_kind::dcp_only, clock);
  // validate_every_step: the tables checked against the engine's geometry at its dcp after
  // every step, so a geometry that did not follow the switch fails here.
  const engine_options o = forced_options(d, parallel_mode::ep, {3, 6});
  const run_result r = w.eng->run(burst(48, 300, 12), o, "dcp only");
  REQUIRE(r.switches.size() == 2);
  for (const switch_record& s : r.switches) {
    CHECK(s.outcome == moebius::switch_outcome::committed);
    CHECK(s.from == parallel_layout{parallel_mode::tp});
    CHECK(s.to == parallel_layout{parallel_mode::tp});
    CHECK(s.running > 0);
    CHECK(s.clock_ms < k_weights_only_ms / 10);  // no priced expert byte
  }
  CHECK(r.switches[0].from_dcp == 2);
  CHECK(r.switches[0].to_dcp == 1);
  CHECK(r.switches[1].from_dcp == 1);
  CHECK(r.switches[1].to_dcp == 2);
  // dcp 2 -> 1 copied the other share of every live page; 1 -> 2 dropped it: nothing moved,
  // so its price is the cost model's with no byte and no round.
  CHECK(r.switches[0].clock_ms > r.switches[1].clock_ms);
  const moebius::switch_report& last = w.eng->get_switcher().last_report();
  CHECK(last.kv_rounds == 0);
  for (const int64_t b : last.kv_bytes_sent) CHECK(b == 0);
  moebius::layer_bytes none;
  none.kv_bytes_sent.assign(8, 0);
  none.weight_bytes_sent.assign(8, 0);
  CHECK(r.switches[1].clock_ms == Approx(model.predicted_kv_switch_s(none, 4) * 1e3));
  CHECK(model.predicted_kv_switch_s(none, 4) < model.predicted_switch_s(none, 4) / 10);
  // Steps 0-2 in TP-DCP2 (9 ms), 3-5 in TP (10 ms), then TP-DCP2 again.
  REQUIRE(r.steps.size() > 6);
  for (const step_record& s : r.steps) {
    const bool tp_step = s.step >= 3 && s.step < 6;
    CHECK(s.config == (tp_step ? k_tp : k_tp_dcp2));
    CHECK(s.mode == (tp_step ? parallel_mode::tp : parallel_mode::ep));
    CHECK(s.step_ms == Approx(tp_step ? 10 : 9));
  }
  // Every request served whole, as a static TP-DCP2 run serves it.
  sim_world w2(deployment_kind::static_tp_dcp2, clock);
  const deployment d2 = make_deployment(qwen3_235b_a22b(), deployment_kind::static_tp_dcp2);
  const run_result r2 = w2.eng->run(burst(48, 300, 12), options_of(d2), "static TP-DCP2");
  REQUIRE(r.requests.size() == r2.requests.size());
  for (size_t i = 0; i < r.requests.size(); ++i) {
    CHECK(r.requests[i].error.empty());
    CHECK(r.requests[i].generated == r2.requests[i].generated);
    CHECK(static_cast<int64_t>(r.requests[i].generated.size()) == 12);
  }
  CHECK(w.eng->get_switcher().dcp() == 2);
}

TEST_CASE_METHOD(
    dcp_only_fixture,
    "dcp only: a switch to dcp 1 that the running sequences do not fit is refused, and "
    "the run serves on at dcp 2",
    "[cpu][layouts]") {
  sim_world w(deployment_kind::dcp_only, clock);
  const int64_t tp_tokens = moebius::with_dcp(w.geometry.kv, 1).max_tokens(parallel_mode::tp);
  // 96 sequences of 1/64 of dcp 1's pool each: 1.5x what dcp 1 holds, 0.75x dcp 2.
  const int64_t prompt = tp_tokens / 64;
  engine_options o = forced_options(d, parallel_mode::ep, {});
  o.scheduler.max_running = 96;
  o.validate_every_step = false;  // 96 x 22k tokens: checked once at the end by run()
  // After every prompt is in (none has finished its 400 tokens by then).
  const int64_t prefill_steps = (96 * prompt + 8191) / 8192 + 1;
  o.forced_steps = {prefill_steps + 2};
  const run_result r = w.eng->run(burst(96, prompt, 400), o, "dcp only, refused");
  REQUIRE(r.switches.size() == 1);
  CHECK(r.switches[0].outcome == moebius::switch_outcome::refused_capacity);
  CHECK(r.switches[0].to_dcp == 1);
  CHECK_THAT(r.switches[0].error, Catch::Matchers::Contains("do not fit TP ("));
  for (const request_result& q : r.requests) CHECK(q.error.empty());
  for (const step_record& s : r.steps) CHECK(s.config == k_tp_dcp2);
  CHECK(w.eng->get_switcher().dcp() == 2);
}

TEST_CASE_METHOD(
    dcp_only_fixture,
    "dcp only under the policy: at dcp 1 while the KV fits its pool, at dcp 2 before it "
    "would not",
    "[cpu][layouts]") {
  engine_options o = options_of(d);
  o.how = switching::policy;
  o.policy = moebius::interactive_config(o.scheduler.max_running + 1);  // read by no rule
  o.gate.enabled = false;
  o.start_mode = parallel_mode::ep;  // dcp 2
  o.validate_every_step = false;

  SECTION("a small load at dcp 2 moves to dcp 1 at once, its live KV copied") {
    sim_world w(deployment_kind::dcp_only, clock);
    o.validate_every_step = true;
    std::vector<request> t = burst(64, 200, 10);
    for (size_t i = 0; i < t.size(); ++i) t[i].output_tokens = 10 + 3 * static_cast<int64_t>(i);
    const run_result r = w.eng->run(t, o, "dcp only, small load");
    REQUIRE(r.switches.size() == 1);
    const switch_record& s = r.switches.front();
    CHECK(s.outcome == moebius::switch_outcome::committed);
    CHECK(s.from_dcp == 2);
    CHECK(s.to_dcp == 1);
    CHECK(s.running == 64);
    CHECK(r.steps.back().config == k_tp);
    for (const request_result& q : r.requests) CHECK(q.error.empty());
  }
  SECTION("prompts that would outgrow dcp 1's pool move it to dcp 2 before any preemption; "
          "back at dcp 1 once the few left fit") {
    sim_world w(deployment_kind::dcp_only, clock);
    o.start_mode = parallel_mode::tp;  // dcp 1
    const int64_t tp_tokens = moebius::with_dcp(w.geometry.kv, 1).max_tokens(parallel_mode::tp);
    const int64_t prompt = tp_tokens / 64;  // 96 of them: 1.5x dcp 1's pool
    o.scheduler.max_running = 96;
    std::vector<request> t = burst(96, prompt, 400);
    for (size_t i = 0; i < t.size(); ++i) t[i].output_tokens = 100 + 10 * static_cast<int64_t>(i);
    const run_result r = w.eng->run(t, o, "dcp only, large load");
    REQUIRE(r.switches.size() == 2);
    CHECK(r.switches[0].outcome == moebius::switch_outcome::committed);
    CHECK(r.switches[0].from_dcp == 1);
    CHECK(r.switches[0].to_dcp == 2);
    // At dcp 1 while the admitted prompts fit it; to dcp 2 once the pool keeps the rest out
    // (the waiting then count as KV to come), before any preemption.
    CAPTURE(r.switches[0].step, r.switches[0].running, prompt, tp_tokens);
    CHECK(r.switches[0].step > 1);
    CHECK(r.switches[0].running * prompt >= tp_tokens / 2);
    CHECK(r.switches[0].running * prompt <= tp_tokens);
    CHECK(r.switches[1].outcome == moebius::switch_outcome::committed);
    CHECK(r.switches[1].to_dcp == 1);
    // The few left: their prompts within 80% of dcp 1's pool, and each at its largest (prompt
    // + output) within the pool (no preemption after).
    CHECK(static_cast<double>(r.switches[1].running * prompt) <=
          0.8 * static_cast<double>(tp_tokens));
    CHECK(r.switches[1].running * (prompt + 1050) <= tp_tokens);
    CHECK(r.preemptions == 0);
    for (const request_result& q : r.requests) CHECK(q.error.empty());
    CHECK(r.steps.back().config == k_tp);
  }
  SECTION("with the throughput gate on, the same prompts move it to dcp 2 before any "
          "preemption: nothing has completed, so the live set grows (dcp_capacity.hpp)") {
    sim_world w(deployment_kind::dcp_only, clock);
    o.start_mode = parallel_mode::tp;  // dcp 1
    o.gate.enabled = true;
    const int64_t tp_tokens = moebius::with_dcp(w.geometry.kv, 1).max_tokens(parallel_mode::tp);
    const int64_t prompt = tp_tokens / 64;
    o.scheduler.max_running = 96;
    std::vector<request> t = burst(96, prompt, 400);
    for (size_t i = 0; i < t.size(); ++i) t[i].output_tokens = 100 + 10 * static_cast<int64_t>(i);
    const run_result r = w.eng->run(t, o, "dcp only, large load, gated");
    REQUIRE_FALSE(r.switches.empty());
    CHECK(r.switches[0].outcome == moebius::switch_outcome::committed);
    CHECK(r.switches[0].to_dcp == 2);
    CHECK(r.switches[0].running * prompt <= tp_tokens);
    CHECK(r.preemptions == 0);
    for (const request_result& q : r.requests) CHECK(q.error.empty());
  }
  SECTION("a queue the step's token budget holds, not the pool, is no KV to come: dcp 1 "
          "throughout") {
    sim_world w(deployment_kind::dcp_only, clock);
    o.start_mode = parallel_mode::tp;  // dcp 1
    const int64_t tp_tokens = moebius::with_dcp(w.geometry.kv, 1).max_tokens(parallel_mode::tp);
    // 400 prompts of 1/200 of dcp 1's pool at once, twice what it holds, each a whole step of
    // the 8,192-token budget: about one admitted a step, each done 10 steps later, so about
    // ten live at a time (5% of the pool).
    const int64_t prompt = std::min<int64_t>(tp_tokens / 200, 8192);
    REQUIRE(400 * prompt > tp_tokens);
    const run_result r = w.eng->run(burst(400, prompt, 10), o, "dcp only, budget-bound queue");
    CHECK(r.switches.empty());
    CHECK(r.preemptions == 0);
    for (const request_result& q : r.requests) CHECK(q.error.empty());
    for (const step_record& st : r.steps) CHECK(st.config == k_tp);
  }
  // The clients' limits (max_new_tokens) cap what a sequence is expected to still need: back
  // at dcp 1 sooner, never preempting.
  SECTION("max_new_tokens known: back at dcp 1 sooner") {
    const int64_t tp_tokens =
        moebius::with_dcp(make_sim_geometry(d).kv, 1).max_tokens(parallel_mode::tp);
    o.start_mode = parallel_mode::tp;
    o.scheduler.max_running = 96;
    // Outputs of 1,000-5,750 tokens beside prompts of 1/80 of dcp 1's pool: the survivors'
    // remaining output, not their prompts, decides when they fit dcp 1 again.
    std::vector<request> t = burst(96, tp_tokens / 80, 1000);
    for (size_t i = 0; i < t.size(); ++i) t[i].output_tokens = 1000 + 50 * static_cast<int64_t>(i);
    sim_world w1(deployment_kind::dcp_only, clock);
    const run_result unknown = w1.eng->run(t, o, "limits unknown");
    for (request& q : t) q.max_new_tokens = q.output_tokens;
    sim_world w2(deployment_kind::dcp_only, clock);
    const run_result known = w2.eng->run(t, o, "limits known");
    REQUIRE(unknown.switches.size() == 2);
    REQUIRE(known.switches.size() == 2);
    CHECK(known.switches[0].step == unknown.switches[0].step);
    INFO("unknown " << unknown.switches[1].step << " running " << unknown.switches[1].running
         << ", known " << known.switches[1].step << " running " << known.switches[1].running);
    CHECK(known.switches[1].step < unknown.switches[1].step);
    CHECK(known.preemptions == 0);
    CHECK(unknown.preemptions == 0);
  }
}

TEST_CASE_METHOD(
    dcp_only_fixture,
    "dcp only: the gate weighs a move to dcp 1 at the KV's copy alone, and a refused one is "
    "not planned again within the cooldown",
    "[cpu][layouts]") {
  engine_options o = options_of(d);
  o.how = switching::policy;
  o.policy = moebius::rollout_config(o.scheduler.max_running + 1, 8);
  o.start_mode = parallel_mode::ep;  // dcp 2
  o.explain = true;
  o.gate.enabled = true;  // the throughput gate, the residency from the known work below
  o.gate.correct_curves = false;
  std::vector<request> t = burst(32, 200, 60);
  for (request& q : t) q.rollout_step = 0;  // one rollout step: its survivors' work is known
  auto flat = [](double ms) {
    const std::vector<moebius::latency_sample> points{{1, ms}, {4096, ms}};
    return moebius::latency_curve::fit(points, moebius::curve_fit::piecewise_linear);
  };
  SECTION("dcp 1 priced faster: the move pays for its copy") {
    sim_world w(deployment_kind::dcp_only, clock);
    o.gate.curves = moebius::latency_curves{flat(9), flat(5)};  // ep (dcp 2), tp (dcp 1)
    const run_result r = w.eng->run(t, o, "gate passes");
    REQUIRE(r.switches.size() == 1);
    CHECK(r.switches[0].to_dcp == 1);
    CHECK(r.switches[0].gate.evaluated);
    CHECK(r.switches[0].gate.passed);
    // Priced as the KV alone: far under a switch that moves the experts.
    CHECK(r.switches[0].gate.cost_ms < k_weights_only_ms / 10);
  }
  SECTION("dcp 1 priced slower: refused, planned again once every cooldown of 8 steps") {
    sim_world w(deployment_kind::dcp_only, clock);
    o.gate.curves = moebius::latency_curves{flat(5), flat(9)};
    const run_result r = w.eng->run(t, o, "gate refuses");
    CHECK(r.switches.empty());
    REQUIRE(r.gate_refusals > 0);
    const int64_t steps = static_cast<int64_t>(r.steps.size());
    CHECK(r.gate_refusals <= steps / 8 + 1);
    for (const decision_record& x : r.decisions)
      CHECK(x.decision.reason == moebius::decision_reason::cost_exceeds_gain);
    for (size_t i = 1; i < r.decisions.size(); ++i)
      CHECK(r.decisions[i].step - r.decisions[i - 1].step >= 8);
  }
}

TEST_CASE_METHOD(dcp_only_fixture,
                 "dcp only: progressive and by-cost styles change the dcp stop-the-world; a run of "
                 "another design after it serves at the KV geometry's dcp",
                 "[cpu][layouts]") {
  sim_world w(deployment_kind::dcp_only, clock);
  for (const switch_style style : {switch_style::progressive, switch_style::by_cost}) {
    engine_options o = forced_options(d, parallel_mode::ep, {3});
    o.style = style;
    const run_result r = w.eng->run(burst(48, 300, 12), o, "dcp only, other styles");
    REQUIRE(r.switches.size() == 1);
    CHECK(r.switches[0].outcome == moebius::switch_outcome::committed);
    CHECK_FALSE(r.switches[0].progressive);
    CHECK(r.switches[0].to_dcp == 1);
    CHECK(r.steps.back().config == k_tp);
  }
  CHECK(w.eng->get_switcher().dcp() == 1);
  // Static TP-DCP2's options (no dcp of their own) on the same engine: back at the geometry's 2.
  const deployment s = make_deployment(qwen3_235b_a22b(), deployment_kind::static_tp_dcp2);
  const run_result r = w.eng->run(burst(48, 300, 12), options_of(s), "static TP-DCP2 after");
  for (const step_record& x : r.steps) CHECK(x.config == k_tp_dcp2);
  // A dcp named for one mode alone is refused by name.
  engine_options bad = options_of(d);
  bad.layouts.tp_dcp = 0;
  CHECK_THROWS_WITH(w.eng->run(burst(4, 30, 2), bad, "bad"),
                    Catch::Matchers::Contains("names a dcp per mode (ep_dcp 2, tp_dcp 0)"));
}

TEST_CASE(
    "the gate prices the decodes SGLang's prefills hold: a trickle of arrivals sends the "
    "paper's design to EP under SGLang, not under vLLM or SGLang with mixed chunks",
    "[cpu][layouts]") {
  // Flat curves: TP 10 ms a step, EP 20 (twice as slow). A request every 5 ms (prompt 300,
  // 40 tokens): under SGLang's prefill-first steps nearly every TP step is a prefill that holds
  // every decode, so a TP decode token costs several of its 10 ms steps; EP's 8 schedulers
  // each see an eighth of the arrivals and hold far less (prefill_stalls.hpp). vLLM and mixed
  // chunks carry the decodes in the prefill's step: TP stays the faster, and no switch pays.
  h200_step_model model{paper_model(), h200_params{}, 8, 2 * 4 * 4 * 128 * 2, nullptr};
  const curves_step_clock clock{parse(flat_file()), model};
  const deployment d = make_deployment(qwen3_235b_a22b(), deployment_kind::switching);
  std::vector<request> t = burst(600, 300, 40);
  for (size_t i = 0; i < t.size(); ++i) t[i].arrival_s = 0.005 * static_cast<double>(i);
  auto run = [&](engine_preset preset, bool mixed) {
    engine_options o = options_of(d);
    o.validate_every_step = false;
    o.scheduler.admission = admission_policy::known;
    o.scheduler.engine = preset;
    o.scheduler.sglang.enable_mixed_chunk = mixed;
    o.start_mode = parallel_mode::tp;
    o.how = switching::policy;
    o.policy = moebius::rollout_config(16, 8);
    o.gate.enabled = true;
    sim_world w(deployment_kind::switching, clock);
    return w.eng->run(t, o, to_string(preset));
  };
  const run_result sglang = run(engine_preset::sglang, false);
  INFO("sglang: " << sglang.switches.size() << " switches, correction " << sglang.correction);
  REQUIRE_FALSE(sglang.switches.empty());
  CHECK(sglang.switches[0].to.experts == parallel_mode::ep);
  CHECK(sglang.switches[0].gate.evaluated);
  CHECK(sglang.switches[0].gate.passed);
  int64_t held = 0;
  for (const step_record& s : sglang.steps) held += s.decodes_held;
  CHECK(held > 0);
  for (const bool mixed : {false, true}) {
    const run_result r = run(mixed ? engine_preset::sglang : engine_preset::vllm, mixed);
    INFO((mixed ? "sglang, mixed chunks" : "vllm") << ": correction " << r.correction);
    CHECK(r.switches.empty());
    CHECK(r.gate_refusals > 0);
    for (const step_record& s : r.steps) CHECK(s.decodes_held == 0);
  }
}
