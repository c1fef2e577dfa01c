// The host runtime's attention: one rank's heads over the paged KV, in EP (its own sequences,
// every KV head) and TP (every sequence, its heads' slice) (host_runtime.hpp).
#include <algorithm>
#include <cmath>
#include <moebius/error.hpp>
#include <moebius/kv/page_table.hpp>
#include <moebius/layout/weight_view.hpp>

#include "host_kernels.hpp"
#include "host_runtime.hpp"
#include "kv_pages.hpp"

namespace mini_engine {

using namespace host_detail;
using moebius::dtype;
using moebius::errc;
using moebius::kv_tensor;
using moebius::parallel_mode;
using moebius::weight_tensor;

void host_runtime::attend(int64_t layer, int rank, parallel_mode mode,
                          const moebius::kv_sequence& seq, int64_t item_index,
                          const step_item& item, int64_t q0, int64_t q1, int64_t kv0, int64_t kv1) {
  const model_config& c = weights_.config;
  const layer_weights& lw = weights_.layers[static_cast<size_t>(layer)];
  const dense_layer& dw = dense_[static_cast<size_t>(layer)];
  const moebius::kv_geometry& g = kv_geometry_;
  const int64_t H = c.hidden, D = c.head_dim, qdim = c.q_dim(), ps = g.page_size;
  const int64_t n = static_cast<int64_t>(item.tokens.size());
  const int64_t end = item.start_position + n;  // positions [0, end) are attended
  MOEBIUS_CHECK(seq.num_tokens >= end, errc::invalid_argument, "step: sequence ", seq.seq_id,
                " on rank ", rank, " holds ", seq.num_tokens, " tokens, the step needs ", end);
  std::byte* pool = pool_of(rank);
  const int64_t first = item_first_[static_cast<size_t>(item_index)];
  // Head index within a page: EP pages hold every head, TP pages this rank's slice.
  const int64_t page_head0 =
      mode == parallel_mode::ep ? 0 : g.tp_slice_of_rank(rank) * g.heads_per_tp_page();
  auto at = [&](kv_tensor t, int64_t head, int64_t pos) {
    return pool + kv_layout_.offset(mode, layer, t, seq.pages[static_cast<size_t>(pos / ps)],
                                    head - page_head0, pos % ps, 0);
  };

  // 1. K and V of the new tokens for heads [kv0, kv1): projection, k_norm, RoPE, store.
  grow(kvtmp_, D);
  float* kv = kvtmp_.data();
  float* kn = kv;  // k_norm in place needs a second row
  grow(qbuf_, 2 * D);
  for (int64_t j = 0; j < n; ++j) {
    const double* x = &x_[static_cast<size_t>((first + j) * H)];
    const int64_t pos = item.start_position + j;
    const double* cs = &cos_[static_cast<size_t>((first + j) * D / 2)];
    const double* sn = &sin_[static_cast<size_t>((first + j) * D / 2)];
    for (int64_t head = kv0; head < kv1; ++head) {
      for (int64_t d = 0; d < D; ++d)
        qbuf_[static_cast<size_t>(d)] =
            static_cast<float>(dot(&dw.k_proj[static_cast<size_t>((head * D + d) * H)], x, H));
      rmsnorm(qbuf_.data(), lw.k_norm.data(), D, c.rms_eps, kn);
      rope(kn, cs, sn, D);
      store_kv(at(kv_tensor::k, head, pos), kn, D, c.kv_dtype);
      for (int64_t d = 0; d < D; ++d)
        kv[d] = static_cast<float>(dot(&dw.v_proj[static_cast<size_t>((head * D + d) * H)], x, H));
      store_kv(at(kv_tensor::v, head, pos), kv, D, c.kv_dtype);
    }
  }

  // 2. Attention of q heads [q0, q1) over positions [0, pos] read back from the pages.
  const int64_t group = c.num_q_heads / c.num_kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  grow(kbuf_, end * D);
  grow(vbuf_, end * D);
  grow(score_, end);
  grow(accd_, D);
  for (int64_t head = kv0; head < kv1; ++head) {
    const int64_t hq0 = std::max(q0, head * group), hq1 = std::min(q1, (head + 1) * group);
    if (hq0 >= hq1) continue;
    for (int64_t pos = 0; pos < end; ++pos) {
      load_kv(at(kv_tensor::k, head, pos), &kbuf_[static_cast<size_t>(pos * D)], D, c.kv_dtype);
      load_kv(at(kv_tensor::v, head, pos), &vbuf_[static_cast<size_t>(pos * D)], D, c.kv_dtype);
    }
    for (int64_t j = 0; j < n; ++j) {
      const double* x = &x_[static_cast<size_t>((first + j) * H)];
      const int64_t pos = item.start_position + j;
      const double* cs = &cos_[static_cast<size_t>((first + j) * D / 2)];
      const double* sn = &sin_[static_cast<size_t>((first + j) * D / 2)];
      for (int64_t hq = hq0; hq < hq1; ++hq) {
        float* q = &qbuf_[static_cast<size_t>(D)];
        for (int64_t d = 0; d < D; ++d)
          qbuf_[static_cast<size_t>(d)] =
              static_cast<float>(dot(&dw.q_proj[static_cast<size_t>((hq * D + d) * H)], x, H));
        rmsnorm(qbuf_.data(), lw.q_norm.data(), D, c.rms_eps, q);
        rope(q, cs, sn, D);
        double mx = -INFINITY;
        for (int64_t s = 0; s <= pos; ++s) {
          const double sc = dot(&kbuf_[static_cast<size_t>(s * D)], q, D) * scale;
          score_[static_cast<size_t>(s)] = sc;
          mx = std::max(mx, sc);
        }
        double sum = 0;
        for (int64_t s = 0; s <= pos; ++s)
          sum += (score_[static_cast<size_t>(s)] = std::exp(score_[static_cast<size_t>(s)] - mx));
        std::fill(accd_.begin(), accd_.begin() + D, 0.0);
        for (int64_t s = 0; s <= pos; ++s) {
          const double p = score_[static_cast<size_t>(s)];
          const double* v = &vbuf_[static_cast<size_t>(s * D)];
          for (int64_t d = 0; d < D; ++d) accd_[static_cast<size_t>(d)] += p * v[d];
        }
        double* o = &o_[static_cast<size_t>((first + j) * qdim + hq * D)];
        for (int64_t d = 0; d < D; ++d)
          o[d] = static_cast<float>(accd_[static_cast<size_t>(d)] / sum);
      }
    }
  }
}

void host_runtime::attention_ep(int64_t layer, const moebius::kv_state& tables,
                                std::span<const step_item> items) {
  const model_config& c = weights_.config;
  const int P = num_ranks();
  for (size_t i = 0; i < items.size(); ++i) {
    const moebius::kv_sequence* seq = nullptr;
    int owner = 0;
    for (; owner < P && !seq; ++owner) seq = find_sequence(tables, owner, items[i].seq_id);
    MOEBIUS_CHECK(seq != nullptr, errc::invalid_argument, "step: sequence ", items[i].seq_id,
                  " is in no rank's EP tables");
    attend(layer, owner - 1, parallel_mode::ep, *seq, static_cast<int64_t>(i), items[i], 0,
           c.num_q_heads, 0, c.num_kv_heads);
  }
  // o_proj on the owner over all heads: one sum.
  const dense_layer& dw = dense_[static_cast<size_t>(layer)];
  const int64_t H = c.hidden, qdim = c.q_dim(), T = static_cast<int64_t>(tokens_.size());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < H; ++r)
      acc_[static_cast<size_t>(t * H + r)] =
          dot(&dw.o_proj[static_cast<size_t>(r * qdim)], &o_[static_cast<size_t>(t * qdim)], qdim);
}

void host_runtime::attention_tp(int64_t layer, const moebius::kv_state& tables,
                                std::span<const step_item> items) {
  const model_config& c = weights_.config;
  const moebius::kv_geometry& g = kv_geometry_;
  const int P = num_ranks();
  const dense_layer& dw = dense_[static_cast<size_t>(layer)];
  const int64_t H = c.hidden, D = c.head_dim, qdim = c.q_dim(),
                T = static_cast<int64_t>(tokens_.size());
  std::fill(acc_.begin(), acc_.begin() + T * H, 0.0);
  for (int r = 0; r < P; ++r) {
    const int64_t q0 = r * c.num_q_heads / P, q1 = (r + 1) * c.num_q_heads / P;
    const int64_t kv0 = g.tp_slice_of_rank(r) * g.heads_per_tp_page();
    const int64_t kv1 = kv0 + g.heads_per_tp_page();
    for (size_t i = 0; i < items.size(); ++i) {
      const moebius::kv_sequence* seq = find_sequence(tables, r, items[i].seq_id);
      MOEBIUS_CHECK(seq != nullptr, errc::invalid_argument, "step: sequence ", items[i].seq_id,
                    " is not in TP rank ", r, "'s tables");
      attend(layer, r, parallel_mode::tp, *seq, static_cast<int64_t>(i), items[i], q0, q1, kv0,
             kv1);
    }
    // This rank's o_proj partial over its heads' columns, then the all-reduce (rank order).
    const int64_t len = (q1 - q0) * D;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t row = 0; row < H; ++row)
        acc_[static_cast<size_t>(t * H + row)] +=
            dot(&dw.o_proj[static_cast<size_t>(row * qdim + q0 * D)],
                &o_[static_cast<size_t>(t * qdim + q0 * D)], len);
  }
}

}  // namespace mini_engine
