// The router and the MoE kernels (pack, permute, expert GEMMs, combine; the fp8 dequantization
// bit for bit) against a host reference in double, as in test_kernels.cu.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>
#include <vector>

#include "gemm.hpp"
#include "gpu_test_util.hpp"
#include "kernel_test_util.hpp"
#include "kernels/kernels.hpp"
#include "tests/catch.hpp"

using namespace mini_engine::gpu;
using namespace mini_engine::gpu::testing;
using moebius::dtype;

TEST_CASE("router top-k matches a stable sort of the softmax", "[gpu][kernels]") {
  std::mt19937_64 rng(seed(15));
  for (int round = 0; round < 30; ++round) {
    // Every register width of the kernel (experts a lane holds: 1, 2, 4, 8, 16, 32).
    const int64_t E = uniform(rng, 1, round % 3 == 0 ? 1024 : 256);
    const int64_t tokens = uniform(rng, 1, 70);
    const int64_t K = uniform(rng, 1, std::min<int64_t>(E, 32));
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
