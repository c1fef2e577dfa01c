// Every mini-engine kernel against a host reference in double: random shapes and data from a
// seed (MOEBIUS_TEST_SEED replays), outputs poisoned with NaN first, every element compared.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <moebius/kv/page_table.hpp>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "gemm.hpp"
#include "gpu_test_util.hpp"
#include "kernels/kernels.hpp"
#include "tests/catch.hpp"

using namespace mini_engine::gpu;
using namespace mini_engine::gpu::testing;
using moebius::dtype;
using moebius::parallel_mode;

namespace {

// Number of elements outside atol + rtol * |want|; the first few are printed.
int64_t mismatches(const std::vector<float>& got, const std::vector<double>& want, double atol,
                   double rtol, const std::string& what) {
  REQUIRE(got.size() == want.size());
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    if (!(std::fabs(g - w) <= atol + rtol * std::fabs(w))) {
      if (bad < 5) UNSCOPED_INFO(what << "[" << i << "]: got " << g << ", want " << w);
      ++bad;
    }
  }
  return bad;
}

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

TEST_CASE("rmsnorm matches the host reference (rows and per-head)", "[gpu][kernels]") {
  std::mt19937_64 rng(seed(11));
  for (int round = 0; round < 20; ++round) {
    const int64_t tokens = uniform(rng, 1, 40), heads = uniform(rng, 1, 4);
    const int64_t width = uniform(rng, 1, 700), stride = heads * width + uniform(rng, 0, 5);
    const bool in_place = uniform(rng, 0, 1) == 1;
    auto x = random_floats(rng, static_cast<size_t>(tokens * stride), -3, 3);
    auto w = random_floats(rng, static_cast<size_t>(width), 0.5, 1.5);
    auto dx = to_device(x);
    auto dw = to_device(w);
    device_buffer dy(static_cast<int64_t>(x.size() * 4));
    rmsnorm_args a;
    a.x = dx.as<float>();
    a.x_stride = stride;
    a.y = in_place ? dx.as<float>() : dy.as<float>();
    a.y_stride = stride;
    a.weight = dw.as<float>();
    a.rows = tokens * heads;
    a.width = width;
    a.heads = heads;
    a.head_stride = width;
    a.eps = 1e-6f;
    launch_rmsnorm(a, nullptr);
    auto y = download<float>(in_place ? dx : dy, x.size());
    std::vector<float> got;
    std::vector<double> want;
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const size_t base = static_cast<size_t>(t * stride + h * width);
        double ss = 0;
        for (int64_t i = 0; i < width; ++i) ss += double{x[base + i]} * x[base + i];
        const double inv = 1.0 / std::sqrt(ss / static_cast<double>(width) + 1e-6);
        for (int64_t i = 0; i < width; ++i) {
          got.push_back(y[base + i]);
          want.push_back(x[base + i] * inv * w[static_cast<size_t>(i)]);
        }
      }
    REQUIRE(mismatches(got, want, 5e-5, 5e-5, "rmsnorm") == 0);  // float sum of up to 700 squares
  }
}

TEST_CASE("rope matches the host reference, large positions, num_tokens cut", "[gpu][kernels]") {
  std::mt19937_64 rng(seed(12));
  for (int round = 0; round < 20; ++round) {
    const int64_t tokens = uniform(rng, 1, 30), heads = uniform(rng, 1, 6);
    const int64_t D = 2 * uniform(rng, 1, 128), stride = heads * D + uniform(rng, 0, 3);
    const int64_t real = uniform(rng, 0, tokens);
    const double theta = round % 2 ? 1e6 : 1e4;
    auto x = random_floats(rng, static_cast<size_t>(tokens * stride), -2, 2);
    std::vector<int32_t> pos(static_cast<size_t>(tokens));
    for (auto& p : pos) p = static_cast<int32_t>(uniform(rng, 0, 200000));
    auto dx = to_device(x);
    auto dpos = to_device(pos);
    auto dn = to_device(std::vector<int32_t>{static_cast<int32_t>(real)});
    rope_args a;
    a.x = dx.as<float>();
    a.row_stride = stride;
    a.tokens = tokens;
    a.heads = heads;
    a.head_dim = D;
    a.positions = dpos.as<int32_t>();
    a.num_tokens = dn.as<int32_t>();
    a.theta = theta;
    launch_rope(a, nullptr);
    auto y = download<float>(dx, x.size());
    std::vector<double> want(x.begin(), x.end());
    for (int64_t t = 0; t < real; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < D / 2; ++i) {
          const size_t b = static_cast<size_t>(t * stride + h * D);
          const double ang = pos[static_cast<size_t>(t)] * std::pow(theta, -2.0 * i / D);
          const double x1 = x[b + i], x2 = x[b + i + D / 2];
          want[b + i] = x1 * std::cos(ang) - x2 * std::sin(ang);
          want[b + i + D / 2] = x2 * std::cos(ang) + x1 * std::sin(ang);
        }
    REQUIRE(mismatches(y, want, 1e-5, 1e-5, "rope") == 0);
  }
}

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
                     dn.as<int32_t>()};
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

TEST_CASE("silu_and_mul matches the host reference (fp32 and bf16 out)", "[gpu][kernels]") {
  std::mt19937_64 rng(seed(14));
  for (int round = 0; round < 10; ++round) {
    const int64_t rows = uniform(rng, 1, 50), inter = uniform(rng, 1, 300);
    const dtype t = round % 2 ? dtype::bf16 : dtype::fp32;
    auto in = random_floats(rng, static_cast<size_t>(rows * 2 * inter), -6, 6);
    auto din = to_device(in);
    device_buffer dout(rows * inter * 4);
    silu_and_mul_args a{din.as<float>(), dout.ptr, t, rows, inter};
    launch_silu_and_mul(a, nullptr);
    device_buffer df(rows * inter * 4);
    launch_convert({dout.ptr, t, df.ptr, dtype::fp32, rows * inter}, nullptr);
    auto got = download<float>(df, static_cast<size_t>(rows * inter));
    std::vector<double> want;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < inter; ++i) {
        const double g = in[static_cast<size_t>(r * 2 * inter + i)];
        const double u = in[static_cast<size_t>(r * 2 * inter + inter + i)];
        want.push_back(g / (1 + std::exp(-g)) * u);
      }
    REQUIRE(mismatches(got, want, 1e-5, t == dtype::bf16 ? 4e-3 : 1e-5, "silu") == 0);
  }
}

TEST_CASE("router top-k matches a stable sort of the softmax", "[gpu][kernels]") {
  std::mt19937_64 rng(seed(15));
  for (int round = 0; round < 20; ++round) {
    const int64_t tokens = uniform(rng, 1, 70), E = uniform(rng, 1, 256);
    const int64_t K = uniform(rng, 1, std::min<int64_t>(E, 16));
    const int64_t real = uniform(rng, 0, tokens);
    auto logits = random_floats(rng, static_cast<size_t>(tokens * E), -4, 4);
    if (E > 3) logits[1] = logits[2] = logits[3];  // a tie: lower index first
    auto dl = to_device(logits);
    auto dn = to_device(std::vector<int32_t>{static_cast<int32_t>(real)});
    device_buffer dids(tokens * K * 4), dw(tokens * K * 4);
    launch_router_topk(
        {dl.as<float>(), tokens, E, K, dn.as<int32_t>(), dids.as<int32_t>(), dw.as<float>()},
        nullptr);
    auto ids = download<int32_t>(dids, static_cast<size_t>(tokens * K));
    auto w = download<float>(dw, static_cast<size_t>(tokens * K));
    std::vector<float> got;
    std::vector<double> want;
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<double> p(static_cast<size_t>(E));
      double mx = -1e300, sum = 0;
      for (int64_t e = 0; e < E; ++e)
        mx = std::max(mx, double{logits[static_cast<size_t>(t * E + e)]});
      for (int64_t e = 0; e < E; ++e)
        sum += (p[static_cast<size_t>(e)] = std::exp(logits[static_cast<size_t>(t * E + e)] - mx));
      std::vector<int64_t> order(static_cast<size_t>(E));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return p[static_cast<size_t>(a)] > p[static_cast<size_t>(b)];
      });
      double top = 0;
      for (int64_t j = 0; j < K; ++j) top += p[static_cast<size_t>(order[static_cast<size_t>(j)])];
      for (int64_t j = 0; j < K; ++j) {
        const size_t i = static_cast<size_t>(t * K + j);
        if (t < real) {
          INFO("token " << t << " choice " << j);
          REQUIRE(ids[i] == order[static_cast<size_t>(j)]);
          got.push_back(w[i]);
          want.push_back(p[static_cast<size_t>(order[static_cast<size_t>(j)])] / top);
        } else {
          REQUIRE(ids[i] == -1);
          REQUIRE(w[i] == 0.0f);
        }
      }
    }
    REQUIRE(mismatches(got, want, 1e-6, 1e-5, "router weights") == 0);
  }
}

// Pack, permute (route, CUB sort, tile map, gather), expert GEMMs, combine: the whole expert
// path of one rank against a double reference over its local experts.
TEST_CASE("moe pack/permute/expert GEMMs/combine match the host reference", "[gpu][kernels]") {
  std::mt19937_64 rng(seed(16));
  cublasHandle_t handle;
  MINI_ENGINE_CUBLAS_CHECK(cublasCreate(&handle));
  for (int round = 0; round < 16; ++round) {
    const dtype t = round % 2 ? dtype::bf16 : dtype::fp32;
    const int64_t E = uniform(rng, 1, 64), K = uniform(rng, 1, std::min<int64_t>(E, 8));
    const int64_t num_local = uniform(rng, 1, E), first = uniform(rng, 0, E - num_local);
    const int64_t tokens = uniform(rng, 1, 300), H = 8 * uniform(rng, 1, 40),
                  I = uniform(rng, 1, 100);
    const int64_t es = moebius::dtype_bytes(t);
    // Routing: distinct random experts per token, some tokens invalid (-1).
    std::vector<int32_t> ids(static_cast<size_t>(tokens * K));
    std::vector<float> wts(static_cast<size_t>(tokens * K));
    for (int64_t tk = 0; tk < tokens; ++tk) {
      std::vector<int32_t> all(static_cast<size_t>(E));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      const bool invalid = uniform(rng, 0, 9) == 0;
      for (int64_t j = 0; j < K; ++j) {
        ids[static_cast<size_t>(tk * K + j)] = invalid ? -1 : all[static_cast<size_t>(j)];
        wts[static_cast<size_t>(tk * K + j)] = std::uniform_real_distribution<float>(0, 1)(rng);
      }
    }
    auto x = random_floats(rng, static_cast<size_t>(tokens * H));
    auto w13 = random_floats(rng, static_cast<size_t>(num_local * 2 * I * H), -0.2f, 0.2f);
    auto w2 = random_floats(rng, static_cast<size_t>(num_local * H * I), -0.2f, 0.2f);
    if (t == dtype::bf16) {
      for (float& f : w13) f = round_bf16(f);
      for (float& f : w2) f = round_bf16(f);
    }
    auto dw13f = to_device(w13);
    auto dw2f = to_device(w2);
    device_buffer dw13(static_cast<int64_t>(w13.size()) * es),
        dw2(static_cast<int64_t>(w2.size()) * es);
    launch_convert({dw13f.ptr, dtype::fp32, dw13.ptr, t, static_cast<int64_t>(w13.size())},
                   nullptr);
    launch_convert({dw2f.ptr, dtype::fp32, dw2.ptr, t, static_cast<int64_t>(w2.size())}, nullptr);
    auto dx = to_device(x);
    auto dids = to_device(ids);
    auto dwts = to_device(wts);

    const moe_tokens layout = moe_token_layout(tokens, H, K, t);
    device_buffer drows(tokens * layout.row_bytes);
    moe_pack_args pk;
    pk.x = dx.as<float>();
    pk.ids = dids.as<int32_t>();
    pk.weights = dwts.as<float>();
    pk.dst = layout;
    pk.rows = drows.as<std::byte>();
    pk.hidden = H;
    pk.type = t;
    launch_moe_pack(pk, nullptr);
    moe_tokens src = layout;
    src.rows = drows.as<std::byte>();

    const int64_t pairs = tokens * std::min(K, num_local);
    moe_plan p;
    p.num_local = num_local;
    p.first_expert = first;
    p.tile_rows = moe_tile_rows(pairs, num_local);
    p.max_tiles = moe_max_tiles(pairs, num_local, p.tile_rows);
    p.hidden = H;
    p.inter = I;
    p.type = t;
    p.w13 = dw13.as<std::byte>();
    p.w2 = dw2.as<std::byte>();
    const int64_t all_pairs = tokens * K, prow = p.max_tiles * p.tile_rows;
    device_buffer keys(all_pairs * 4), vals(all_pairs * 4), ks(all_pairs * 4), vs(all_pairs * 4),
        info((3 * num_local + 1) * 4), pair_row(all_pairs * 4), xp(prow * H * es),
        gu(prow * 2 * I * 4), act(prow * I * es), y(prow * H * 4), pw13(p.max_tiles * 8),
        px(p.max_tiles * 8), pgu(p.max_tiles * 8), pw2(p.max_tiles * 8), pact(p.max_tiles * 8),
        py(p.max_tiles * 8), out(tokens * H * 4);
    p.keys = keys.as<int32_t>();
    p.values = vals.as<int32_t>();
    p.keys_sorted = ks.as<int32_t>();
    p.values_sorted = vs.as<int32_t>();
    p.expert_info = info.as<int32_t>();
    p.pair_row = pair_row.as<int32_t>();
    p.x_perm = xp.as<std::byte>();
    p.gu = gu.as<float>();
    p.act = act.as<std::byte>();
    p.y = y.as<float>();
    p.ptr_w13 = pw13.as<const void*>();
    p.ptr_x = px.as<const void*>();
    p.ptr_gu = pgu.as<void*>();
    p.ptr_w2 = pw2.as<const void*>();
    p.ptr_act = pact.as<const void*>();
    p.ptr_y = py.as<void*>();
    p.sort_temp_bytes = moe_sort_temp_bytes(all_pairs);
    device_buffer temp(static_cast<int64_t>(p.sort_temp_bytes));
    p.sort_temp = temp.ptr;
    auto flag = to_device(std::vector<int32_t>{0});
    p.overflow = flag.as<int32_t>();
    launch_moe_permute(p, src, nullptr);
    expert_gemms(handle, p, nullptr);
    moe_combine_args c;
    c.y = p.y;
    c.pair_row = p.pair_row;
    c.src = src;
    c.out = out.as<float>();
    c.hidden = H;
    launch_moe_combine(c, nullptr);

    // Rows: every local pair has a distinct row inside its expert's tiles, others -1.
    auto rows_got = download<int32_t>(pair_row, static_cast<size_t>(all_pairs));
    std::vector<int32_t> seen;
    for (int64_t i = 0; i < all_pairs; ++i) {
      const int32_t id = ids[static_cast<size_t>(i)];
      const bool local = id >= first && id < first + num_local;
      INFO("pair " << i << " expert " << id);
      if (!local) {
        REQUIRE(rows_got[static_cast<size_t>(i)] == -1);
      } else {
        REQUIRE(rows_got[static_cast<size_t>(i)] >= 0);
        REQUIRE(rows_got[static_cast<size_t>(i)] < prow);
        seen.push_back(rows_got[static_cast<size_t>(i)]);
      }
    }
    std::sort(seen.begin(), seen.end());
    REQUIRE(std::adjacent_find(seen.begin(), seen.end()) == seen.end());

    auto got = download<float>(out, static_cast<size_t>(tokens * H));
    std::vector<double> want(static_cast<size_t>(tokens * H), 0.0);
    std::vector<double> a(static_cast<size_t>(I));
    for (int64_t tk = 0; tk < tokens; ++tk) {
      std::vector<double> xr(static_cast<size_t>(H));
      for (int64_t h = 0; h < H; ++h)
        xr[static_cast<size_t>(h)] = t == dtype::bf16
                                         ? round_bf16(x[static_cast<size_t>(tk * H + h)])
                                         : x[static_cast<size_t>(tk * H + h)];
      for (int64_t j = 0; j < K; ++j) {
        const int32_t id = ids[static_cast<size_t>(tk * K + j)];
        if (id < first || id >= first + num_local) continue;
        const int64_t e = id - first;
        for (int64_t i = 0; i < I; ++i) {
          double g = 0, u = 0;
          for (int64_t h = 0; h < H; ++h) {
            g += w13[static_cast<size_t>((e * 2 * I + i) * H + h)] * xr[static_cast<size_t>(h)];
            u += w13[static_cast<size_t>((e * 2 * I + I + i) * H + h)] * xr[static_cast<size_t>(h)];
          }
          const float act_f = static_cast<float>(g / (1 + std::exp(-g)) * u);
          a[static_cast<size_t>(i)] = t == dtype::bf16 ? round_bf16(act_f) : act_f;
        }
        for (int64_t h = 0; h < H; ++h) {
          double s = 0;
          for (int64_t i = 0; i < I; ++i)
            s += w2[static_cast<size_t>((e * H + h) * I + i)] * a[static_cast<size_t>(i)];
          want[static_cast<size_t>(tk * H + h)] += wts[static_cast<size_t>(tk * K + j)] * s;
        }
      }
    }
    INFO("round " << round << " dtype " << moebius::to_string(t) << " E " << E << " K " << K
                  << " local " << num_local << "@" << first << " tokens " << tokens << " H " << H
                  << " I " << I << " tile_rows " << p.tile_rows << " max_tiles " << p.max_tiles);
    // bf16: SiLU outputs within an ulp of a rounding boundary may round the other way.
    REQUIRE(mismatches(got, want, t == dtype::bf16 ? 2e-3 : 1e-4, t == dtype::bf16 ? 2e-2 : 1e-4,
                       "moe") == 0);
    REQUIRE(download<int32_t>(flag, 1)[0] == 0);

    // Too few tile slots for the routing: the flag is raised and no row leaves the buffer.
    const auto info_h = download<int32_t>(info, static_cast<size_t>(3 * num_local + 1));
    const int32_t used_tiles = info_h[static_cast<size_t>(3 * num_local)];
    if (used_tiles > 1) {
      moe_plan small = p;
      small.max_tiles = used_tiles - 1;
      launch_moe_permute(small, src, nullptr);
      REQUIRE(download<int32_t>(flag, 1)[0] == 1);
      for (int32_t r : download<int32_t>(pair_row, static_cast<size_t>(all_pairs)))
        REQUIRE(r < small.max_tiles * small.tile_rows);
    }
  }
  cublasDestroy(handle);
}

TEST_CASE("dense linear (cuBLAS) with a leading dimension matches the host", "[gpu][kernels]") {
  std::mt19937_64 rng(seed(17));
  cublasHandle_t handle;
  MINI_ENGINE_CUBLAS_CHECK(cublasCreate(&handle));
  for (int round = 0; round < 8; ++round) {
    const dtype t = round % 2 ? dtype::bf16 : dtype::fp32;
    const int64_t T = uniform(rng, 1, 40), N = uniform(rng, 1, 200), K = 8 * uniform(rng, 1, 40);
    const int64_t ldw = K + 8 * uniform(rng, 0, 2), col0 = 8 * uniform(rng, 0, (ldw - K) / 8);
    auto x = random_floats(rng, static_cast<size_t>(T * K));
    auto w = random_floats(rng, static_cast<size_t>(N * ldw));
    if (t == dtype::bf16) {
      for (float& f : x) f = round_bf16(f);
      for (float& f : w) f = round_bf16(f);
    }
    auto dxf = to_device(x);
    auto dwf = to_device(w);
    const int64_t es = moebius::dtype_bytes(t);
    device_buffer dx(T * K * es), dw(N * ldw * es), dy(T * N * 4);
    launch_convert({dxf.ptr, dtype::fp32, dx.ptr, t, T * K}, nullptr);
    launch_convert({dwf.ptr, dtype::fp32, dw.ptr, t, N * ldw}, nullptr);
    linear_args a;
    a.x = dx.ptr;
    a.ldx = K;
    a.w = dw.as<std::byte>() + col0 * es;
    a.ldw = ldw;
    a.y = dy.as<float>();
    a.ldy = N;
    a.tokens = T;
    a.out_features = N;
    a.in_features = K;
    a.type = t;
    linear(handle, a, nullptr);
    auto y = download<float>(dy, static_cast<size_t>(T * N));
    std::vector<double> want;
    for (int64_t i = 0; i < T; ++i)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k)
          s += double{x[static_cast<size_t>(i * K + k)]} *
               w[static_cast<size_t>(n * ldw + col0 + k)];
        want.push_back(s);
      }
    REQUIRE(mismatches(y, want, 1e-4, 1e-4, "linear") == 0);
  }
  cublasDestroy(handle);
}

TEST_CASE("convert, embedding, argmax, residual_add and gather_rows match the host", "[gpu][kernels]") {
  std::mt19937_64 rng(seed(18));
  for (int round = 0; round < 10; ++round) {
    // embedding (bf16 or fp32 table), ids out of range and past num_tokens give zeros
    const dtype t = round % 2 ? dtype::bf16 : dtype::fp32;
    const int64_t V = uniform(rng, 1, 100), H = uniform(rng, 1, 300), T = uniform(rng, 1, 40);
    const int64_t real = uniform(rng, 0, T);
    auto table = random_floats(rng, static_cast<size_t>(V * H));
    auto dtf = to_device(table);
    device_buffer dtab(V * H * moebius::dtype_bytes(t)), demb(T * H * 4);
    launch_convert({dtf.ptr, dtype::fp32, dtab.ptr, t, V * H}, nullptr);
    std::vector<int32_t> ids(static_cast<size_t>(T));
    for (auto& i : ids) i = static_cast<int32_t>(uniform(rng, -1, V));
    auto dids = to_device(ids);
    auto dn = to_device(std::vector<int32_t>{static_cast<int32_t>(real)});
    launch_embedding({dtab.ptr, t, V, H, dids.as<int32_t>(), T, dn.as<int32_t>(), demb.as<float>()},
                     nullptr);
    auto emb = download<float>(demb, static_cast<size_t>(T * H));
    std::vector<double> want;
    for (int64_t i = 0; i < T; ++i)
      for (int64_t h = 0; h < H; ++h) {
        const int32_t id = ids[static_cast<size_t>(i)];
        const bool ok = i < real && id >= 0 && id < V;
        const float f = ok ? table[static_cast<size_t>(id * H + h)] : 0.0f;
        want.push_back(t == dtype::bf16 ? round_bf16(f) : f);
      }
    REQUIRE(mismatches(emb, want, 0, 0, "embedding") == 0);

    // argmax with ties (lowest index wins); every third round a vocabulary-sized row (the
    // 1024-thread launch)
    const int64_t rows = uniform(rng, 1, 30);
    const int64_t cols = round % 3 == 2 ? uniform(rng, 16384, 160000) : uniform(rng, 1, 5000);
    auto x = random_floats(rng, static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      if (cols > 2 && r % 2 == 0) {
        const int64_t a = uniform(rng, 0, cols - 1), b = uniform(rng, 0, cols - 1);
        x[static_cast<size_t>(r * cols + a)] = x[static_cast<size_t>(r * cols + b)] = 2.0f;
      }
    auto dxa = to_device(x);
    device_buffer dam(rows * 4), damv(rows * 4);
    launch_argmax({dxa.as<float>(), rows, cols, dam.as<int32_t>(), damv.as<float>()}, nullptr);
    auto am = download<int32_t>(dam, static_cast<size_t>(rows));
    auto amv = download<float>(damv, static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      const auto row = x.begin() + r * cols;
      REQUIRE(am[static_cast<size_t>(r)] == std::max_element(row, row + cols) - row);
      REQUIRE(amv[static_cast<size_t>(r)] == *std::max_element(row, row + cols));
    }

    // residual_add over several parts, in order
    const int64_t parts = uniform(rng, 1, 4), n = rows * H;
    auto h = random_floats(rng, static_cast<size_t>(n));
    auto pp = random_floats(rng, static_cast<size_t>(parts * (n + 7)));
    auto dh = to_device(h);
    auto dp = to_device(pp);
    launch_residual_add({dh.as<float>(), dp.as<float>(), parts, n + 7, rows, H}, nullptr);
    auto hg = download<float>(dh, static_cast<size_t>(n));
    std::vector<double> hw;
    for (int64_t i = 0; i < n; ++i) {
      double s = h[static_cast<size_t>(i)];
      for (int64_t p = 0; p < parts; ++p) s += pp[static_cast<size_t>(p * (n + 7) + i)];
      hw.push_back(s);
    }
    REQUIRE(mismatches(hg, hw, 1e-5, 1e-5, "residual_add") == 0);  // float sums of up to 5 terms

    // convert round trip: bf16 is round-to-nearest-even
    auto f = random_floats(rng, 1000, -100, 100);
    auto df = to_device(f);
    device_buffer db(2000), dback(4000);
    launch_convert({df.ptr, dtype::fp32, db.ptr, dtype::bf16, 1000}, nullptr);
    launch_convert({db.ptr, dtype::bf16, dback.ptr, dtype::fp32, 1000}, nullptr);
    auto back = download<float>(dback, 1000);
    std::vector<double> bw;
    for (float v : f) bw.push_back(round_bf16(v));
    REQUIRE(mismatches(back, bw, 0, 0, "convert") == 0);

    // gather_rows: random map (repeats allowed), rows past num_tokens zeroed over the poison
    const int64_t src_rows = uniform(rng, 1, 40), out_rows = uniform(rng, 1, 40);
    const int64_t gnum = uniform(rng, 0, out_rows), gh = uniform(rng, 1, 300);
    auto gin = random_floats(rng, static_cast<size_t>(src_rows * gh));
    std::vector<int32_t> gmap(static_cast<size_t>(out_rows));
    for (auto& m : gmap) m = static_cast<int32_t>(uniform(rng, 0, src_rows - 1));
    auto dgin = to_device(gin);
    auto dgmap = to_device(gmap);
    auto dgn = to_device(std::vector<int32_t>{static_cast<int32_t>(gnum)});
    device_buffer dgout(out_rows * gh * 4);
    launch_gather_rows({dgin.as<float>(), dgmap.as<int32_t>(), dgn.as<int32_t>(),
                        dgout.as<float>(), out_rows, gh},
                       nullptr);
    auto gout = download<float>(dgout, static_cast<size_t>(out_rows * gh));
    std::vector<double> gw;
    for (int64_t t = 0; t < out_rows; ++t)
      for (int64_t c = 0; c < gh; ++c)
        gw.push_back(t < gnum ? gin[static_cast<size_t>(gmap[static_cast<size_t>(t)] * gh + c)]
                              : 0.0);
    REQUIRE(mismatches(gout, gw, 0, 0, "gather_rows") == 0);
  }
}

// Random codes (NaN codes included) and power-of-two scales in [2^-20, 2^20]: every product
// code x scale has at most 4 significant bits and an exponent far inside bf16's normal range,
// so the expected bf16 / fp32 is exact and every element must match bit for bit (no
// tolerance); NaN codes must give NaN. Experts with no tokens must keep the poison (0x7b
// bytes: a finite value no product equals). Shapes: whole blocks of 1..16 x 1..16 (block_k a
// multiple of 8 and 8 | cols: the 8-code vector path; otherwise, or with a misaligned
// pointer, the scalar one); every fourth round large (128-wide blocks, up to 256 x 2048 per
// expert: several blocks of rows per expert, the last one partial) and a few with rows longer
// than one block's share (40,000 columns: one row per block).
TEST_CASE("dequant_fp8 expands exactly the experts with tokens (bf16 and fp32 out)",
          "[gpu][kernels]") {
  std::mt19937_64 rng(seed(31));
  int64_t vector_rounds = 0, scalar_rounds = 0, multi_block_rounds = 0;
  for (int round = 0; round < 60; ++round) {
    const int64_t experts = uniform(rng, 1, 6);
    int64_t bn = uniform(rng, 1, 16);
    int64_t bk = uniform(rng, 0, 1) == 1 ? 8 * uniform(rng, 1, 2) : uniform(rng, 1, 16);
    int64_t rows = bn * uniform(rng, 1, 6), cols = bk * uniform(rng, 1, 6);
    if (round % 4 == 3) {  // large: 128-wide blocks, several row ranges per expert
      bn = uniform(rng, 0, 1) == 1 ? 128 : 32;
      bk = 128;
      rows = bn * uniform(rng, 1, 256 / bn);
      cols = bk * uniform(rng, 4, 16);
    } else if (round % 20 == 9) {  // a row longer than one block's share
      bn = 1;
      bk = 8;
      rows = uniform(rng, 1, 3);
      cols = 40000;
    }
    if (rows * cols > 32768) ++multi_block_rounds;
    const dtype out_type = uniform(rng, 0, 1) == 1 ? dtype::bf16 : dtype::fp32;
    const bool use_counts = uniform(rng, 0, 3) != 0;
    const int64_t w_offset = uniform(rng, 0, 4) == 0 ? 1 : 0;  // misaligned codes: scalar path
    const bool vector = cols % 8 == 0 && bk % 8 == 0 && w_offset == 0;
    (vector ? vector_rounds : scalar_rounds) += 1;
    INFO("round " << round << ": " << experts << " experts of [" << rows << ", " << cols
                  << "], blocks " << bn << " x " << bk << ", out " << moebius::to_string(out_type)
                  << (use_counts ? ", counts" : "") << (vector ? ", vector" : ", scalar"));
    const int64_t n = experts * rows * cols, ns = experts * (rows / bn) * (cols / bk);
    std::vector<uint8_t> codes(static_cast<size_t>(n + w_offset));
    for (auto& c : codes) c = static_cast<uint8_t>(uniform(rng, 0, 255));
    std::vector<float> scale(static_cast<size_t>(ns));
    for (float& s : scale) s = std::ldexp(1.0f, static_cast<int>(uniform(rng, -20, 20)));
    std::vector<int32_t> counts(static_cast<size_t>(experts));
    for (auto& c : counts) c = uniform(rng, 0, 2) == 0 ? 0 : static_cast<int32_t>(uniform(rng, 1, 9));
    auto dw = to_device(codes);
    auto ds = to_device(scale);
    auto dc = to_device(counts);
    const int64_t ob = moebius::dtype_bytes(out_type);
    device_buffer dout(n * ob);
    MOEBIUS_CUDA_CHECK(cudaMemset(dout.ptr, 0x7b, static_cast<size_t>(n * ob)));
    dequant_fp8_args a;
    a.w = dw.as<uint8_t>() + w_offset;
    a.scale = ds.as<float>();
    a.out = dout.ptr;
    a.out_type = out_type;
    a.experts = experts;
    a.rows = rows;
    a.cols = cols;
    a.block_n = bn;
    a.block_k = bk;
    a.counts = use_counts ? dc.as<int32_t>() : nullptr;
    launch_dequant_fp8(a, nullptr);
    const auto got = download<std::byte>(dout, static_cast<size_t>(n * ob));
    int64_t bad = 0;
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t i = (e * rows + r) * cols + c;
          const std::byte* g = got.data() + i * ob;
          uint32_t got_bits = 0;
          std::memcpy(&got_bits, g, static_cast<size_t>(ob));
          const bool skipped = use_counts && counts[static_cast<size_t>(e)] == 0;
          bool ok;
          double want = 0;
          if (skipped) {
            ok = got_bits == (ob == 2 ? 0x7b7bu : 0x7b7b7b7bu);
          } else {
            const double v = fp8_e4m3_value(codes[static_cast<size_t>(i + w_offset)]);
            want = v * scale[static_cast<size_t>((e * (rows / bn) + r / bn) * (cols / bk) +
                                                 c / bk)];
            const float got_f = out_type == dtype::bf16
                                    ? from_bf16(static_cast<uint16_t>(got_bits))
                                    : std::bit_cast<float>(got_bits);
            if (std::isnan(want)) {
              ok = std::isnan(got_f);
            } else {
              // exactly representable (checked), so the bits are those of the value
              REQUIRE(static_cast<double>(round_bf16(static_cast<float>(want))) == want);
              ok = static_cast<double>(got_f) == want &&
                   (out_type == dtype::bf16
                        ? got_bits == to_bf16(static_cast<float>(want))
                        : got_bits == std::bit_cast<uint32_t>(static_cast<float>(want)));
            }
          }
          if (!ok) {
            if (bad < 5)
              UNSCOPED_INFO("out[" << e << ", " << r << ", " << c << "]: bits 0x" << std::hex
                                   << got_bits << std::dec << ", want " << want
                                   << (skipped ? " (untouched: expert has no tokens)" : ""));
            ++bad;
          }
        }
    REQUIRE(bad == 0);
  }
  REQUIRE(vector_rounds > 0);
  REQUIRE(scalar_rounds > 0);
  REQUIRE(multi_block_rounds > 0);
}

// The virtual ranks' all-reduce: P buffers summed element by element in rank order. The host
// sums in float in the same order, so every element must match bit for bit (what makes TP
// ranks agree with each other); the poisoned tail past n must stay NaN; every part's buffer
// lies apart (as the ranks' buffers do), odd sizes and offsets included.
TEST_CASE("sum_ranks sums the parts in rank order, bit for bit", "[gpu][kernels]") {
  std::mt19937_64 rng(seed(19));
  for (int round = 0; round < 20; ++round) {
    const int P = static_cast<int>(uniform(rng, 1, sum_ranks_args::max_parts));
    const int64_t n = round % 5 == 4 ? uniform(rng, 100000, 3000000) : uniform(rng, 1, 5000);
    INFO("round " << round << " parts " << P << " n " << n);
    std::vector<std::vector<float>> h;
    std::vector<device_buffer> d;
    sum_ranks_args a;
    a.num_parts = P;
    a.n = n;
    for (int p = 0; p < P; ++p) {
      h.push_back(random_floats(rng, static_cast<size_t>(n), -100.0f, 100.0f));
      d.push_back(to_device(h.back()));
      a.parts[p] = d.back().as<float>();
    }
    device_buffer out((n + 3) * 4);  // poisoned: NaN
    a.out = out.as<float>();
    launch_sum_ranks(a, nullptr);
    const auto got = download<float>(out, static_cast<size_t>(n + 3));
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      float s = h[0][static_cast<size_t>(i)];
      for (int p = 1; p < P; ++p) s += h[static_cast<size_t>(p)][static_cast<size_t>(i)];
      bad += std::memcmp(&s, &got[static_cast<size_t>(i)], 4) != 0;
    }
    REQUIRE(bad == 0);
    for (int64_t i = n; i < n + 3; ++i) REQUIRE(std::isnan(got[static_cast<size_t>(i)]));
  }
  sum_ranks_args none;
  REQUIRE_THROWS_AS(launch_sum_ranks(none, nullptr), moebius::error);
  none.num_parts = sum_ranks_args::max_parts + 1;
  REQUIRE_THROWS_AS(launch_sum_ranks(none, nullptr), moebius::error);
}
