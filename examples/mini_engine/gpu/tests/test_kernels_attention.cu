// The paged attention kernels (kv_append; the simple, split and tensor-core kernels and the
// merge) against a host reference in double, as in test_kernels.cu, and the split count.

#include <algorithm>
#include <cmath>
#include <cstring>
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

float elem(const std::vector<std::byte>& pool, int64_t off, dtype t) {
  if (t == dtype::bf16) {
    uint16_t b;
    std::memcpy(&b, pool.data() + off, 2);
    return from_bf16(b);
  }
  float f;
  std::memcpy(&f, pool.data() + off, 4);
  return f;
}
void set_elem(std::vector<std::byte>& pool, int64_t off, dtype t, float v) {
  if (t == dtype::bf16) {
    const uint16_t b = to_bf16(v);
    std::memcpy(pool.data() + off, &b, 2);
  } else {
    std::memcpy(pool.data() + off, &v, 4);
  }
}

}  // namespace

// A random paged-KV case: each token's sequence row, position and pages; the pool filled with
// random K/V for positions before each token; K/V of the tokens themselves appended by the
// kernel; attention checked against double.
TEST_CASE("kv_append and paged attention match the host reference", "[gpu][kernels]") {
  std::mt19937_64 rng(seed(13));
  for (int round = 0; round < 70; ++round) {
    // Rounds 40..69: shapes of the tensor-core kernel (bf16, head_dim 64 or 128), longer
    // contexts (several tiles per warp, ranges of several pages).
    const bool tc_round = round >= 40;
    moebius::kv_geometry g;
    const int P = static_cast<int>(uniform(rng, 1, 2)) * (round % 3 == 0 ? 2 : 1);
    const int64_t hkv_choices[] = {1, 2, 4};
    g.num_kv_heads = hkv_choices[uniform(rng, 0, 2)];
    if (g.num_kv_heads < P && P % g.num_kv_heads != 0) g.num_kv_heads = P;
    const int64_t d_choices[] = {16, 64, 128, 256, 40};
    g.head_dim = tc_round ? d_choices[uniform(rng, 1, 2)] : d_choices[uniform(rng, 0, 4)];
    const int64_t ps_choices[] = {1, 4, 16};
    g.page_size = ps_choices[uniform(rng, 0, 2)];
    g.num_layers = uniform(rng, 1, 3);
    g.num_ranks = P;
    g.type = tc_round || uniform(rng, 0, 1) ? dtype::bf16 : dtype::fp32;
    g.layout = uniform(rng, 0, 1) ? moebius::kv_layout::nhd : moebius::kv_layout::hnd;
    const parallel_mode mode = uniform(rng, 0, 1) ? parallel_mode::tp : parallel_mode::ep;
    const int rank = static_cast<int>(uniform(rng, 0, P - 1));
    const bool prefill = uniform(rng, 0, 2) == 0;
    const int64_t layer = uniform(rng, 0, g.num_layers - 1);
    const int64_t group = int64_t{1} << uniform(rng, 0, 4);  // up to 16: several GQA chunks
    // Heads this rank sees: EP all, TP its slice.
    const int64_t page_heads =
        mode == parallel_mode::ep ? g.heads_per_ep_page() : g.heads_per_tp_page();
    const int64_t q_heads = page_heads * group;
    // Sequences: decode: one token per row; prefill: one row, a chunk of consecutive tokens.
    const int64_t rows = prefill ? 1 : uniform(rng, 1, 12);
    const int64_t chunk = prefill ? uniform(rng, 1, 20) : 1;
    const int64_t tokens = rows * chunk;
    std::vector<int64_t> length(static_cast<size_t>(rows));  // tokens per row after the step
    int64_t max_pages = 1, total_pages = 0;
    for (auto& l : length) {
      l = uniform(rng, chunk, tc_round ? 400 : 80);
      max_pages = std::max(max_pages, moebius::pages_for_tokens(l, g.page_size));
      total_pages += moebius::pages_for_tokens(l, g.page_size);
    }
    // Enough pages in either mode (a TP pool has split x the EP page count).
    g.num_ep_pages = total_pages + uniform(rng, 0, 5);
    moebius::validate(g);
    const int64_t pages = g.num_pages(mode);
    std::vector<int32_t> perm(static_cast<size_t>(pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<int32_t> tables(static_cast<size_t>(rows * max_pages), -1);
    int64_t next = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t p = 0;
           p < moebius::pages_for_tokens(length[static_cast<size_t>(r)], g.page_size); ++p)
        tables[static_cast<size_t>(r * max_pages + p)] = perm[static_cast<size_t>(next++)];
    std::vector<int32_t> seq(static_cast<size_t>(tokens)), pos(static_cast<size_t>(tokens));
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t r = t / chunk;
      seq[static_cast<size_t>(t)] = static_cast<int32_t>(r);
      pos[static_cast<size_t>(t)] =
          static_cast<int32_t>(length[static_cast<size_t>(r)] - chunk + t % chunk);
    }
    // The pool, random everywhere (bytes that are not read stay random too).
    std::vector<std::byte> pool(static_cast<size_t>(g.pool_bytes()));
    for (int64_t off = 0; off + moebius::dtype_bytes(g.type) <= g.pool_bytes();
         off += moebius::dtype_bytes(g.type))
      set_elem(pool, off, g.type, std::uniform_real_distribution<float>(-1, 1)(rng));
    const int64_t stride = page_heads * g.head_dim + 3;
    auto k = random_floats(rng, static_cast<size_t>(tokens * stride));
    auto v = random_floats(rng, static_cast<size_t>(tokens * stride));
    auto q = random_floats(rng, static_cast<size_t>(tokens * q_heads * g.head_dim), -2, 2);
    const int64_t real = uniform(rng, 1, tokens);  // num_tokens: the rest are skipped

    auto dpool = to_device(pool);
    auto dk = to_device(k);
    auto dv = to_device(v);
    auto dq = to_device(q);
    auto dseq = to_device(seq);
    auto dpos = to_device(pos);
    auto dtab = to_device(tables);
    auto dn = to_device(std::vector<int32_t>{static_cast<int32_t>(real)});
    device_buffer dout(tokens * q_heads * g.head_dim * 4);
    paged_tokens tok{dseq.as<int32_t>(), dpos.as<int32_t>(), dtab.as<int32_t>(), max_pages, tokens,
                     dn.as<int32_t>(), 1, 0};
    kv_append_args ka;
    ka.k = dk.as<float>();
    ka.v = dv.as<float>();
    ka.stride = stride;
    ka.heads = page_heads;
    ka.head0 = 0;
    ka.pool = dpool.as<std::byte>();
    ka.geometry = g;
    ka.mode = mode;
    ka.layer = layer;
    ka.tok = tok;
    launch_kv_append(ka, nullptr);
    paged_attention_args pa;
    pa.q = dq.as<float>();
    pa.q_stride = q_heads * g.head_dim;
    pa.q_heads = q_heads;
    pa.group = group;
    pa.out = dout.as<float>();
    pa.out_stride = q_heads * g.head_dim;
    pa.pool = dpool.as<std::byte>();
    pa.geometry = g;
    pa.mode = mode;
    pa.layer = layer;
    pa.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(g.head_dim)));
    pa.tok = tok;
    pa.tensor_cores = false;
    launch_paged_attention(pa, nullptr);  // the GQA kernel, one range (D = 40: the simple one)
    device_buffer dout_simple(tokens * q_heads * g.head_dim * 4);
    paged_attention_args ps = pa;
    ps.simple = true;
    ps.out = dout_simple.as<float>();
    launch_paged_attention(ps, nullptr);
    // Split context: the automatic count, and a forced one (1 page per range up to all pages).
    std::vector<device_buffer> dout_split, dwork;
    std::vector<int64_t> split_counts;
    for (int64_t forced : {int64_t{0}, uniform(rng, 1, max_pages)}) {
      paged_attention_args sa = pa;
      sa.splits = forced;
      const int64_t wf = paged_attention_workspace_floats(sa);
      split_counts.push_back(paged_attention_splits(sa));
      REQUIRE(wf == (split_counts.back() > 1
                         ? tokens * q_heads * split_counts.back() * (g.head_dim + 2)
                         : 0));
      dwork.emplace_back(std::max<int64_t>(wf, 1) * 4);
      dout_split.emplace_back(tokens * q_heads * g.head_dim * 4);
      sa.workspace = dwork.back().as<float>();
      sa.out = dout_split.back().as<float>();
      launch_paged_attention(sa, nullptr);
    }
    // The tensor-core kernel (where the shape allows it; the CUDA-core split kernel
    // otherwise): one range without a workspace, the automatic count, a forced one.
    const bool tc = [&] {
      paged_attention_args ta = pa;
      ta.tensor_cores = true;
      ta.tensor_core_min_tokens = 1;
      return paged_attention_uses_tensor_cores(ta);
    }();
    if (tc_round) REQUIRE(tc);
    std::vector<device_buffer> dout_tc, dwork_tc;
    std::vector<int64_t> tc_counts;
    for (int64_t forced : {int64_t{-1}, int64_t{0}, uniform(rng, 1, max_pages)}) {
      paged_attention_args ta = pa;
      ta.tensor_cores = true;
      ta.tensor_core_min_tokens = 1;
      ta.splits = std::max<int64_t>(forced, 0);
      const int64_t wf = forced < 0 ? 0 : paged_attention_workspace_floats(ta);
      tc_counts.push_back(forced < 0 ? 1 : paged_attention_splits(ta));
      dwork_tc.emplace_back(std::max<int64_t>(wf, 1) * 4);
      dout_tc.emplace_back(tokens * q_heads * g.head_dim * 4);
      ta.workspace = forced < 0 ? nullptr : dwork_tc.back().as<float>();
      ta.out = dout_tc.back().as<float>();
      launch_paged_attention(ta, nullptr);
    }

    // Host: append, then attend.
    auto at = [&](int64_t t, int64_t s) {
      const int64_t r = seq[static_cast<size_t>(t)];
      return std::pair<int64_t, int64_t>{
          tables[static_cast<size_t>(r * max_pages + s / g.page_size)], s % g.page_size};
    };
    for (int64_t t = 0; t < real; ++t)
      for (int64_t h = 0; h < page_heads; ++h)
        for (int64_t d = 0; d < g.head_dim; ++d) {
          auto [page, slot] = at(t, pos[static_cast<size_t>(t)]);
          set_elem(pool, g.offset(mode, layer, moebius::kv_tensor::k, page, h, slot, d), g.type,
                   k[static_cast<size_t>(t * stride + h * g.head_dim + d)]);
          set_elem(pool, g.offset(mode, layer, moebius::kv_tensor::v, page, h, slot, d), g.type,
                   v[static_cast<size_t>(t * stride + h * g.head_dim + d)]);
        }
    auto pool_after = download<std::byte>(dpool, pool.size());
    REQUIRE(std::memcmp(pool_after.data(), pool.data(), pool.size()) == 0);

    auto out = download<float>(dout, static_cast<size_t>(tokens * q_heads * g.head_dim));
    std::vector<float> got;
    std::vector<double> want;
    for (int64_t t = 0; t < real; ++t)
      for (int64_t h = 0; h < q_heads; ++h) {
        const int64_t kvh = h / group, last = pos[static_cast<size_t>(t)];
        std::vector<double> score(static_cast<size_t>(last + 1));
        for (int64_t s = 0; s <= last; ++s) {
          auto [page, slot] = at(t, s);
          double dot = 0;
          for (int64_t d = 0; d < g.head_dim; ++d)
            dot += double{q[static_cast<size_t>((t * q_heads + h) * g.head_dim + d)]} *
                   elem(pool, g.offset(mode, layer, moebius::kv_tensor::k, page, kvh, slot, d),
                        g.type);
          score[static_cast<size_t>(s)] = dot / std::sqrt(static_cast<double>(g.head_dim));
        }
        const double mx = *std::max_element(score.begin(), score.end());
        double sum = 0;
        for (double& e : score) sum += (e = std::exp(e - mx));
        for (int64_t d = 0; d < g.head_dim; ++d) {
          double o = 0;
          for (int64_t s = 0; s <= last; ++s) {
            auto [page, slot] = at(t, s);
            o += score[static_cast<size_t>(s)] / sum *
                 elem(pool, g.offset(mode, layer, moebius::kv_tensor::v, page, kvh, slot, d),
                      g.type);
          }
          got.push_back(out[static_cast<size_t>((t * q_heads + h) * g.head_dim + d)]);
          want.push_back(o);
        }
      }
    INFO("round " << round << " " << g << " mode " << moebius::to_string(mode) << " group " << group
                  << " tokens " << tokens << " real " << real << " prefill " << prefill);
    REQUIRE(mismatches(got, want, 2e-5, 2e-4, "attention") == 0);
    auto out_simple =
        download<float>(dout_simple, static_cast<size_t>(tokens * q_heads * g.head_dim));
    std::vector<float> got_simple;
    for (int64_t t = 0; t < real; ++t)
      for (int64_t h = 0; h < q_heads; ++h)
        for (int64_t d = 0; d < g.head_dim; ++d)
          got_simple.push_back(out_simple[static_cast<size_t>((t * q_heads + h) * g.head_dim + d)]);
    REQUIRE(mismatches(got_simple, want, 2e-5, 2e-4, "attention (simple kernel)") == 0);
    auto picked = [&](const device_buffer& d) {
      auto o = download<float>(d, static_cast<size_t>(tokens * q_heads * g.head_dim));
      std::vector<float> r;
      for (int64_t t = 0; t < real; ++t)
        for (int64_t h = 0; h < q_heads; ++h)
          for (int64_t dd = 0; dd < g.head_dim; ++dd)
            r.push_back(o[static_cast<size_t>((t * q_heads + h) * g.head_dim + dd)]);
      return r;
    };
    for (size_t i = 0; i < dout_split.size(); ++i) {
      INFO("splits " << split_counts[i] << " of " << max_pages << " pages");
      REQUIRE(mismatches(picked(dout_split[i]), want, 2e-5, 2e-4, "attention (split)") == 0);
    }
    for (size_t i = 0; i < dout_tc.size(); ++i) {
      INFO("tensor cores " << tc << ", splits " << tc_counts[i] << " of " << max_pages
                           << " pages");
      REQUIRE(mismatches(picked(dout_tc[i]), want, 2e-5, 2e-4, "attention (tensor cores)") == 0);
    }
  }
}

// The split count: deterministic from the shapes, more ranges for fewer tokens, at least 32
// positions per range unless forced, never more ranges than pages.
TEST_CASE("paged attention split count", "[gpu][kernels]") {
  paged_attention_args a;
  a.tensor_cores = false;  // the CUDA-core split kernel first
  a.geometry.head_dim = 128;
  a.geometry.page_size = 16;
  a.q_heads = 32;
  a.group = 8;
  a.tok.table_stride = 65;
  int64_t prev = 1 << 30;
  for (int64_t tokens = 1; tokens <= 512; tokens *= 2) {
    a.tok.tokens = tokens;
    const int64_t s = paged_attention_splits(a);
    REQUIRE(s >= 1);
    REQUIRE(s <= 33);  // 2 pages (32 positions) per range at least
    REQUIRE(s <= prev);
    prev = s;
  }
  a.tok.tokens = 1;
  a.splits = 1000;
  REQUIRE(paged_attention_splits(a) == 65);
  a.splits = 7;  // ceil(65 / 7) = 10 pages per range -> 7 ranges
  REQUIRE(paged_attention_splits(a) == 7);
  a.splits = 1;
  REQUIRE(paged_attention_splits(a) == 1);
  REQUIRE(paged_attention_workspace_floats(a) == 0);
  // The tensor-core kernel (bf16, D = 128, from tensor_core_min_tokens: 1 by default): 4 blocks
  // of 8 q heads per token, at least 64 positions (4 pages) per range, still enough blocks for 4
  // per SM.
  a.splits = 0;
  a.tensor_cores = true;
  a.geometry.type = dtype::bf16;
  a.tok.tokens = 8;
  a.tensor_core_min_tokens = 16;
  REQUIRE_FALSE(paged_attention_uses_tensor_cores(a));  // below tensor_core_min_tokens
  a.tensor_core_min_tokens = paged_attention_args{}.tensor_core_min_tokens;
  REQUIRE(a.tensor_core_min_tokens == 1);
  int dev = 0, sms = 0;
  REQUIRE(cudaGetDevice(&dev) == cudaSuccess);
  REQUIRE(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess);
  prev = 1 << 30;
  for (int64_t tokens = 1; tokens <= 512; tokens *= 2) {
    a.tok.tokens = tokens;
    REQUIRE(paged_attention_uses_tensor_cores(a));
    const int64_t s = paged_attention_splits(a);
    INFO("tokens " << tokens << " splits " << s);
    REQUIRE(s >= 1);
    REQUIRE(s <= 17);  // ceil(65 / 4)
    REQUIRE(s <= prev);
    REQUIRE((s == 17 || 2 * tokens * 4 * s >= 4 * sms));  // whole pages per range: >= half
    REQUIRE(paged_attention_workspace_floats(a) == (s > 1 ? tokens * 32 * s * 130 : 0));
    prev = s;
  }
  a.tok.tokens = 512;
  REQUIRE(paged_attention_splits(a) == 1);
  a.tensor_cores = false;
  REQUIRE_FALSE(paged_attention_uses_tensor_cores(a));
}
