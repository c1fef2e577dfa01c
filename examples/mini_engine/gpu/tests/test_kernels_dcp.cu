// Decode context parallelism in the kernels: the merge of a DCP set's partial attentions
// (dcp_merge) against a host reference in double, and kv_append + paged attention over each
// member's share of the pages (every kernel: simple, split, tensor cores; LSE out) merged
// across the set, against the attention over every position, computed on the host from where
// the interleave rule puts each position (written here from the rule, not from kv_geometry).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <moebius/kv/page_table.hpp>
#include <numeric>
#include <vector>

#include "gpu_test_util.hpp"
#include "kernel_test_util.hpp"
#include "kernels/kernels.hpp"
#include "tests/catch.hpp"

using namespace mini_engine::gpu;
using namespace mini_engine::gpu::testing;
using moebius::dtype;
using moebius::parallel_mode;

namespace {

constexpr double neg_inf = -std::numeric_limits<double>::infinity();

float elem_of(const std::vector<std::byte>& pool, int64_t off, dtype t) {
  if (t == dtype::bf16) {
    uint16_t b;
    std::memcpy(&b, pool.data() + off, 2);
    return from_bf16(b);
  }
  float f;
  std::memcpy(&f, pool.data() + off, 4);
  return f;
}

void set_elem_of(std::vector<std::byte>& pool, int64_t off, dtype t, float v) {
  if (t == dtype::bf16) {
    const uint16_t b = to_bf16(v);
    std::memcpy(pool.data() + off, &b, 2);
  } else {
    std::memcpy(pool.data() + off, &v, 4);
  }
}

// The merge of parts (o_s, lse_s) by the definition of a softmax over the union of the parts'
// positions: each part's share of the total exp-sum is exp(lse_s) / sum_j exp(lse_j), taken
// relative to the largest LSE in double. Empty parts (-inf) have share 0; all empty: 0.
std::vector<double> merge_reference(const std::vector<std::vector<double>>& o,
                                    const std::vector<double>& lse) {
  std::vector<double> out(o.empty() ? 0 : o[0].size(), 0.0);
  double top = -INFINITY;
  for (double l : lse) top = std::max(top, l);
  if (top == -INFINITY) return out;
  double total = 0;
  for (double l : lse) total += l == -INFINITY ? 0.0 : std::exp(l - top);
  for (size_t s = 0; s < o.size(); ++s) {
    if (lse[s] == -INFINITY) continue;
    const double share = std::exp(lse[s] - top) / total;
    for (size_t d = 0; d < out.size(); ++d) out[d] += share * o[s][d];
  }
  return out;
}

}  // namespace

// Random parts (1..8, some empty, LSEs spread over tens of units so one part dominates at
// times), strides with padding, a cut num_tokens: every real element against the reference,
// every padding row left as poisoned, and the doc example exactly.
TEST_CASE("dcp_merge matches the host reference of the LSE merge", "[gpu][kernels][dcp]") {
  std::mt19937_64 rng(seed(40));
  {  // kernels.hpp's example: lse {0, log 3}, parts {[1], [5]} -> [4]
    auto p0 = to_device(std::vector<float>{1.0f}), p1 = to_device(std::vector<float>{5.0f});
    auto l0 = to_device(std::vector<float>{0.0f});
    auto l1 = to_device(std::vector<float>{std::log(3.0f)});
    device_buffer out(4);
    dcp_merge_args a;
    a.parts[0] = p0.as<float>();
    a.parts[1] = p1.as<float>();
    a.part_lse[0] = l0.as<float>();
    a.part_lse[1] = l1.as<float>();
    a.num_parts = 2;
    a.part_stride = a.lse_stride = a.out_stride = 1;
    a.tokens = a.heads = a.head_dim = 1;
    a.out = out.as<float>();
    launch_dcp_merge(a, nullptr);
    REQUIRE(std::fabs(download<float>(out, 1)[0] - 4.0f) <= 1e-5f);
  }
  for (int round = 0; round < 60; ++round) {
    const int parts = static_cast<int>(uniform(rng, 1, dcp_merge_args::max_parts));
    const int64_t tokens = uniform(rng, 1, 40), heads = uniform(rng, 1, 6);
    const int64_t D = uniform(rng, 1, 160);
    const int64_t part_stride = heads * D + uniform(rng, 0, 9);
    const int64_t lse_stride = heads + uniform(rng, 0, 3);
    const int64_t out_stride = heads * D + uniform(rng, 0, 9);
    const int64_t real = uniform(rng, 1, tokens);
    std::vector<std::vector<float>> o(static_cast<size_t>(parts)), l(static_cast<size_t>(parts));
    for (int s = 0; s < parts; ++s) {
      o[static_cast<size_t>(s)] = random_floats(rng, static_cast<size_t>(tokens * part_stride), -3, 3);
      l[static_cast<size_t>(s)] = random_floats(rng, static_cast<size_t>(tokens * lse_stride), -20, 30);
    }
    // Empty parts: a (token, head) a member sees no position of; now and then all of them.
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const bool all_empty = uniform(rng, 0, 15) == 0;
        for (int s = 0; s < parts; ++s)
          if (all_empty || uniform(rng, 0, 3) == 0)
            l[static_cast<size_t>(s)][static_cast<size_t>(t * lse_stride + h)] = -INFINITY;
      }
    std::vector<device_buffer> dparts, dlse;
    dcp_merge_args a;
    for (int s = 0; s < parts; ++s) {
      dparts.push_back(to_device(o[static_cast<size_t>(s)]));
      dlse.push_back(to_device(l[static_cast<size_t>(s)]));
      a.parts[s] = dparts.back().as<float>();
      a.part_lse[s] = dlse.back().as<float>();
    }
    auto dn = to_device(std::vector<int32_t>{static_cast<int32_t>(real)});
    device_buffer dout(tokens * out_stride * 4);  // poisoned: NaN
    a.num_parts = parts;
    a.part_stride = part_stride;
    a.lse_stride = lse_stride;
    a.tokens = tokens;
    a.heads = heads;
    a.head_dim = D;
    a.num_tokens = dn.as<int32_t>();
    a.out = dout.as<float>();
    a.out_stride = out_stride;
    launch_dcp_merge(a, nullptr);
    const auto out = download<float>(dout, static_cast<size_t>(tokens * out_stride));
    std::vector<float> got;
    std::vector<double> want;
    for (int64_t t = 0; t < real; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        std::vector<std::vector<double>> po(static_cast<size_t>(parts));
        std::vector<double> pl(static_cast<size_t>(parts));
        for (int s = 0; s < parts; ++s) {
          pl[static_cast<size_t>(s)] = l[static_cast<size_t>(s)][static_cast<size_t>(t * lse_stride + h)];
          for (int64_t d = 0; d < D; ++d)
            po[static_cast<size_t>(s)].push_back(
                o[static_cast<size_t>(s)][static_cast<size_t>(t * part_stride + h * D + d)]);
        }
        const std::vector<double> m = merge_reference(po, pl);
        for (int64_t d = 0; d < D; ++d) {
          got.push_back(out[static_cast<size_t>(t * out_stride + h * D + d)]);
          want.push_back(m[static_cast<size_t>(d)]);
        }
      }
    INFO("round " << round << " parts " << parts << " tokens " << tokens << " real " << real
                  << " heads " << heads << " D " << D);
    // fp32: the weights carry a few ulps of LSEs up to 30 (~1e-6 relative), on parts up to 3.
    REQUIRE(mismatches(got, want, 5e-5, 5e-5, "dcp_merge") == 0);
    // Rows past num_tokens and the stride padding: untouched (still the poison's NaN).
    int64_t touched = 0;
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t i = 0; i < out_stride; ++i)
        if (t >= real || i >= heads * D)
          touched += !std::isnan(out[static_cast<size_t>(t * out_stride + i)]);
    REQUIRE(touched == 0);
  }
}

// One DCP set of a TP head slice (H_kv < P): each member k holds logical pages k, k + dcp, ..
// of every row in a pool of its own, its table row listing them in order. kv_append of the
// step's tokens on every member (each stores only the tokens of its pages), each kernel's
// partial attention with LSE on every member, dcp_merge of the parts; against the host: the
// pools after the append byte for byte, each part's output and LSE over the member's
// positions (empty parts: 0 and -inf), the merge against the attention over every position.
TEST_CASE("kv_append and paged attention over DCP shares, merged, match the host reference",
          "[gpu][kernels][dcp]") {
  std::mt19937_64 rng(seed(41));
  for (int round = 0; round < 40; ++round) {
    // Rounds 24..39: the tensor-core kernel's shapes (bf16, head_dim 64 or 128).
    const bool tc_round = round >= 24;
    moebius::kv_geometry g;
    g.num_kv_heads = uniform(rng, 1, 2);
    const int64_t replicas = int64_t{2} << uniform(rng, 0, 1);  // TP ranks of one head: 2, 4
    g.num_ranks = static_cast<int>(g.num_kv_heads * replicas);
    const int64_t dcp = uniform(rng, 0, 1) == 0 ? 2 : replicas;
    const int64_t d_choices[] = {16, 64, 128, 40};
    g.head_dim = tc_round ? d_choices[uniform(rng, 1, 2)] : d_choices[uniform(rng, 0, 3)];
    const int64_t ps_choices[] = {1, 4, 16};
    g.page_size = ps_choices[uniform(rng, 0, 2)];
    g.num_layers = uniform(rng, 1, 3);
    g.type = tc_round || uniform(rng, 0, 1) ? dtype::bf16 : dtype::fp32;
    g.layout = uniform(rng, 0, 1) ? moebius::kv_layout::nhd : moebius::kv_layout::hnd;
    g.dcp = dcp;
    const parallel_mode mode = parallel_mode::tp;
    const bool prefill = uniform(rng, 0, 2) == 0;
    const int64_t layer = uniform(rng, 0, g.num_layers - 1);
    // The set's q heads, all on the slice's one KV head (TP page head 0): group >= q_heads.
    const int64_t q_heads = uniform(rng, 1, 12);
    const int64_t group = q_heads + uniform(rng, 0, 1) * uniform(rng, 0, 4);
    const int64_t rows = prefill ? 1 : uniform(rng, 1, 12);
    const int64_t chunk = prefill ? uniform(rng, 1, 20) : 1;
    const int64_t tokens = rows * chunk;
    // Short rows now and then: members of index > 0 then hold nothing a token sees.
    std::vector<int64_t> length(static_cast<size_t>(rows));
    int64_t max_pages = 1, total_pages = 0;
    for (auto& l : length) {
      l = uniform(rng, chunk, uniform(rng, 0, 2) == 0 ? chunk + g.page_size : (tc_round ? 400 : 80));
      max_pages = std::max(max_pages, moebius::pages_for_tokens(l, g.page_size));
      total_pages += moebius::pages_for_tokens(l, g.page_size);
    }
    g.num_ep_pages = total_pages + uniform(rng, 0, 5);  // TP: H_kv x that many pages
    moebius::validate(g);
    INFO("round " << round << " " << g << " q heads " << q_heads << " group " << group << " tokens " << tokens
                  << " prefill " << prefill);
    // The interleave rule: position s is on member (s / page_size) % dcp, at its local page
    // (s / page_size) / dcp, slot s % page_size.
    auto member_of = [&](int64_t s) { return (s / g.page_size) % dcp; };
    auto local_of = [&](int64_t s) { return (s / g.page_size) / dcp; };
    // Each member's table rows (its pages, random ids of its pool) and pool (random).
    std::vector<std::vector<int32_t>> tables(static_cast<size_t>(dcp));
    std::vector<std::vector<std::byte>> pools(static_cast<size_t>(dcp));
    const int64_t pages = g.num_pages(mode);
    for (int64_t k = 0; k < dcp; ++k) {
      std::vector<int32_t> perm(static_cast<size_t>(pages));
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      auto& tab = tables[static_cast<size_t>(k)];
      tab.assign(static_cast<size_t>(rows * max_pages), -1);
      int64_t next = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t p = k; p < moebius::pages_for_tokens(length[static_cast<size_t>(r)], g.page_size);
             p += dcp)
          tab[static_cast<size_t>(r * max_pages + p / dcp)] = perm[static_cast<size_t>(next++)];
      auto& pool = pools[static_cast<size_t>(k)];
      pool.resize(static_cast<size_t>(g.pool_bytes()));
      for (int64_t off = 0; off + moebius::dtype_bytes(g.type) <= g.pool_bytes();
           off += moebius::dtype_bytes(g.type))
        set_elem_of(pool, off, g.type, std::uniform_real_distribution<float>(-1, 1)(rng));
    }
    std::vector<int32_t> seq(static_cast<size_t>(tokens)), pos(static_cast<size_t>(tokens));
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t r = t / chunk;
      seq[static_cast<size_t>(t)] = static_cast<int32_t>(r);
      pos[static_cast<size_t>(t)] =
          static_cast<int32_t>(length[static_cast<size_t>(r)] - chunk + t % chunk);
    }
    const int64_t stride = g.head_dim + 3;  // one KV head per TP page
    auto k_new = random_floats(rng, static_cast<size_t>(tokens * stride));
    auto v_new = random_floats(rng, static_cast<size_t>(tokens * stride));
    auto q = random_floats(rng, static_cast<size_t>(tokens * q_heads * g.head_dim), -2, 2);
    const int64_t real = uniform(rng, 1, tokens);

    auto dseq = to_device(seq);
    auto dpos = to_device(pos);
    auto dn = to_device(std::vector<int32_t>{static_cast<int32_t>(real)});
    auto dk = to_device(k_new);
    auto dv = to_device(v_new);
    auto dq = to_device(q);
    std::vector<device_buffer> dpools, dtabs;
    std::vector<paged_tokens> toks;
    for (int64_t k = 0; k < dcp; ++k) {
      dpools.push_back(to_device(pools[static_cast<size_t>(k)]));
      dtabs.push_back(to_device(tables[static_cast<size_t>(k)]));
      paged_tokens tok{dseq.as<int32_t>(), dpos.as<int32_t>(), dtabs.back().as<int32_t>(),
                       max_pages,          tokens,           dn.as<int32_t>(),
                       dcp,                k};
      toks.push_back(tok);
      kv_append_args ka;
      ka.k = dk.as<float>();
      ka.v = dv.as<float>();
      ka.stride = stride;
      ka.heads = 1;
      ka.head0 = 0;
      ka.pool = dpools.back().as<std::byte>();
      ka.geometry = g;
      ka.mode = mode;
      ka.layer = layer;
      ka.tok = tok;
      launch_kv_append(ka, nullptr);
    }
    // The host's append: each token on the member of its position's page only.
    for (int64_t t = 0; t < real; ++t) {
      const int64_t p = pos[static_cast<size_t>(t)], k = member_of(p);
      const int32_t page = tables[static_cast<size_t>(k)][static_cast<size_t>(
          seq[static_cast<size_t>(t)] * max_pages + local_of(p))];
      for (int64_t d = 0; d < g.head_dim; ++d) {
        set_elem_of(pools[static_cast<size_t>(k)],
                    g.offset(mode, layer, moebius::kv_tensor::k, page, 0, p % g.page_size, d),
                    g.type, k_new[static_cast<size_t>(t * stride + d)]);
        set_elem_of(pools[static_cast<size_t>(k)],
                    g.offset(mode, layer, moebius::kv_tensor::v, page, 0, p % g.page_size, d),
                    g.type, v_new[static_cast<size_t>(t * stride + d)]);
      }
    }
    for (int64_t k = 0; k < dcp; ++k) {
      const auto after = download<std::byte>(dpools[static_cast<size_t>(k)],
                                             pools[static_cast<size_t>(k)].size());
      INFO("member " << k << "'s pool after kv_append");
      REQUIRE(std::memcmp(after.data(), pools[static_cast<size_t>(k)].data(), after.size()) == 0);
    }

    // The host reference per real (token, q head): scores over every visible position, each
    // part (a member's positions) with its output and LSE, and the whole.
    const double scale = 1.0 / std::sqrt(static_cast<double>(g.head_dim));
    const int64_t D = g.head_dim;
    std::vector<std::vector<double>> part_out(static_cast<size_t>(dcp)),
        part_lse(static_cast<size_t>(dcp));
    std::vector<double> whole;
    for (int64_t t = 0; t < real; ++t)
      for (int64_t h = 0; h < q_heads; ++h) {
        const int64_t last = pos[static_cast<size_t>(t)];
        std::vector<double> score(static_cast<size_t>(last + 1));
        std::vector<std::vector<double>> val(static_cast<size_t>(last + 1));
        for (int64_t s = 0; s <= last; ++s) {
          const int64_t k = member_of(s);
          const int32_t page = tables[static_cast<size_t>(k)][static_cast<size_t>(
              seq[static_cast<size_t>(t)] * max_pages + local_of(s))];
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) {
            dot += double{q[static_cast<size_t>((t * q_heads + h) * D + d)]} *
                   elem_of(pools[static_cast<size_t>(k)],
                           g.offset(mode, layer, moebius::kv_tensor::k, page, 0, s % g.page_size, d),
                           g.type);
            val[static_cast<size_t>(s)].push_back(elem_of(
                pools[static_cast<size_t>(k)],
                g.offset(mode, layer, moebius::kv_tensor::v, page, 0, s % g.page_size, d), g.type));
          }
          score[static_cast<size_t>(s)] = dot * scale;
        }
        // A softmax over the positions `in` picks: (output, lse), or (0, -inf) for none.
        auto softmax_over = [&](auto in) {
          double mx = neg_inf;
          for (int64_t s = 0; s <= last; ++s)
            if (in(s)) mx = std::max(mx, score[static_cast<size_t>(s)]);
          std::vector<double> o(static_cast<size_t>(D), 0.0);
          if (mx == neg_inf) return std::pair{o, neg_inf};
          double sum = 0;
          for (int64_t s = 0; s <= last; ++s)
            if (in(s)) sum += std::exp(score[static_cast<size_t>(s)] - mx);
          for (int64_t s = 0; s <= last; ++s)
            if (in(s))
              for (int64_t d = 0; d < D; ++d)
                o[static_cast<size_t>(d)] += std::exp(score[static_cast<size_t>(s)] - mx) / sum *
                                             val[static_cast<size_t>(s)][static_cast<size_t>(d)];
          return std::pair{o, mx + std::log(sum)};
        };
        for (int64_t k = 0; k < dcp; ++k) {
          const auto [o, l] = softmax_over([&](int64_t s) { return member_of(s) == k; });
          part_out[static_cast<size_t>(k)].insert(part_out[static_cast<size_t>(k)].end(), o.begin(),
                                                  o.end());
          part_lse[static_cast<size_t>(k)].push_back(l);
        }
        const auto [o, l] = softmax_over([](int64_t) { return true; });
        whole.insert(whole.end(), o.begin(), o.end());
      }

    // Every kernel: the simple one, the GQA kernel over one range, the split kernel with the
    // automatic and a forced range count, and the tensor-core kernel the same three ways
    // (where the shape allows it).
    struct variant {
      const char* name;
      bool simple, tensor_cores, workspace;
      int64_t splits;
    };
    std::vector<variant> variants = {{"simple", true, false, false, 0},
                                     {"GQA, one range", false, false, false, 0},
                                     {"split, automatic", false, false, true, 0},
                                     {"split, forced", false, false, true, uniform(rng, 1, max_pages)}};
    paged_attention_args base;
    base.q = dq.as<float>();
    base.q_stride = q_heads * D;
    base.q_heads = q_heads;
    base.group = group;
    base.out_stride = q_heads * D;
    base.geometry = g;
    base.mode = mode;
    base.layer = layer;
    base.scale = static_cast<float>(scale);
    base.lse_stride = q_heads;
    {
      paged_attention_args ta = base;
      ta.tok = toks[0];
      ta.tensor_cores = true;
      ta.tensor_core_min_tokens = 1;
      const bool tc = paged_attention_uses_tensor_cores(ta);
      if (tc_round) REQUIRE(tc);
      if (tc) {
        variants.push_back({"tensor cores, one range", false, true, false, 0});
        variants.push_back({"tensor cores, automatic", false, true, true, 0});
        variants.push_back({"tensor cores, forced", false, true, true, uniform(rng, 1, max_pages)});
      }
    }
    for (const variant& v : variants) {
      INFO("kernel: " << v.name << ", splits " << v.splits);
      std::vector<device_buffer> outs, lses, works;
      for (int64_t k = 0; k < dcp; ++k) {
        paged_attention_args a = base;
        a.tok = toks[static_cast<size_t>(k)];
        a.pool = dpools[static_cast<size_t>(k)].as<std::byte>();
        a.simple = v.simple;
        a.tensor_cores = v.tensor_cores;
        a.tensor_core_min_tokens = 1;
        a.splits = v.splits;
        const int64_t wf = v.workspace ? paged_attention_workspace_floats(a) : 0;
        works.emplace_back(std::max<int64_t>(wf, 1) * 4);
        a.workspace = v.workspace ? works.back().as<float>() : nullptr;
        outs.emplace_back(tokens * q_heads * D * 4);
        lses.emplace_back(tokens * q_heads * 4);
        a.out = outs.back().as<float>();
        a.lse = lses.back().as<float>();
        launch_paged_attention(a, nullptr);
      }
      device_buffer merged(tokens * q_heads * D * 4);
      dcp_merge_args m;
      m.num_parts = static_cast<int>(dcp);
      for (int64_t k = 0; k < dcp; ++k) {
        m.parts[k] = outs[static_cast<size_t>(k)].as<float>();
        m.part_lse[k] = lses[static_cast<size_t>(k)].as<float>();
      }
      m.part_stride = q_heads * D;
      m.lse_stride = q_heads;
      m.tokens = tokens;
      m.heads = q_heads;
      m.head_dim = D;
      m.num_tokens = dn.as<int32_t>();
      m.out = merged.as<float>();
      m.out_stride = q_heads * D;
      launch_dcp_merge(m, nullptr);
      auto real_rows = [&](const device_buffer& b, int64_t width) {
        auto all = download<float>(b, static_cast<size_t>(tokens * width));
        all.resize(static_cast<size_t>(real * width));
        return all;
      };
      for (int64_t k = 0; k < dcp; ++k) {
        INFO("member " << k);
        const std::vector<float> lse_got = real_rows(lses[static_cast<size_t>(k)], q_heads);
        int64_t empty = 0, lse_bad = 0;
        for (size_t i = 0; i < lse_got.size(); ++i) {
          const double want = part_lse[static_cast<size_t>(k)][i];
          if (want == -INFINITY) {
            ++empty;
            lse_bad += lse_got[i] != -INFINITY;
          } else {
            lse_bad += !(std::fabs(lse_got[i] - want) <= 1e-4 + 1e-4 * std::fabs(want));
          }
        }
        INFO(empty << " empty (token, head) parts of " << lse_got.size());
        REQUIRE(lse_bad == 0);
        REQUIRE(mismatches(real_rows(outs[static_cast<size_t>(k)], q_heads * D),
                           part_out[static_cast<size_t>(k)], 2e-5, 2e-4, "part") == 0);
      }
      REQUIRE(mismatches(real_rows(merged, q_heads * D), whole, 2e-5, 2e-4, "merged") == 0);
    }
  }
}
