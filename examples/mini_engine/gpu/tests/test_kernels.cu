// The mini-engine's norm, rope, activation, dense, conversion and rank-sum kernels against a
// host reference in double: random shapes and data from a seed (MOEBIUS_TEST_SEED replays),
// outputs poisoned with NaN first, every element compared. The attention kernels:
// test_kernels_attention.cu; the router and the MoE kernels: test_kernels_moe.cu.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gemm.hpp"
#include "gpu_test_util.hpp"
#include "kernel_test_util.hpp"
#include "kernels/kernels.hpp"
#include "tests/catch.hpp"

using namespace mini_engine::gpu;
using namespace mini_engine::gpu::testing;
using moebius::dtype;

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
