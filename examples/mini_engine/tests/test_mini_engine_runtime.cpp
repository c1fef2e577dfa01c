// The host runtime against the float64 reference, in EP and in TP over P in {1, 2, 4}, and
// EP against TP, for random small models; every static layout (attention by the tables,
// experts by the cursor, TP over each allowed KV-parallel degree) against the reference and
// each other, with each TP rank's pool checked byte by byte against its DCP share.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <vector>

#include "catch.hpp"
#include "driver.hpp"
#include "host_runtime.hpp"
#include "kv_pages.hpp"
#include "layouts.hpp"
#include "model_config.hpp"
#include "numerics.hpp"
#include "random_model.hpp"
#include "reference.hpp"
#include "weights.hpp"

using namespace mini_engine;
using mini_engine::testing::drive;
using mini_engine::testing::layout_case;
using mini_engine::testing::pick;
using mini_engine::testing::random_config;
using mini_engine::testing::static_state;
using moebius::dtype;
using moebius::parallel_mode;

namespace {

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// One element of K or V as a double (fp32 or bf16 bytes).
double kv_value(const std::byte* p, dtype t) {
  if (t == dtype::fp32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t u;
  std::memcpy(&u, p, 2);
  return from_bf16(u);
}

bool all_poison(const std::byte* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (p[i] != std::byte{0xff}) return false;
  return true;
}

// Checks every byte of a TP run's pools (poisoned before it ran) against its DCP shares, with
// its own arithmetic (not the runtime's): TP rank r of DCP index k = r % dcp lists, of a
// sequence of n pages, ceil((n - k) / dcp) pages, its local page i being logical page
// i * dcp + k; each position p < `written` of such a page holds, for each head of the rank's
// slice, the K/V the EP run `ep` stored for p (layer 0 bitwise: the same inputs; later layers
// within tol, whose inputs may differ by a rounding). Every other byte of the pool (pages not
// listed, slots past the sequence's tokens) is still poison. `written[q]`: positions of seq_id
// 100 + q both runs wrote from the same tokens. Returns the number of K/V rows compared.
int64_t check_tp_shares(const host_runtime& rt, const moebius::kv_state& tp,
                        const host_runtime& ep_rt, const moebius::kv_state& ep,
                        const std::vector<int64_t>& written, double tol) {
  const moebius::kv_geometry& g = rt.kv();
  const model_config& c = rt.config();
  const int P = rt.num_ranks();
  const int64_t ps = g.page_size, dcp = g.dcp, D = c.head_dim;
  const int64_t split = std::min<int64_t>(c.num_kv_heads, P);  // head slices
  const int64_t slice_heads = c.num_kv_heads / split;
  const int64_t row_bytes = D * moebius::dtype_bytes(c.kv_dtype);
  int64_t compared = 0;
  const std::vector<moebius::rank_memory> mem = const_cast<host_runtime&>(rt).memory();
  const std::vector<moebius::rank_memory> ep_mem = const_cast<host_runtime&>(ep_rt).memory();
  for (int r = 0; r < P; ++r) {
    const std::byte* pool =
        mem[static_cast<size_t>(r)].space(moebius::memory_space::kv_pool).data();
    const int64_t k = r % dcp, slice = r * split / P;
    std::vector<char> listed(static_cast<size_t>(g.num_tp_pages()), 0);
    // Which bytes of a listed page hold a token: the rest must stay poison too.
    std::vector<int64_t> used_slots(static_cast<size_t>(g.num_tp_pages()), 0);
    for (const moebius::kv_sequence& q : tp.ranks[static_cast<size_t>(r)].sequences) {
      const int64_t n = (q.num_tokens + ps - 1) / ps;
      INFO("rank " << r << " sequence " << q.seq_id << " of " << q.num_tokens << " tokens");
      REQUIRE(q.num_pages() == (n > k ? (n - k + dcp - 1) / dcp : 0));
      const moebius::kv_sequence* eq = nullptr;
      for (int o = 0; o < P && !eq; ++o) eq = find_sequence(ep, o, q.seq_id);
      REQUIRE(eq != nullptr);
      const int owner = owner_of(ep, q.seq_id);
      const std::byte* ep_pool =
          ep_mem[static_cast<size_t>(owner)].space(moebius::memory_space::kv_pool).data();
      for (int64_t i = 0; i < q.num_pages(); ++i) {
        const int64_t page = q.pages[static_cast<size_t>(i)], logical = i * dcp + k;
        listed[static_cast<size_t>(page)] = 1;
        used_slots[static_cast<size_t>(page)] = std::min(ps, q.num_tokens - logical * ps);
        for (int64_t slot = 0; slot < used_slots[static_cast<size_t>(page)]; ++slot) {
          const int64_t pos = logical * ps + slot;
          if (pos >= written[static_cast<size_t>(q.seq_id - 100)]) continue;
          for (int64_t l = 0; l < c.num_layers; ++l)
            for (moebius::kv_tensor t : {moebius::kv_tensor::k, moebius::kv_tensor::v})
              for (int64_t h = 0; h < slice_heads; ++h) {
                const std::byte* got = pool + g.offset(parallel_mode::tp, l, t, page, h, slot, 0);
                const std::byte* want = ep_pool + g.offset(parallel_mode::ep, l, t,
                                                           eq->pages[static_cast<size_t>(logical)],
                                                           slice * slice_heads + h, slot, 0);
                ++compared;
                if (l == 0) {
                  REQUIRE(std::memcmp(got, want, static_cast<size_t>(row_bytes)) == 0);
                  continue;
                }
                for (int64_t d = 0; d < D; ++d) {
                  const int64_t at = d * moebius::dtype_bytes(c.kv_dtype);
                  const double a = kv_value(want + at, c.kv_dtype),
                               b = kv_value(got + at, c.kv_dtype);
                  REQUIRE(std::fabs(a - b) <= tol * std::max(1.0, std::fabs(a)));
                }
              }
        }
      }
    }
    // Unlisted pages entirely, and the slots of listed pages past their sequence's tokens.
    for (int64_t page = 0; page < g.num_tp_pages(); ++page)
      for (int64_t l = 0; l < c.num_layers; ++l)
        for (moebius::kv_tensor t : {moebius::kv_tensor::k, moebius::kv_tensor::v})
          for (int64_t h = 0; h < slice_heads; ++h)
            for (int64_t slot = used_slots[static_cast<size_t>(page)]; slot < ps; ++slot) {
              INFO("rank " << r << " page " << page
                           << (listed[static_cast<size_t>(page)] ? " (listed)" : "") << " layer "
                           << l << " head " << h << " slot " << slot);
              REQUIRE(all_poison(pool + g.offset(parallel_mode::tp, l, t, page, h, slot, 0),
                                 row_bytes));
            }
  }
  return compared;
}

// Checks a run's logits against the float64 reference, teacher-forced on the run's own
// tokens: within tol * max(1, max |reference logit|), and each greedy token the reference's
// argmax unless the reference ranks it within twice that of its argmax (a near tie). Every
// token the reference's argmax at every step means the run is the reference's greedy
// continuation. Returns the near ties.
int64_t check_against_reference(const model_weights& w,
                                const std::vector<std::vector<int32_t>>& prompts,
                                const std::vector<mini_engine::testing::sequence_run>& runs,
                                double tol) {
  int64_t near_ties = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    const size_t n = prompts[i].size() + runs[i].generated.size() - 1;  // tokens fed
    const auto ref = reference_logits(w, std::span<const int32_t>(runs[i].tokens).first(n));
    for (size_t s = 0; s < runs[i].generated.size(); ++s) {
      const std::vector<double>& row = ref[prompts[i].size() - 1 + s];
      const double scale = std::max(1.0, max_abs(row));
      const auto best = static_cast<size_t>(std::max_element(row.begin(), row.end()) - row.begin());
      const auto got = static_cast<size_t>(runs[i].generated[s]);
      INFO("sequence " << i << " sample " << s << ": token " << got << ", reference argmax "
                       << best);
      if (got != best) {
        REQUIRE(row[best] - row[got] <= 2 * tol * scale);
        ++near_ties;
      }
      double err = 0;
      for (size_t v = 0; v < row.size(); ++v) {
        const double e = std::fabs(static_cast<double>(runs[i].logits[s][v]) - row[v]);
        if (!(e <= err)) err = e;  // a NaN (a poisoned K/V read) sticks
      }
      INFO("max error " << err << " scale " << scale);
      REQUIRE(err <= tol * scale);
    }
  }
  return near_ties;
}

}  // namespace

TEST_CASE("host runtime matches the float64 reference in EP and TP", "[runtime]") {
  struct variant {
    dtype experts, kv;
    double tolerance;  // relative to the logits' scale
  };
  // Experts are rounded in the weights the reference reads, so every variant is compared at
  // float accuracy; bf16 KV is rounded by both, from a float and from a double.
  const variant variants[] = {{dtype::fp32, dtype::fp32, 1e-4},
                              {dtype::bf16, dtype::fp32, 1e-4},
                              {dtype::fp8_e4m3, dtype::fp32, 1e-4},
                              {dtype::fp32, dtype::bf16, 2e-2}};
  std::mt19937_64 rng(20240611);
  for (const variant& var : variants)
    for (int P : {1, 2, 4})
      for (int trial = 0; trial < 2; ++trial) {
        const model_config c = random_config(rng, P, var.experts, var.kv);
        const model_weights w = make_weights(c, rng());
        const auto prompts = mini_engine::testing::random_prompts(rng, 3, 9, c.vocab);
        const int64_t chunk = pick(rng, {1, 3, 16});
        for (parallel_mode mode : {parallel_mode::ep, parallel_mode::tp}) {
          std::ostringstream what;
          what << c << " P=" << P << " " << moebius::to_string(mode) << " chunk " << chunk;
          INFO(what.str());
          host_runtime_options o;
          o.num_ranks = P;
          o.num_ep_pages = 32;
          o.cursor = moebius::arena_cursor{mode == parallel_mode::tp ? c.num_layers : 0};
          host_runtime rt(w, o);
          static_state st(rt, mode);
          const auto runs = drive(rt, st.driver, prompts, chunk, 3);
          for (size_t i = 0; i < runs.size(); ++i) {
            REQUIRE(runs[i].generated.size() == 4);
            for (size_t s = 0; s < runs[i].generated.size(); ++s) {
              const size_t len = prompts[i].size() + s;  // tokens seen by that sample
              const auto ref =
                  reference_logits(w, std::span<const int32_t>(runs[i].tokens).first(len)).back();
              const double scale = std::max(1.0, max_abs(ref));
              const auto& got = runs[i].logits[s];
              REQUIRE(got.size() == ref.size());
              double err = 0;
              for (size_t v = 0; v < ref.size(); ++v)
                err = std::max(err, std::fabs(static_cast<double>(got[v]) - ref[v]));
              INFO("sequence " << i << " sample " << s << " max error " << err << " scale "
                               << scale);
              CHECK(err <= var.tolerance * scale);
            }
          }
        }
      }
}

TEST_CASE("EP and TP logits agree, also with a hybrid cursor", "[runtime]") {
  std::mt19937_64 rng(77);
  for (int P : {2, 4})
    for (int trial = 0; trial < 3; ++trial) {
      const model_config c = random_config(rng, P, dtype::fp32, dtype::fp32);
      const model_weights w = make_weights(c, rng());
      const auto prompts = mini_engine::testing::random_prompts(rng, 4, 7, c.vocab);
      std::vector<std::vector<mini_engine::testing::sequence_run>> results;
      // EP, TP, and hybrids: the experts half TP, half EP under TP and under EP attention.
      const std::pair<int64_t, parallel_mode> layouts[] = {
          {0, parallel_mode::ep},
          {c.num_layers, parallel_mode::tp},
          {c.num_layers / 2, parallel_mode::tp},
          {(c.num_layers + 1) / 2, parallel_mode::ep}};
      for (const auto& [cursor, mode] : layouts) {
        host_runtime_options o;
        o.num_ranks = P;
        o.cursor = moebius::arena_cursor{cursor};
        host_runtime rt(w, o);
        static_state st(rt, mode);
        st.cursor = moebius::arena_cursor{cursor};
        results.push_back(drive(rt, st.driver, prompts, 4, 4));
      }
      INFO(c << " P=" << P);
      for (size_t m = 1; m < results.size(); ++m)
        for (size_t i = 0; i < prompts.size(); ++i) {
          CHECK(results[m][i].generated == results[0][i].generated);
          for (size_t s = 0; s < results[0][i].logits.size(); ++s)
            for (size_t v = 0; v < results[0][i].logits[s].size(); ++v)
              REQUIRE(std::fabs(results[m][i].logits[s][v] - results[0][i].logits[s][v]) <=
                      1e-5f * std::max(1.0f, std::fabs(results[0][i].logits[s][v])));
        }
    }
}

TEST_CASE("a refused step throws and writes nothing", "[runtime]") {
  const model_weights w = make_weights(tiny(), 3);
  host_runtime_options o;
  o.num_ranks = 2;
  o.num_ep_pages = 8;
  host_runtime rt(w, o);
  for (parallel_mode mode : {parallel_mode::ep, parallel_mode::tp}) {
    static_state st(rt, mode);
    reserve_tokens(rt.kv(), st.tables, 1, 3, 1);
    const std::vector<int32_t> four = {1, 2, 3, 4}, bad = {1, 9999};
    auto snapshot = [&] {
      std::vector<std::vector<std::byte>> bytes;
      for (const auto& m : rt.memory())
        for (const auto& sp : m.spaces) bytes.emplace_back(sp.data(), sp.data() + sp.bytes);
      return bytes;
    };
    const auto before = snapshot();
    auto refused = [&](step_item it) {
      try {
        rt.step(step_layout{&st.tables, st.cursor}, std::span<const step_item>(&it, 1));
      } catch (const moebius::error& e) {
        return e.code() == moebius::errc::invalid_argument;
      }
      return false;
    };
    CHECK(refused(step_item{.seq_id = 1, .tokens = four, .start_position = 0, .sample = true}));
    CHECK(refused(step_item{.seq_id = 2, .tokens = std::span(four).first(1), .sample = true}));
    CHECK(refused(step_item{.seq_id = 1, .tokens = bad, .sample = true}));
    CHECK(refused(step_item{.seq_id = 1, .tokens = {}, .sample = true}));
    CHECK(snapshot() == before);
    // The same tables with room: accepted.
    CHECK(rt.step(step_layout{&st.tables, st.cursor},
                  std::vector<step_item>{
                      {.seq_id = 1, .tokens = std::span(four).first(3), .sample = true}})[0] >= 0);
  }
}

TEST_CASE("every static layout gives the reference's tokens; TP(dcp) ranks hold only their shares",
          "[runtime][dcp]") {
  // Attention by the tables and experts by the cursor in all four combinations, and TP attention
  // over every KV-parallel degree the model allows, with TP and with EP experts: each against
  // the float64 reference (logits, greedy tokens), against EP/EP (logits within 1e-5 and equal
  // tokens up to a near tie: host_runtime.hpp says why not bits with dcp > 1), and each TP
  // run's pools byte by byte against its ranks' shares (poisoned first).
  std::mt19937_64 rng(20260407);
  const auto t0 = std::chrono::steady_clock::now();
  int64_t dcp_layouts = 0, rows = 0, near_ties = 0, differing = 0, compared_logits = 0;
  double worst = 0;
  struct variant {
    dtype experts, kv;
    double ref_tol;    // against the reference (host runtime vs float64: the first test's)
    double share_tol;  // K/V of layers > 0 against EP's (one rounding of an input apart)
  };
  const variant variants[] = {{dtype::fp32, dtype::fp32, 1e-4, 1e-4},
                              {dtype::fp8_e4m3, dtype::fp32, 1e-4, 1e-4},
                              {dtype::bf16, dtype::bf16, 2e-2, 1e-2}};
  for (int P : {2, 4, 8})
    for (int round = 0; round < 2; ++round)
      for (const variant& var : variants) {
        model_config c;
        do c = random_config(rng, P, var.experts, var.kv);
        while (c.num_kv_heads >= P);  // replicated KV heads: some dcp > 1 is allowed
        const model_weights w = make_weights(c, rng());
        const auto prompts = mini_engine::testing::random_prompts(rng, 4, 20, c.vocab);
        const int64_t chunk = pick(rng, {1, 3, 5, 16});
        const int64_t decode = 5;
        std::unique_ptr<host_runtime> ep_rt;
        std::unique_ptr<static_state> ep_state;
        std::vector<mini_engine::testing::sequence_run> ep_runs;
        for (const layout_case& lay : mini_engine::testing::every_layout(c, P)) {
          INFO(c << " P=" << P << " chunk " << chunk << ": " << lay);
          auto rt = std::make_unique<host_runtime>(w, lay.options(P, 128));
          REQUIRE(rt->kv().dcp == lay.dcp);
          mini_engine::testing::poison_kv(*rt);
          auto st =
              std::make_unique<static_state>(*rt, lay.attention, moebius::arena_cursor{lay.cursor});
          const auto runs = drive(*rt, st->driver, prompts, chunk, decode);
          near_ties += check_against_reference(w, prompts, runs, var.ref_tol);
          if (!ep_rt) {  // EP/EP, the first layout: what the others are compared with
            ep_runs = runs;
            ep_rt = std::move(rt);
            ep_state = std::move(st);
            continue;
          }
          const auto a = mini_engine::testing::runs_agree(ep_runs, runs, 1e-5);
          INFO(a.why);
          REQUIRE(a.ok);
          near_ties += a.near_ties;
          worst = std::max(worst, a.max_rel);
          differing += a.differing;
          compared_logits += a.samples * c.vocab;
          dcp_layouts += lay.dcp > 1;
          if (lay.attention == parallel_mode::tp) {
            // Positions whose K/V both runs computed from the same tokens (up to a parting).
            std::vector<int64_t> written(prompts.size());
            for (size_t i = 0; i < prompts.size(); ++i) {
              const auto& x = ep_runs[i].tokens;
              const auto& y = runs[i].tokens;
              const size_t fed = std::min(x.size(), y.size()) - 1;
              written[i] = static_cast<int64_t>(
                  std::mismatch(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(fed), y.begin())
                      .first -
                  x.begin());
            }
            rows +=
                check_tp_shares(*rt, st->tables, *ep_rt, ep_state->tables, written, var.share_tol);
          }
        }
      }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf(
      "layouts: %lld TP(dcp > 1) runs, %lld K/V rows checked against their shares, "
      "%lld near ties; vs EP/EP: largest logit difference %.3g, %lld of %lld logits "
      "differ in bits (%.1f s)\n",
      static_cast<long long>(dcp_layouts), static_cast<long long>(rows),
      static_cast<long long>(near_ties), worst, static_cast<long long>(differing),
      static_cast<long long>(compared_logits), seconds);
  CHECK(dcp_layouts >= 24);
}

TEST_CASE("host_runtime_options::dcp: a degree the geometry does not allow is refused, naming dcp",
          "[runtime][dcp]") {
  model_config c = tiny();  // Hkv 2
  const model_weights w = make_weights(c, 9);
  auto refused = [&](int P, int64_t dcp) {
    host_runtime_options o;
    o.num_ranks = P;
    o.dcp = dcp;
    try {
      host_runtime rt(w, o);
    } catch (const moebius::error& e) {
      return e.code() == moebius::errc::invalid_argument &&
             std::string(e.what()).find("dcp") != std::string::npos;
    }
    return false;
  };
  CHECK(refused(2, 2));  // Hkv >= P: no replicas to split
  CHECK(refused(4, 3));  // must divide P / Hkv = 2
  CHECK(refused(4, 0));
  CHECK(refused(4, 4));
  host_runtime_options o;
  o.num_ranks = 4;
  o.dcp = 2;
  CHECK(host_runtime(w, o).kv().dcp == 2);
}
