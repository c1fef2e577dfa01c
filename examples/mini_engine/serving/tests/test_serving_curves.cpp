// Measured per-rank step curves (step_curves.hpp): the bench's JSON lines read back, the
// interpolation against values worked out by hand, every malformed input a clear error, and the
// priced clock that takes decode steps from the curves and everything else from the H200 model.
#include <cmath>
#include <random>
#include <sstream>
#include <string>

#include <moebius/error.hpp>

#include "catch.hpp"
#include "curves_step_clock.hpp"
#include "step_curves.hpp"
#include "test_seed.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

// TP: 10 ms at batch 1, 14 at 4 (context 512); 20 and 28 at context 1536. EP: flat 12 ms.
const char* k_file =
    "{\"model\": \"qwen3_235b\", \"P\": 8, \"layers\": 94, \"mode\": \"tp\", \"context\": 512, \"batch\": 1, \"compute_ms\": 9, \"comm_priced_ms\": 1, \"step_ms\": 10}\n"
    "{\"model\": \"qwen3_235b\", \"P\": 8, \"layers\": 94, \"mode\": \"tp\", \"context\": 512, \"batch\": 4, \"step_ms\": 14}\n"
    "\n"
    "{\"model\": \"qwen3_235b\", \"P\": 8, \"layers\": 94, \"mode\": \"tp\", \"context\": 1536, \"batch\": 1, \"step_ms\": 20}\n"
    "{\"model\": \"qwen3_235b\", \"P\": 8, \"layers\": 94, \"mode\": \"tp\", \"context\": 1536, \"batch\": 4, \"step_ms\": 28}\n"
    "{\"model\": \"qwen3_235b\", \"P\": 8, \"layers\": 94, \"mode\": \"ep\", \"context\": 512, \"batch\": 1, \"step_ms\": 12}\n";

step_curves parse(const std::string& text) {
  std::istringstream in(text);
  return step_curves::from_jsonl(in, "test.jsonl");
}

std::string error_of(const std::string& text) {
  try {
    parse(text);
  } catch (const moebius::error& e) {
    CHECK(e.code() == moebius::errc::invalid_argument);
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("step curves: read back and interpolated", "[cpu][curves]") {
  const step_curves c = parse(k_file);
  CHECK(c.num_ranks() == 8);
  CHECK(c.deployment() == "qwen3_235b P=8 L=94 skew 1 (test.jsonl)");
  CHECK(c.num_layers() == 94);
  CHECK(c.step_ms(parallel_mode::tp, 1, 512) == Approx(10));
  CHECK(c.step_ms(parallel_mode::tp, 2, 512) == Approx(12));   // halfway in log2(batch)
  CHECK(c.step_ms(parallel_mode::tp, 8, 512) == Approx(14 + 4 * 4.0 / 3));  // beyond: 4/3 ms a sequence
  CHECK(c.step_ms(parallel_mode::tp, 0.5, 512) == Approx(10)); // below: the smallest
  CHECK(c.step_ms(parallel_mode::tp, 2, 1024) == Approx(18));  // halfway between 12 and 24
  CHECK(c.step_ms(parallel_mode::tp, 4, 4096) == Approx(28));  // above the contexts: the nearest
  CHECK(c.step_ms(parallel_mode::ep, 64, 100) == Approx(12));  // one point
  // A last segment that falls (noise) is flat beyond the largest batch, never below 0 ms.
  const step_curves falling = parse(
      "{\"model\": \"m\", \"P\": 8, \"layers\": 94, \"mode\": \"ep\", \"context\": 512, \"batch\": 128, \"step_ms\": 30}\n"
      "{\"model\": \"m\", \"P\": 8, \"layers\": 94, \"mode\": \"ep\", \"context\": 512, \"batch\": 256, \"step_ms\": 29.5}\n"
      "{\"model\": \"m\", \"P\": 8, \"layers\": 94, \"mode\": \"tp\", \"context\": 512, \"batch\": 1, \"step_ms\": 9}\n");
  CHECK(falling.step_ms(parallel_mode::ep, 8192, 512) == Approx(29.5));
  // Lines as bench_mini_engine_rank_share writes them: modes "TP" / "EP", skew as a fraction.
  const step_curves bench = parse(
      "{\"model\": \"qwen3_235b\", \"P\": 8, \"mode\": \"TP\", \"skew\": 1.000, \"layers\": 94, "
      "\"context\": 512, \"batch\": 1, \"rank_batch\": 1, \"compute_ms\": 14.2575, "
      "\"comm_priced_ms\": 1.8969, \"step_ms\": 16.1544, \"graph_replays\": 13}\n"
      "{\"model\": \"qwen3_235b\", \"P\": 8, \"mode\": \"EP\", \"skew\": 1.000, \"layers\": 94, "
      "\"context\": 512, \"batch\": 1, \"rank_batch\": 1, \"compute_ms\": 24.6, "
      "\"comm_priced_ms\": 1.9, \"step_ms\": 26.5, \"graph_replays\": 13}\n");
  CHECK(bench.step_ms(parallel_mode::tp, 1, 512) == Approx(16.1544));
  CHECK(bench.step_ms(parallel_mode::ep, 1, 512) == Approx(26.5));
}

TEST_CASE("step curves: collectives repriced at another latency", "[cpu][curves]") {
  const step_curves c = parse(k_file);
  // 94 layers, two collectives each: 188 x (30 - 10) us = 3.76 ms more at every point.
  const step_curves slow = c.with_collective_latency(30, 30);
  CHECK(slow.step_ms(parallel_mode::tp, 1, 512) == Approx(13.76));
  CHECK(slow.step_ms(parallel_mode::tp, 2, 1024) == Approx(21.76));
  CHECK(slow.step_ms(parallel_mode::ep, 64, 100) == Approx(15.76));
  CHECK(slow.deployment() == "qwen3_235b P=8 L=94 skew 1 (test.jsonl), collectives repriced at 30 us (TP) / 30 us (EP) each");
  // Per mode: TP at 15 us (+0.94 ms), EP at 95 us (+15.98 ms).
  const step_curves split = c.with_collective_latency(15, 95);
  CHECK(split.step_ms(parallel_mode::tp, 1, 512) == Approx(10.94));
  CHECK(split.step_ms(parallel_mode::ep, 1, 512) == Approx(27.98));
  // At 0 us: 1.88 ms less; at 10 us: unchanged.
  CHECK(c.with_collective_latency(0, 0).step_ms(parallel_mode::tp, 4, 1536) == Approx(28 - 1.88));
  CHECK(c.with_collective_latency(10, 10).step_ms(parallel_mode::tp, 2, 512) == Approx(12));
  CHECK_THROWS_WITH(c.with_collective_latency(-1, 10), Catch::Contains("must be in [0, 10000] us"));
  CHECK_THROWS_WITH(c.with_collective_latency(10, std::nan("")), Catch::Contains("must be in [0, 10000] us"));
  // A 1 ms step with 94 layers of collectives cannot lose 1.88 ms.
  const step_curves tiny = parse(
      "{\"model\": \"m\", \"P\": 8, \"layers\": 94, \"mode\": \"ep\", \"context\": 512, \"batch\": 1, \"step_ms\": 1}\n"
      "{\"model\": \"m\", \"P\": 8, \"layers\": 94, \"mode\": \"tp\", \"context\": 512, \"batch\": 1, \"step_ms\": 9}\n");
  CHECK_THROWS_WITH(tiny.with_collective_latency(10, 0), Catch::Contains("EP step at batch 1, context 512 falls to"));
  const step_curves points({{parallel_mode::ep, 512, 1, 5}, {parallel_mode::tp, 512, 1, 4}}, "hand");
  CHECK_THROWS_WITH(points.with_collective_latency(20, 20), Catch::Contains("needs the layers"));
}

TEST_CASE("step curves: malformed files are errors that name the line", "[cpu][curves]") {
  CHECK_THAT(error_of("{\"model\": \"m\", \"P\": 8, \"layers\": 94, \"mode\": \"tp\", \"context\": 512, \"batch\": 1}\n"),
             Catch::Contains("line 1 of test.jsonl"));
  CHECK_THAT(error_of(std::string(k_file) + "not json\n"), Catch::Contains("line 7"));
  CHECK_THAT(error_of(std::string(k_file) +
                      "{\"model\": \"qwen3_30b\", \"P\": 2, \"layers\": 48, \"mode\": \"ep\", \"context\": 1, \"batch\": 1, \"step_ms\": 1}\n"),
             Catch::Contains("where the file began with qwen3_235b P=8"));
  CHECK_THAT(error_of(std::string(k_file) +
                      "{\"model\": \"qwen3_235b\", \"P\": 8, \"layers\": 94, \"mode\": \"xp\", "
                      "\"context\": 1, \"batch\": 1, \"step_ms\": 1}\n"),
             Catch::Contains("configuration \"xp\": not a configuration"));
  CHECK_THAT(error_of(std::string(k_file) +
                      "{\"model\": \"qwen3_235b\", \"P\": 8, \"layers\": 94, \"mode\": \"ep\", \"context\": 512, \"batch\": 1, \"step_ms\": 3}\n"),
             Catch::Contains("twice"));
  CHECK_THAT(error_of("{\"model\": \"qwen3_235b\", \"P\": 8, \"layers\": 94, \"mode\": \"tp\", \"context\": 512, \"batch\": 1, \"step_ms\": 1}\n"),
             Catch::Contains("no EP point"));
  CHECK_THAT(error_of("{\"model\": \"qwen3_235b\", \"P\": 8, \"layers\": 94, \"mode\": \"tp\", \"context\": 512, \"batch\": 0, \"step_ms\": 1}\n"),
             Catch::Contains("batch >= 1"));
  CHECK_THAT(error_of(""), Catch::Contains("no curve points"));
  // Integers are JSON integers (a 1.9 is not batch 1, true is not P=1).
  const std::string ep_line =
      "{\"model\": \"qwen3_235b\", \"P\": 8, \"layers\": 94, \"mode\": \"ep\", \"context\": 512, ";
  CHECK_THAT(error_of(std::string(k_file) + ep_line + "\"batch\": 1.9, \"step_ms\": 3}\n"),
             Catch::Contains("line 7 of test.jsonl") &&
                 Catch::Contains("\"batch\" must be an integer (got 1.9)"));
  CHECK_THAT(error_of("{\"model\": \"qwen3_235b\", \"P\": true, \"layers\": 94, \"mode\": \"ep\", "
                      "\"context\": 512, \"batch\": 2, \"step_ms\": 3}\n"),
             Catch::Contains("\"P\" must be an integer"));
  // One deployment per file: a shortened model's lines, or another skew, are refused.
  CHECK_THAT(error_of(std::string(k_file) +
                      "{\"model\": \"qwen3_235b\", \"P\": 8, \"layers\": 8, \"mode\": \"ep\", "
                      "\"context\": 512, \"batch\": 2, \"step_ms\": 3}\n"),
             Catch::Contains("layers=8 skew 1 where the file began with qwen3_235b P=8 layers=94"));
  CHECK_THAT(error_of(std::string(k_file) + ep_line +
                      "\"batch\": 2, \"skew\": 1.5, \"step_ms\": 3}\n"),
             Catch::Contains("skew 1.5 where"));
  CHECK_THAT(error_of(ep_line.substr(0, ep_line.find("\"layers")) +
                      "\"mode\": \"ep\", \"context\": 512, \"batch\": 2, \"step_ms\": 3}\n"),
             Catch::Contains("layers"));
  CHECK_THROWS_AS(step_curves::from_file("/nonexistent/curves.jsonl"), moebius::error);
}

TEST_CASE("the curves clock: decode steps from the curves, the rest from the model",
          "[cpu][curves]") {
  priced_model pm;
  pm.context_scale = 4;
  const h200_step_model model(pm, h200_params{}, 8, 1024);
  const curves_step_clock clock(parse(k_file), model);
  CHECK(std::string(clock.name()).find("qwen3_235b P=8") != std::string::npos);
  CHECK(std::string(clock.name()).find("modelled H200") != std::string::npos);
  // The curves' steps are compute measured plus collectives priced: the name says both.
  CHECK(std::string(clock.name()).find("compute measured on one GPU, collectives priced") !=
        std::string::npos);
  step_cost decode;
  decode.mode = parallel_mode::tp;
  decode.num_ranks = 8;
  decode.num_sequences = decode.new_tokens = 2;
  decode.context_tokens = 2 * 256;  // 256 a sequence, priced x4: context 1024
  CHECK(clock.step_s(decode, 0) == Approx(18e-3));
  // A prefill of 38 more tokens: the decode step plus the extra rows at the smallest context
  // (512): beyond batch 4 the last segment's slope, 4/3 ms a row: 14 + 36 x 4/3 = 62 ms at 40
  // rows, 12 ms at 2 (log2 midway): 18 + 50 = 68 ms.
  step_cost prefill = decode;
  prefill.new_tokens = 40;
  CHECK(clock.step_s(prefill, 0) == Approx(68e-3));
  // Never below the decode step, whatever the curve does.
  CHECK(clock.step_s(prefill, 0) >= clock.step_s(decode, 0));
  const switch_copies copies{0.0, int64_t{1} << 30};
  const double slow = model.slowdown().at(18e-3, copies.bytes);
  CHECK(clock.switch_step_s(decode, 0, copies) ==
        Approx(std::max(18e-3 * slow, model.copies_s(copies))));
  CHECK(clock.link().bytes_per_s == model.link().bytes_per_s);
  CHECK(!clock.needs_measurement());
}

TEST_CASE("the curves clock prices an EP step by its busiest rank", "[cpu][curves]") {
  // EP at context 512: 10 ms at batch 8, 40 ms at 64 (the deployment's batch: 1 and 8 a rank).
  const step_curves curves({{parallel_mode::tp, 512, 1, 5},
                            {parallel_mode::ep, 512, 8, 10},
                            {parallel_mode::ep, 512, 64, 40}},
                           "test");
  priced_model pm;
  pm.context_scale = 1;
  const h200_step_model model(pm, h200_params{}, 8, 1024);
  const curves_step_clock clock(curves, model);
  step_cost c;
  c.mode = parallel_mode::ep;
  c.num_ranks = 8;
  c.num_sequences = c.new_tokens = 9;
  c.context_tokens = 9 * 512;
  // Without the split: the deployment's 9 sequences, log2 between 8 and 64.
  CHECK(clock.step_s(c, 0) == Approx((10 + 30 * (std::log2(9.0) - 3) / 3) * 1e-3));
  // Rank 3 holds 8 of them: priced as 64 (every rank as busy), 40 ms; rank 0's one, 10 ms.
  c.ranks.assign(8, rank_work{});
  c.ranks[0] = {1, 1, 512};
  c.ranks[3] = {8, 8, 8 * 512};
  CHECK(clock.step_s(c, 0) == Approx(40e-3));
  // Rank 0 prefills 7 more tokens: 8 rows on it, 64 in the curve's terms: 10 + (40 - 10).
  c.ranks[0] = {1, 8, 512 + 7};
  c.new_tokens = 16;
  CHECK(clock.step_s(c, 0) == Approx(40e-3));
  c.ranks[0] = {1, 16, 512 + 15};  // 128 rows: past the last point, 30/56 ms a row beyond 64
  CHECK(clock.step_s(c, 0) == Approx((10 + (40 + 30.0 / 56 * 64 - 10)) * 1e-3));
}

TEST_CASE("ep_rank_work splits a step's items by their EP owner", "[cpu][curves]") {
  const moebius::kv_geometry g = moebius::make_kv_geometry(1, 2, 4, 4, 8, 2);
  moebius::kv_sequence a, b;
  a.seq_id = 3;
  a.pages = {0};
  a.num_tokens = a.last_page_len = 2;
  b.seq_id = 5;
  b.pages = {1, 2};
  b.num_tokens = 7;
  b.last_page_len = 3;
  const moebius::kv_state s = moebius::make_kv_state(g, parallel_mode::ep, {{b}, {a}});
  const std::vector<int32_t> one = {1}, three = {1, 2, 3};
  const step_item items[] = {{3, one, 1, true}, {5, three, 4, true}};
  const std::vector<rank_work> w = ep_rank_work(s, items);
  REQUIRE(w.size() == 2);
  CHECK(w[0] == rank_work{1, 3, 7});
  CHECK(w[1] == rank_work{1, 1, 2});
  const step_item stranger[] = {{9, one, 0, true}};
  CHECK_THROWS_WITH(ep_rank_work(s, stranger), Catch::Contains("no rank holds sequence 9"));
}

TEST_CASE("step curves: a deployment's curves found among files, or none", "[cpu][curves]") {
  const std::string other =
      "{\"model\": \"qwen3_30b\", \"P\": 2, \"layers\": 48, \"mode\": \"tp\", \"context\": 512, \"batch\": 1, \"step_ms\": 5}\n"
      "{\"model\": \"qwen3_30b\", \"P\": 2, \"layers\": 48, \"mode\": \"ep\", \"context\": 512, \"batch\": 1, \"step_ms\": 6}\n";
  const embedded_curves files[] = {{"a.jsonl", other.c_str()}, {"b.jsonl", k_file}};
  const std::optional<step_curves> c = step_curves::find(files, "qwen3_235b", 8);
  REQUIRE(c.has_value());
  CHECK(c->model() == "qwen3_235b");
  CHECK(c->deployment() == "qwen3_235b P=8 L=94 skew 1 (b.jsonl)");
  CHECK(c->step_ms(parallel_mode::tp, 1, 512) == Approx(10));
  CHECK(step_curves::find(files, "qwen3_30b", 2)->step_ms(parallel_mode::ep, 1, 512) == Approx(6));
  CHECK_FALSE(step_curves::find(files, "qwen3_235b", 4).has_value());  // another P
  CHECK_FALSE(step_curves::find(files, "qwen3_30b", 8).has_value());
  // A file that does not parse is an error naming it, not a deployment without curves.
  const embedded_curves broken[] = {{"docs/results/step_curves_x.jsonl", "not json\n"}};
  CHECK_THROWS_WITH(step_curves::find(broken, "qwen3_235b", 8),
                    Catch::Contains("line 1 of docs/results/step_curves_x.jsonl"));
  // Whatever is committed under docs/results parses (the build compiled it in).
  for (const embedded_curves& f : step_curves::measured_files()) {
    INFO(f.source);
    std::istringstream in(f.text);
    CHECK_NOTHROW(step_curves::from_jsonl(in, f.source));
  }
}

TEST_CASE("with_step_shift moves each point by its configuration's and batch's shift") {
  const step_curves c = parse(k_file);
  const step_curves s = c.with_step_shift(
      [](const configuration& x, int64_t batch) {
        return x.attention() == parallel_mode::tp ? 0.5 * static_cast<double>(batch) : -2.0;
      },
      "a test shift");
  CHECK(s.step_ms(parallel_mode::tp, 1, 512) == Approx(10.5));
  CHECK(s.step_ms(parallel_mode::tp, 4, 1536) == Approx(30));
  CHECK(s.step_ms(parallel_mode::ep, 1, 512) == Approx(10));
  CHECK(s.deployment().find(", a test shift") != std::string::npos);
  CHECK_THROWS_WITH(c.with_step_shift([](const configuration&, int64_t) { return -12.0; }, "x"),
                    Catch::Contains("TP step at batch 1, context 512 falls to -2 ms with x"));
}

TEST_CASE("step curves: each configuration's collectives pricing, and repricing by it",
          "[cpu][curves]") {
  const priced_model m = qwen3_235b_a22b_priced();  // 94 layers, as k_file
  const step_curves c = parse(k_file);
  // No "collectives" field: the link model the first curves were priced with.
  CHECK(c.collectives_of(parallel_mode::tp) == collective_pricing::link);
  CHECK(c.collectives_of(parallel_mode::ep) == collective_pricing::link);
  // Repriced by the table: each point moves by its configuration's and batch's shift.
  const step_curves cited = c.with_collectives(collective_pricing::cited, m);
  CHECK(cited.collectives_of(parallel_mode::tp) == collective_pricing::cited);
  decode_step_shape tp;
  tp.batch = 4;
  tp.layers = 94;
  tp.hidden = 4096;
  tp.q_heads = 64;
  tp.head_dim = 128;
  CHECK(cited.step_ms(parallel_mode::tp, 4, 512) ==
        Approx(14 + collectives_shift_ms(tp, collective_pricing::link, collective_pricing::cited)));
  decode_step_shape ep = tp;
  ep.tp_attention = false;
  ep.batch = 1;
  ep.rank_pairs = 8;  // ceil(1/8) x top-8
  CHECK(cited.step_ms(parallel_mode::ep, 1, 512) ==
        Approx(12 + collectives_shift_ms(ep, collective_pricing::link, collective_pricing::cited)));
  // And back: the points as read.
  const step_curves back = cited.with_collectives(collective_pricing::link, m);
  for (const double b : {1.0, 2.0, 4.0})
    CHECK(back.step_ms(parallel_mode::tp, b, 1536) == Approx(c.step_ms(parallel_mode::tp, b, 1536)));
  // Already so priced: returned as it is (its description too).
  CHECK(c.with_collectives(collective_pricing::link, m).deployment() == c.deployment());
  // A latency repricing needs the link model's prices; the fallback too.
  CHECK_THROWS_WITH(cited.with_collective_latency(20, 20),
                    Catch::Contains("TP's are cited (with_collectives(link) first)"));
  const h200_step_model model(m, h200_params{}, 8, 48 * 1024, nullptr);
  const configuration wanted[] = {k_tp_dcp2};
  CHECK_THROWS_WITH(with_priced_layouts(cited, model, wanted),
                    Catch::Contains("TP's collectives are priced by cited"));
  // Lines say how they were priced, one pricing per configuration.
  const step_curves mixed = parse(
      std::string(k_file) +
      "{\"model\": \"qwen3_235b\", \"P\": 8, \"layers\": 94, \"mode\": \"TEP-dcp2\", \"context\": 512, \"batch\": 1, \"step_ms\": 11, \"collectives\": \"cited\"}\n");
  CHECK(mixed.collectives_of(k_tep_dcp2) == collective_pricing::cited);
  CHECK(mixed.collectives_of(k_tp) == collective_pricing::link);
  CHECK(error_of(std::string(k_file) +
                 "{\"model\": \"qwen3_235b\", \"P\": 8, \"layers\": 94, \"mode\": \"ep\", \"context\": 1024, \"batch\": 1, \"step_ms\": 11, \"collectives\": \"cited\"}\n")
            .find("EP priced by cited where its earlier lines say link") != std::string::npos);
  CHECK(error_of(std::string(k_file) +
                 "{\"model\": \"qwen3_235b\", \"P\": 8, \"layers\": 94, \"mode\": \"ep\", \"context\": 1024, \"batch\": 1, \"step_ms\": 11, \"collectives\": \"nccl\"}\n")
            .find("\"collectives\" must be \"link\" or \"cited\" (got \"nccl\")") != std::string::npos);
  const step_curves points({{parallel_mode::ep, 512, 1, 5}, {parallel_mode::tp, 512, 1, 4}}, "hand");
  CHECK_THROWS_WITH(points.with_collectives(collective_pricing::cited, m),
                    Catch::Contains("needs the layers the curves were measured with"));
}

TEST_CASE("step curves: the busiest EP rank's expert load priced onto EP-experts curves",
          "[cpu][curves]") {
  const priced_model m = qwen3_235b_a22b_priced();
  const double bytes = 3.0 * 4096 * 1536 * 2, hbm = 4e12;
  const step_curves c = parse(k_file);
  const step_curves moved = c.with_expert_load(m, hbm, routing_model{});
  CHECK(moved.expert_load_priced(parallel_mode::ep));
  CHECK_FALSE(moved.expert_load_priced(parallel_mode::tp));
  // EP at batch 1: the emulated rank's 8 experts against the busiest real rank's ~2.5.
  CHECK(moved.step_ms(parallel_mode::ep, 1, 512) ==
        Approx(12 + expert_load_shift_ms(false, 1, 128, 8, 8, 94, bytes, hbm)));
  CHECK(moved.step_ms(parallel_mode::ep, 1, 512) < 12 - 4);
  // TP's experts are sliced on every rank: no shift.
  CHECK(moved.step_ms(parallel_mode::tp, 4, 1536) == Approx(28));
  // Once only.
  CHECK(moved.with_expert_load(m, hbm, routing_model{}).step_ms(parallel_mode::ep, 1, 512) ==
        Approx(moved.step_ms(parallel_mode::ep, 1, 512)));
  // A priced curve (the fallback's roofline expert term is its busiest rank already): untouched.
  const h200_step_model model(m, h200_params{}, 8, 48 * 1024, nullptr);
  const configuration wanted[] = {k_tep_dcp2};
  const step_curves with_fallback = with_priced_layouts(c, model, wanted);
  const step_curves both = with_fallback.with_expert_load(m, hbm, routing_model{});
  CHECK_FALSE(both.expert_load_priced(k_tep_dcp2));
  CHECK(both.step_ms(k_tep_dcp2, 4, 1024) == Approx(with_fallback.step_ms(k_tep_dcp2, 4, 1024)));
  const step_curves points({{parallel_mode::ep, 512, 1, 5}, {parallel_mode::tp, 512, 1, 4}}, "hand");
  CHECK_THROWS_WITH(points.with_expert_load(m, hbm, routing_model{}),
                    Catch::Contains("needs the layers the curves were measured with"));
}

TEST_CASE("step curves: a layout priced from another by the two's ratio measured together",
          "[cpu][curves]") {
  // The deployment's curves: TP-DCP2 measured here (or priced), TEP-DCP2 not at all.
  const step_curves base({{parallel_mode::tp, 512, 1, 10}, {parallel_mode::ep, 512, 1, 12},
                          {k_tp_dcp2, 512, 1, 10}, {k_tp_dcp2, 512, 4, 20},
                          {k_tp_dcp2, 2048, 1, 16}, {k_tp_dcp2, 2048, 4, 40}},
                         "base");
  // Another card's run of both: TEP-DCP2 / TP-DCP2 = 1.1 at batch 1, 0.75 at 2 (context 512).
  const step_curves ratios({{parallel_mode::tp, 512, 1, 5}, {parallel_mode::ep, 512, 1, 5},
                            {k_tp_dcp2, 512, 1, 10}, {k_tp_dcp2, 512, 2, 20},
                            {k_tep_dcp2, 512, 1, 11}, {k_tep_dcp2, 512, 2, 15}},
                           "other card");
  // Within the points: batch 8 held at 2 (step_ms would go on at the last slope).
  CHECK(ratios.step_ms_within(k_tp_dcp2, 8, 512) == Approx(20));
  CHECK(ratios.step_ms(k_tp_dcp2, 8, 512) == Approx(80));
  CHECK(ratios.step_ms_within(k_tp_dcp2, 1.5, 4096) == Approx(ratios.step_ms(k_tp_dcp2, 1.5, 512)));
  const step_curves c = with_measured_ratio(base, ratios, k_tep_dcp2, k_tp_dcp2);
  CHECK(c.priced(k_tep_dcp2));
  CHECK_FALSE(c.priced(k_tp_dcp2));
  CHECK(c.source_of(k_tep_dcp2) ==
        "TP-DCP2's curve (base) times TEP-DCP2/TP-DCP2 as measured in other card (the ratio of "
        "whole steps, held at its points' edge)");
  CHECK(c.step_ms(k_tep_dcp2, 1, 512) == Approx(11));     // 10 x 1.1
  CHECK(c.step_ms(k_tep_dcp2, 4, 512) == Approx(15));     // 20 x 0.75 (the ratio at batch 2)
  CHECK(c.step_ms(k_tep_dcp2, 2, 512) == Approx(13));     // between them in log2(batch)
  CHECK(c.step_ms(k_tep_dcp2, 1, 2048) == Approx(17.6));  // 16 x 1.1 (the nearest context's)
  CHECK(c.step_ms(k_tep_dcp2, 4, 2048) == Approx(30));    // 40 x 0.75
  CHECK(c.step_ms(k_tp_dcp2, 4, 2048) == Approx(40));     // the rest as it was
  CHECK(c.configurations().size() == base.configurations().size() + 1);
  // Over a priced curve of the same layout: replaced in its place.
  const step_curves twice = with_measured_ratio(c, ratios, k_tep_dcp2, k_tp_dcp2);
  CHECK(twice.configurations() == c.configurations());
  CHECK(twice.step_ms(k_tep_dcp2, 4, 2048) == Approx(30));
  // A measured curve of the layout is kept.
  const step_curves measured({{parallel_mode::tp, 512, 1, 10}, {parallel_mode::ep, 512, 1, 12},
                              {k_tp_dcp2, 512, 1, 10}, {k_tep_dcp2, 512, 1, 9}},
                             "measured");
  const step_curves kept = with_measured_ratio(measured, ratios, k_tep_dcp2, k_tp_dcp2);
  CHECK_FALSE(kept.priced(k_tep_dcp2));
  CHECK(kept.step_ms(k_tep_dcp2, 1, 512) == Approx(9));
  // Refused by name.
  CHECK_THROWS_WITH(with_measured_ratio(base, ratios, k_tp_dcp2, k_tp_dcp2),
                    Catch::Contains("TP-DCP2 priced from itself"));
  CHECK_THROWS_WITH(with_measured_ratio(base, ratios, k_tep, k_tp_dcp2),
                    Catch::Contains("(other card) need TEP and TP-DCP2"));
  const step_curves ratios_without_ref(
      {{parallel_mode::tp, 512, 1, 5}, {parallel_mode::ep, 512, 1, 5}, {k_tep_dcp2, 512, 1, 11}},
      "one layout");
  CHECK_THROWS_WITH(with_measured_ratio(base, ratios_without_ref, k_tep_dcp2, k_tp_dcp2),
                    Catch::Contains("(one layout) need TEP-DCP2 and TP-DCP2"));
  const step_curves no_ref({{parallel_mode::tp, 512, 1, 10}, {parallel_mode::ep, 512, 1, 12}}, "bare");
  CHECK_THROWS_WITH(with_measured_ratio(no_ref, ratios, k_tep_dcp2, k_tp_dcp2),
                    Catch::Contains("no curve of TP-DCP2"));
}

TEST_CASE("step curves: a layout priced by a measured ratio takes the busiest rank's expert load",
          "[cpu][curves]") {
  const priced_model m = qwen3_235b_a22b_priced();
  const double bytes = 3.0 * 4096 * 1536 * 2, hbm = 4e12;
  const h200_step_model model(m, h200_params{}, 8, 48 * 1024, nullptr);
  const configuration wanted[] = {k_tp_dcp2, k_tep_dcp2};
  const step_curves fallback = with_priced_layouts(parse(k_file), model, wanted);
  const step_curves ratios({{parallel_mode::tp, 512, 1, 5}, {parallel_mode::ep, 512, 1, 5},
                            {k_tp_dcp2, 512, 1, 10}, {k_tep_dcp2, 512, 1, 8}},
                           "other card");
  const step_curves c = with_measured_ratio(fallback, ratios, k_tep_dcp2, k_tp_dcp2);
  CHECK(c.step_ms(k_tep_dcp2, 4, 2048) == Approx(0.8 * fallback.step_ms(k_tp_dcp2, 4, 2048)));
  // The roofline's TEP-DCP2 has the busiest rank in it; the ratio's, measured on one emulated
  // rank, does not: with_expert_load moves it as it moves measured EP experts.
  CHECK_FALSE(fallback.with_expert_load(m, hbm, routing_model{}).expert_load_priced(k_tep_dcp2));
  const step_curves moved = c.with_expert_load(m, hbm, routing_model{});
  CHECK(moved.expert_load_priced(k_tep_dcp2));
  CHECK(moved.step_ms(k_tep_dcp2, 4, 2048) ==
        Approx(c.step_ms(k_tep_dcp2, 4, 2048) + expert_load_shift_ms(true, 4, 128, 8, 8, 94, bytes, hbm)));
}

TEST_CASE("graph buckets: the smallest bucket that holds the batch, vLLM's defaults",
          "[cpu][curves]") {
  const std::vector<int64_t> b = {1, 2, 4, 8};
  CHECK(graph_bucket(b, 1) == 1);
  CHECK(graph_bucket(b, 3) == 4);
  CHECK(graph_bucket(b, 5) == 8);
  CHECK(graph_bucket(b, 8) == 8);
  CHECK(graph_bucket(b, 9) == 0);  // beyond the largest: eager
  CHECK(graph_bucket({}, 1) == 0);
  // vLLM: 1, 2, 4, then every multiple of 8 to 512; each batch against that rule written out.
  const std::vector<int64_t> v = vllm_capture_sizes();
  CHECK(v.size() == 67);
  CHECK_NOTHROW(validate_graph_buckets(v));
  for (int64_t batch = 1; batch <= 600; ++batch) {
    const int64_t want = batch <= 2 ? batch : batch <= 4 ? 4 : batch <= 512 ? (batch + 7) / 8 * 8 : 0;
    INFO("batch " << batch);
    CHECK(graph_bucket(v, batch) == want);
  }
  CHECK_NOTHROW(validate_graph_buckets({}));
  CHECK_THROWS_WITH(validate_graph_buckets(std::vector<int64_t>{1, 4, 4}),
                    Catch::Contains("bucket 2 (4) is not above bucket 1 (4)"));
  CHECK_THROWS_WITH(validate_graph_buckets(std::vector<int64_t>{8, 2}),
                    Catch::Contains("bucket 1 (2) is not above bucket 0 (8)"));
  CHECK_THROWS_WITH(validate_graph_buckets(std::vector<int64_t>{0, 2}),
                    Catch::Contains("bucket 0 is 0 (must be >= 1)"));
}

namespace {

// TP at context 128: 9, 12, 18 ms at batch 1, 4, 16; at context 512: 10, 14, 22. EP at context
// 512 only: 8, 12, 20 ms at batch 2, 8, 32.
std::vector<step_curve_point> hand_points() {
  return {{parallel_mode::tp, 128, 1, 9},  {parallel_mode::tp, 128, 4, 12},
          {parallel_mode::tp, 128, 16, 18}, {parallel_mode::tp, 512, 1, 10},
          {parallel_mode::tp, 512, 4, 14},  {parallel_mode::tp, 512, 16, 22},
          {parallel_mode::ep, 512, 2, 8},   {parallel_mode::ep, 512, 8, 12},
          {parallel_mode::ep, 512, 32, 20}};
}
step_curves hand_curves() { return step_curves(hand_points(), "hand"); }

// An EP step at P = 4 split 3, 1, 0 and 2 sequences over the ranks, one new token each, at
// context 512.
step_cost ep_split_step() {
  step_cost ep;
  ep.mode = parallel_mode::ep;
  ep.num_ranks = 4;
  ep.ranks = {{3, 3, 3 * 512}, {1, 1, 512}, {0, 0, 0}, {2, 2, 2 * 512}};
  ep.num_sequences = ep.new_tokens = 6;
  ep.context_tokens = 6 * 512;
  return ep;
}

// Linear in log2 between (b0, y0) and (b1, y1), by hand.
double log_lerp(double b, double b0, double y0, double b1, double y1) {
  return y0 + (y1 - y0) * (std::log2(b) - std::log2(b0)) / (std::log2(b1) - std::log2(b0));
}

step_cost tp_step(int64_t sequences, int64_t new_tokens, int64_t context) {
  step_cost c;
  c.mode = parallel_mode::tp;
  c.num_ranks = 4;
  c.num_sequences = sequences;
  c.new_tokens = new_tokens;
  c.context_tokens = sequences * context;
  return c;
}

}  // namespace

TEST_CASE("the curves clock prices a decode step at its CUDA-graph bucket", "[cpu][curves]") {
  priced_model pm;
  pm.context_scale = 1;
  const h200_step_model model(pm, h200_params{}, 4, 1024);
  const curves_step_clock plain(hand_curves(), model);
  curves_clock_options o;
  o.graph_buckets = {1, 2, 4, 8};
  o.eager_penalty = 1.5;
  const curves_step_clock padded(hand_curves(), model, o);
  CHECK_THAT(padded.name(), Catch::Contains("decode steps at their CUDA-graph bucket (4 buckets, "
                                            "1-8; beyond: eager, the curve x 1.5)"));
  CHECK_THAT(plain.name(), Catch::Contains("decode steps at their own batch"));
  // TP, 3 sequences at 512: between the points, or at bucket 4 (14 ms).
  CHECK(plain.step_s(tp_step(3, 3, 512), 0) * 1e3 == Approx(log_lerp(3, 1, 10, 4, 14)));
  CHECK(padded.step_s(tp_step(3, 3, 512), 0) * 1e3 == Approx(14));
  // 5 sequences: bucket 8, halfway in log2 between 4 (14) and 16 (22).
  CHECK(padded.step_s(tp_step(5, 5, 512), 0) * 1e3 == Approx(18));
  CHECK(padded.step_s(tp_step(8, 8, 512), 0) * 1e3 == Approx(18));
  CHECK(padded.step_s(tp_step(2, 2, 512), 0) * 1e3 == Approx(12));
  // 9: beyond the largest bucket, eager: the curve at 9 x 1.5.
  CHECK(padded.step_s(tp_step(9, 9, 512), 0) * 1e3 == Approx(1.5 * log_lerp(9, 4, 14, 16, 22)));
  // A step that prefills is eager at its own batch: the same as without buckets, by hand:
  // curve(3, 512) + curve(40, 128) - curve(3, 128), 40 rows beyond 16 at 0.5 ms a row.
  const double prefill = log_lerp(3, 1, 10, 4, 14) + (18 + 24 * 0.5) - log_lerp(3, 1, 9, 4, 12);
  CHECK(plain.step_s(tp_step(3, 40, 512), 0) * 1e3 == Approx(prefill));
  CHECK(padded.step_s(tp_step(3, 40, 512), 0) * 1e3 == Approx(prefill));

  // EP at P = 4, split: each rank at its own bucket, in the curves' terms P x that.
  step_cost ep = ep_split_step();
  // Rank 0: bucket 4, the curve at 16 (halfway between 8 and 32: 16 ms); rank 1 at 4 (10), rank
  // 3 at 8 (12): the busiest, 16 ms. Without buckets rank 0 at 12 sequences.
  CHECK(padded.step_s(ep, 0) * 1e3 == Approx(16));
  CHECK(plain.step_s(ep, 0) * 1e3 == Approx(log_lerp(12, 8, 12, 32, 20)));
  // Rank 1 with 9 sequences is beyond the buckets: eager, the curve at 36 (beyond 32: 8/24 ms a
  // sequence) x 1.5.
  ep.ranks[1] = {9, 9, 9 * 512};
  ep.num_sequences = ep.new_tokens = 14;
  ep.context_tokens = 14 * 512;
  CHECK(padded.step_s(ep, 0) * 1e3 == Approx(1.5 * (20 + 4 * 8.0 / 24)));
  // Not split: as if evenly, ceil(14 / 4) = 4 a rank: bucket 4, the curve at 16.
  ep.ranks.clear();
  CHECK(padded.step_s(ep, 0) * 1e3 == Approx(16));
  CHECK(plain.step_s(ep, 0) * 1e3 == Approx(log_lerp(14, 8, 12, 32, 20)));  // as it always was

  // Bad options are refused by name.
  curves_clock_options bad;
  bad.graph_buckets = {1, 4, 2};
  CHECK_THROWS_WITH(curves_step_clock(hand_curves(), model, bad),
                    Catch::Contains("bucket 2 (2) is not above bucket 1 (4)"));
  bad.graph_buckets = {1, 2};
  bad.eager_penalty = 0;
  CHECK_THROWS_WITH(curves_step_clock(hand_curves(), model, bad),
                    Catch::Contains("eager_penalty 0 must be finite and > 0"));
  bad.eager_penalty = std::nan("");
  CHECK_THROWS_AS(curves_step_clock(hand_curves(), model, bad), moebius::error);
}

TEST_CASE("the curves clock prices a decode step on decode steps measured as replayed",
          "[cpu][curves]") {
  priced_model pm;
  pm.context_scale = 1;
  const h200_step_model model(pm, h200_params{}, 4, 1024);
  // TP replayed at buckets 1, 4, 16 and past bucket 4 (5: bucket 16's graph): 10, 14, 20, 22 ms
  // at context 512; 9, 12, 17, 18 at 128. EP at 512 as the curves' with a jump past 8: 18 ms at
  // 12. No TP-DCP2: its decode steps stay on the curves (which have it here).
  std::vector<step_curve_point> with_dcp = hand_points();
  with_dcp.push_back({k_tp_dcp2, 512, 1, 11});
  with_dcp.push_back({k_tp_dcp2, 512, 16, 23});
  const step_curves curves(with_dcp, "hand");
  const curves_step_clock plain(curves, model);
  std::vector<step_curve_point> as_replayed = hand_points();
  as_replayed.push_back({parallel_mode::tp, 128, 5, 17});
  as_replayed.push_back({parallel_mode::tp, 512, 5, 20});
  as_replayed.push_back({parallel_mode::ep, 512, 12, 18});
  curves_clock_options o;
  o.replayed_decode = step_curves(as_replayed, "replayed by hand");
  const curves_step_clock replayed(curves, model, o);
  CHECK_THAT(replayed.name(), Catch::Contains("decode steps at their own batch on decode steps "
                                              "measured as replayed (every graph bucket and the "
                                              "first batch past each) of TP, EP (replayed by hand)"));
  // Below the bucket the same points as the curves; past it, the jump.
  CHECK(replayed.step_s(tp_step(3, 3, 512), 0) * 1e3 == Approx(log_lerp(3, 1, 10, 4, 14)));
  CHECK(replayed.step_s(tp_step(5, 5, 512), 0) * 1e3 == Approx(20));
  CHECK(replayed.step_s(tp_step(8, 8, 512), 0) * 1e3 == Approx(log_lerp(8, 5, 20, 16, 22)));
  CHECK(plain.step_s(tp_step(8, 8, 512), 0) * 1e3 == Approx(log_lerp(8, 4, 14, 16, 22)));
  // Between contexts: linear in the context, as the curves.
  CHECK(replayed.step_s(tp_step(5, 5, 320), 0) * 1e3 == Approx(18.5));
  // A step that prefills runs eagerly: the curves alone, by hand as in the bucket test.
  const double prefill = log_lerp(3, 1, 10, 4, 14) + (18 + 24 * 0.5) - log_lerp(3, 1, 9, 4, 12);
  CHECK(replayed.step_s(tp_step(3, 40, 512), 0) * 1e3 == Approx(prefill));
  CHECK(replayed.step_s(tp_step(5, 40, 512), 0) == Approx(plain.step_s(tp_step(5, 40, 512), 0)));
  // EP at P = 4, split: rank 0's 3 sequences at 12 in the curves' terms, past the jump (18 ms),
  // the busiest; without the option log2-between 8 and 32.
  const step_cost ep = ep_split_step();
  CHECK(replayed.step_s(ep, 0) * 1e3 == Approx(18));
  CHECK(plain.step_s(ep, 0) * 1e3 == Approx(log_lerp(12, 8, 12, 32, 20)));
  // TP-DCP2 has no replayed curve: its decode steps on the curves, as without the option.
  step_cost dcp = tp_step(8, 8, 512);
  dcp.dcp = 2;
  CHECK(replayed.step_s(dcp, 0) * 1e3 == Approx(log_lerp(8, 1, 11, 16, 23)));
  // Two ways to price the padding at once, or a configuration the curves lack: refused by name.
  curves_clock_options both = o;
  both.graph_buckets = {1, 4, 16};
  CHECK_THROWS_WITH(curves_step_clock(curves, model, both),
                    Catch::Contains("replayed_decode and graph_buckets are two ways"));
  curves_clock_options other;
  other.replayed_decode = curves;
  CHECK_THROWS_WITH(curves_step_clock(hand_curves(), model, other),
                    Catch::Contains("replayed_decode has TP-DCP2, which the curves (hand) have no "
                                    "curve of"));
}

TEST_CASE("the curves clock at vLLM's buckets: every decode batch at its bucket, random batches",
          "[cpu][curves]") {
  std::mt19937_64 rng(testing::test_seed());
  // Random curves: TP at context 256, batches 1, 2, 4, ..., 512 with random increasing times.
  std::vector<step_curve_point> points = {{parallel_mode::ep, 256, 1, 3}};
  double ms = 2;
  std::uniform_real_distribution<double> step(0.01, 3);
  for (int64_t b = 1; b <= 512; b *= 2) points.push_back({parallel_mode::tp, 256, b, ms += step(rng)});
  const step_curves curves(points, "random");
  priced_model pm;
  pm.context_scale = 1;
  const h200_step_model model(pm, h200_params{}, 8, 1024);
  curves_clock_options o;
  o.graph_buckets = vllm_capture_sizes();
  o.eager_penalty = std::uniform_real_distribution<double>(1, 2)(rng);
  const curves_step_clock clock(curves, model, o);
  std::uniform_int_distribution<int64_t> batch(1, 700);
  for (int i = 0; i < 200; ++i) {
    const int64_t B = batch(rng);
    // vLLM's rule written out: 1, 2, 4, then the next multiple of 8; beyond 512 eager.
    const int64_t bucket = B <= 2 ? B : B <= 4 ? 4 : (B + 7) / 8 * 8;
    const double want = bucket <= 512 ? curves.step_ms(parallel_mode::tp, static_cast<double>(bucket), 256)
                                      : curves.step_ms(parallel_mode::tp, static_cast<double>(B), 256) *
                                            o.eager_penalty;
    INFO("batch " << B);
    CHECK(clock.step_s(tp_step(B, B, 256), 0) * 1e3 == Approx(want).epsilon(1e-12));
    // Padding never prices a step below its own batch on an increasing curve.
    CHECK(clock.step_s(tp_step(B, B, 256), 0) * 1e3 >=
          curves.step_ms(parallel_mode::tp, static_cast<double>(B), 256) * (1 - 1e-12));
  }
}

TEST_CASE("prefill tables: measured chunk steps, interpolated in log2(tokens)", "[cpu][curves]") {
  const prefill_table t({{parallel_mode::ep, 64, 8}, {parallel_mode::ep, 16, 6}}, "hand");
  CHECK(t.has(parallel_mode::ep));
  CHECK_FALSE(t.has(parallel_mode::tp));
  CHECK(t.source() == "hand");
  CHECK(t.step_ms(parallel_mode::ep, 32) == Approx(7));   // halfway in log2
  CHECK(t.step_ms(parallel_mode::ep, 16) == Approx(6));
  CHECK(t.step_ms(parallel_mode::ep, 8) == Approx(6));    // below: the smallest
  CHECK(t.step_ms(parallel_mode::ep, 112) == Approx(10)); // beyond: 2/48 ms a token
  REQUIRE(t.points(parallel_mode::ep).size() == 2);
  CHECK(t.points(parallel_mode::ep)[0].tokens == 16);     // sorted
  // A last segment that falls (noise): flat beyond it.
  const prefill_table falling({{parallel_mode::tp, 16, 6}, {parallel_mode::tp, 64, 5}}, "x");
  CHECK(falling.step_ms(parallel_mode::tp, 4096) == Approx(5));
  CHECK(prefill_table().empty());
  CHECK_THROWS_WITH(t.step_ms(parallel_mode::tp, 16), Catch::Contains("prefill table (hand): no TP points"));
  CHECK_THROWS_WITH(prefill_table({{parallel_mode::ep, 0, 8}}, "f"),
                    Catch::Contains("prefill table (f): point 0 needs tokens >= 1"));
  CHECK_THROWS_WITH(prefill_table({{parallel_mode::ep, 16, 8}, {parallel_mode::ep, 32, -1}}, "f"),
                    Catch::Contains("point 1 needs tokens >= 1 and a positive step_ms (got EP tokens 32, step_ms -1)"));
  CHECK_THROWS_WITH(prefill_table({{parallel_mode::ep, 16, 8}, {parallel_mode::ep, 16, 9}}, "f"),
                    Catch::Contains("EP tokens 16 twice"));
  const configuration unnamed{{parallel_mode::ep, parallel_mode::tp}};
  CHECK_THROWS_WITH(prefill_table({{unnamed, 16, 8}}, "f"),
                    Catch::Contains("point 0 has no named configuration"));
}

TEST_CASE("the curves clock takes a prefill step's increment from measured prefill points",
          "[cpu][curves]") {
  priced_model pm;
  pm.context_scale = 1;
  const h200_step_model model(pm, h200_params{}, 2, 1024);
  curves_clock_options o;
  o.graph_buckets = {1, 2, 4, 8};
  o.prefill = prefill_table({{parallel_mode::tp, 16, 30},
                             {parallel_mode::tp, 64, 40},
                             {parallel_mode::tp, 256, 60},
                             {parallel_mode::ep, 16, 20},
                             {parallel_mode::ep, 64, 30}},
                            "hand table");
  const curves_step_clock clock(hand_curves(), model, o);
  const curves_step_clock rows(hand_curves(), model);  // the extra rows, as before
  CHECK_THAT(clock.name(), Catch::Contains("a prefill chunk from measured prefill steps of TP, EP "
                                           "(hand table;"));
  // TP, 3 sequences with 40 new tokens at 512: curve(3, 512) + table(40) - curve(3, 128), the
  // table between 16 and 64 in log2.
  const double decode = log_lerp(3, 1, 10, 4, 14), beside = log_lerp(3, 1, 9, 4, 12);
  CHECK(clock.step_s(tp_step(3, 40, 512), 0) * 1e3 ==
        Approx(decode + log_lerp(40, 16, 30, 64, 40) - beside));
  CHECK(rows.step_s(tp_step(3, 40, 512), 0) * 1e3 == Approx(decode + (18 + 24 * 0.5) - beside));
  // Beyond the table's largest chunk: its last slope, 20/192 ms a token.
  CHECK(clock.step_s(tp_step(3, 512, 512), 0) * 1e3 ==
        Approx(decode + 60 + 256 * 20.0 / 192 - beside));
  // A table below the decode step beside it adds nothing: never below the decode step.
  curves_clock_options cheap;
  cheap.prefill = prefill_table({{parallel_mode::tp, 16, 1}}, "cheap");
  const curves_step_clock low(hand_curves(), model, cheap);
  CHECK(low.step_s(tp_step(3, 40, 512), 0) * 1e3 == Approx(decode));
  // A decode step is untouched by the table (at its bucket, 4: 14 ms).
  CHECK(clock.step_s(tp_step(3, 3, 512), 0) * 1e3 == Approx(14));

  // EP at P = 2, split: rank 0 prefills 32 tokens beside one decode (33 rows, 2 sequences),
  // rank 1 decodes 3. Rank 0: curve(4, ctx) + table(33 rows: its own) - curve(4, 512) =
  // table(33) (EP has one context); rank 1 eager at its own 3 (no bucket): curve(6).
  step_cost ep;
  ep.mode = parallel_mode::ep;
  ep.num_ranks = 2;
  ep.ranks = {{2, 33, 512 + 40}, {3, 3, 3 * 512}};
  ep.num_sequences = 5;
  ep.new_tokens = 36;
  ep.context_tokens = 512 + 40 + 3 * 512;
  const double rank0 = log_lerp(33, 16, 20, 64, 30);
  CHECK(clock.step_s(ep, 0) * 1e3 == Approx(std::max(rank0, log_lerp(6, 2, 8, 8, 12))));
  CHECK(rank0 > 20);
  // Without the table: rank 0's 66 rows in the curves' terms, less its 4 sequences.
  CHECK(rows.step_s(ep, 0) * 1e3 == Approx(20 + (66 - 32) * 8.0 / 24));
  // A configuration without points keeps the extra rows: EP points absent.
  curves_clock_options tp_only = o;
  tp_only.prefill = prefill_table({{parallel_mode::tp, 16, 30}}, "tp only");
  const curves_step_clock partial(hand_curves(), model, tp_only);
  CHECK(partial.step_s(ep, 0) == Approx(rows.step_s(ep, 0)));
  CHECK_THAT(partial.name(), Catch::Contains("other configurations: extra rows of the curve"));
}
