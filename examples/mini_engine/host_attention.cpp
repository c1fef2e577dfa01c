// The host runtime's attention: one rank's heads over the paged KV, in EP (its own sequences,
// every KV head) and TP (every sequence, its heads' slice; with dcp > 1 the merge of its DCP
// set's partial attentions) (host_runtime.hpp). Both modes run the same four pieces: store the
// new tokens' K/V, project Q, attend over the pages one rank holds (a part: output and LSE),
// merge the parts.
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

bool host_runtime::holds(const rank_kv& kv, int64_t pos) const {
  const moebius::kv_geometry& g = kv_geometry_;
  return kv.mode == parallel_mode::ep || g.token_place(pos).dcp_rank == g.dcp_rank(kv.rank);
}

std::byte* host_runtime::kv_at(const rank_kv& kv, int64_t layer, kv_tensor t, int64_t head,
                               int64_t pos) const {
  const moebius::kv_geometry& g = kv_geometry_;
  // EP pages hold every head and every position of the sequence; TP pages the rank's head
  // slice and its DCP share of the positions (token_place: dcp 1 gives page pos / page_size).
  if (kv.mode == parallel_mode::ep)
    return pool_of(kv.rank) +
           kv_layout_.offset(kv.mode, layer, t,
                             kv.seq->pages[static_cast<size_t>(pos / g.page_size)], head,
                             pos % g.page_size, 0);
  const moebius::kv_token_place at = g.token_place(pos);
  return pool_of(kv.rank) +
         kv_layout_.offset(kv.mode, layer, t, kv.seq->pages[static_cast<size_t>(at.local_page)],
                           head - g.tp_slice_of_rank(kv.rank) * g.heads_per_tp_page(), at.slot, 0);
}

void host_runtime::store_new_kv(int64_t layer, const rank_kv& kv, int64_t item_index,
                                const step_item& item, int64_t kv0, int64_t kv1) {
  const model_config& c = weights_.config;
  const moebius::kv_geometry& g = kv_geometry_;
  const layer_weights& lw = weights_.layers[static_cast<size_t>(layer)];
  const dense_layer& dw = dense_[static_cast<size_t>(layer)];
  const int64_t H = c.hidden, D = c.head_dim;
  const int64_t n = static_cast<int64_t>(item.tokens.size());
  const int64_t end = item.start_position + n;
  // The pages for positions [0, end) must be there: every page (EP) or the rank's share (TP).
  const int64_t pages = moebius::pages_held(g, kv.mode, kv.rank,
                                            moebius::pages_for_tokens(end, g.page_size));
  MOEBIUS_CHECK(kv.seq->num_tokens >= end && kv.seq->num_pages() >= pages, errc::invalid_argument,
                "step: sequence ", kv.seq->seq_id, " on ", moebius::to_string(kv.mode), " rank ",
                kv.rank, " holds ", kv.seq->num_tokens, " tokens in ", kv.seq->num_pages(),
                " pages, the step needs ", end, " tokens in ", pages);
  const int64_t first = item_first_[static_cast<size_t>(item_index)];
  grow(kvtmp_, D);
  grow(qbuf_, D);
  float* kv_row = kvtmp_.data();
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = item.start_position + j;
    if (!holds(kv, pos)) continue;  // another DCP index's page: that rank stores it
    const double* x = &x_[static_cast<size_t>((first + j) * H)];
    const double* cs = &cos_[static_cast<size_t>((first + j) * D / 2)];
    const double* sn = &sin_[static_cast<size_t>((first + j) * D / 2)];
    for (int64_t head = kv0; head < kv1; ++head) {
      for (int64_t d = 0; d < D; ++d)
        qbuf_[static_cast<size_t>(d)] =
            static_cast<float>(dot(&dw.k_proj[static_cast<size_t>((head * D + d) * H)], x, H));
      rmsnorm(qbuf_.data(), lw.k_norm.data(), D, c.rms_eps, kv_row);
      rope(kv_row, cs, sn, D);
      store_kv(kv_at(kv, layer, kv_tensor::k, head, pos), kv_row, D, c.kv_dtype);
      for (int64_t d = 0; d < D; ++d)
        kv_row[d] =
            static_cast<float>(dot(&dw.v_proj[static_cast<size_t>((head * D + d) * H)], x, H));
      store_kv(kv_at(kv, layer, kv_tensor::v, head, pos), kv_row, D, c.kv_dtype);
    }
  }
}

void host_runtime::project_queries(int64_t layer, int64_t item_index, const step_item& item,
                                   int64_t q0, int64_t q1) {
  const model_config& c = weights_.config;
  const layer_weights& lw = weights_.layers[static_cast<size_t>(layer)];
  const dense_layer& dw = dense_[static_cast<size_t>(layer)];
  const int64_t H = c.hidden, D = c.head_dim, qdim = c.q_dim();
  const int64_t first = item_first_[static_cast<size_t>(item_index)];
  grow(qbuf_, D);
  for (int64_t j = 0; j < static_cast<int64_t>(item.tokens.size()); ++j) {
    const double* x = &x_[static_cast<size_t>((first + j) * H)];
    const double* cs = &cos_[static_cast<size_t>((first + j) * D / 2)];
    const double* sn = &sin_[static_cast<size_t>((first + j) * D / 2)];
    for (int64_t hq = q0; hq < q1; ++hq) {
      float* q = &q_[static_cast<size_t>((first + j) * qdim + hq * D)];
      for (int64_t d = 0; d < D; ++d)
        qbuf_[static_cast<size_t>(d)] =
            static_cast<float>(dot(&dw.q_proj[static_cast<size_t>((hq * D + d) * H)], x, H));
      rmsnorm(qbuf_.data(), lw.q_norm.data(), D, c.rms_eps, q);
      rope(q, cs, sn, D);
    }
  }
}

void host_runtime::partial_attention(int64_t layer, const rank_kv& kv, int64_t item_index,
                                     const step_item& item, int64_t q0, int64_t q1, int64_t part) {
  const model_config& c = weights_.config;
  const int64_t D = c.head_dim, qdim = c.q_dim(), Hq = c.num_q_heads;
  const int64_t T = static_cast<int64_t>(tokens_.size());
  const int64_t n = static_cast<int64_t>(item.tokens.size());
  const int64_t end = item.start_position + n;
  const int64_t first = item_first_[static_cast<size_t>(item_index)];
  const int64_t group = c.num_q_heads / c.num_kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  held_.clear();
  for (int64_t pos = 0; pos < end; ++pos)
    if (holds(kv, pos)) held_.push_back(pos);
  const int64_t m = static_cast<int64_t>(held_.size());
  grow(kbuf_, m * D);
  grow(vbuf_, m * D);
  grow(score_, m);
  grow(accd_, D);
  for (int64_t head = q0 / group; head * group < q1; ++head) {  // the KV heads of q0..q1-1
    for (int64_t s = 0; s < m; ++s) {
      const int64_t pos = held_[static_cast<size_t>(s)];
      load_kv(kv_at(kv, layer, kv_tensor::k, head, pos), &kbuf_[static_cast<size_t>(s * D)], D,
              c.kv_dtype);
      load_kv(kv_at(kv, layer, kv_tensor::v, head, pos), &vbuf_[static_cast<size_t>(s * D)], D,
              c.kv_dtype);
    }
    const int64_t hq0 = std::max(q0, head * group), hq1 = std::min(q1, (head + 1) * group);
    int64_t seen = 0;  // held positions <= the query's position: a prefix of held_
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = item.start_position + j;
      while (seen < m && held_[static_cast<size_t>(seen)] <= pos) ++seen;
      for (int64_t hq = hq0; hq < hq1; ++hq) {
        const float* q = &q_[static_cast<size_t>((first + j) * qdim + hq * D)];
        double* o = &part_o_[static_cast<size_t>((part * T + first + j) * qdim + hq * D)];
        double& lse = part_lse_[static_cast<size_t>((part * T + first + j) * Hq + hq)];
        if (seen == 0) {  // no position of this part is visible yet: it adds nothing
          lse = -INFINITY;
          std::fill(o, o + D, 0.0);
          continue;
        }
        double mx = -INFINITY;
        for (int64_t s = 0; s < seen; ++s) {
          const double sc = dot(&kbuf_[static_cast<size_t>(s * D)], q, D) * scale;
          score_[static_cast<size_t>(s)] = sc;
          mx = std::max(mx, sc);
        }
        double sum = 0;
        for (int64_t s = 0; s < seen; ++s)
          sum += (score_[static_cast<size_t>(s)] = std::exp(score_[static_cast<size_t>(s)] - mx));
        std::fill(accd_.begin(), accd_.begin() + D, 0.0);
        for (int64_t s = 0; s < seen; ++s) {
          const double p = score_[static_cast<size_t>(s)];
          const double* v = &vbuf_[static_cast<size_t>(s * D)];
          for (int64_t d = 0; d < D; ++d) accd_[static_cast<size_t>(d)] += p * v[d];
        }
        for (int64_t d = 0; d < D; ++d) o[d] = accd_[static_cast<size_t>(d)] / sum;
        lse = mx + std::log(sum);
      }
    }
  }
}

void host_runtime::merge_partials(int64_t item_index, const step_item& item, int64_t q0, int64_t q1,
                                  int64_t num_parts) {
  const model_config& c = weights_.config;
  const int64_t D = c.head_dim, qdim = c.q_dim(), Hq = c.num_q_heads;
  const int64_t T = static_cast<int64_t>(tokens_.size());
  const int64_t first = item_first_[static_cast<size_t>(item_index)];
  for (int64_t t = first; t < first + static_cast<int64_t>(item.tokens.size()); ++t)
    for (int64_t hq = q0; hq < q1; ++hq) {
      auto lse_of = [&](int64_t k) {
        return part_lse_[static_cast<size_t>((k * T + t) * Hq + hq)];
      };
      // The all-gathered LSEs: lse = m + log(sum_k exp(lse_k - m)), m = max_k lse_k (finite:
      // DCP index 0 holds position 0, which every query sees).
      double m = -INFINITY;
      for (int64_t k = 0; k < num_parts; ++k) m = std::max(m, lse_of(k));
      double sum = 0;
      for (int64_t k = 0; k < num_parts; ++k)
        if (lse_of(k) != -INFINITY) sum += std::exp(lse_of(k) - m);
      const double lse = m + std::log(sum);
      // Each part scaled by exp(lse_k - lse), summed in DCP-index order (the reduce-scatter);
      // the first visible part starts the sum (one part: o_0 exactly, with its zeros' signs).
      double* o = &o_[static_cast<size_t>(t * qdim + hq * D)];
      bool started = false;
      for (int64_t k = 0; k < num_parts; ++k) {
        if (lse_of(k) == -INFINITY) continue;
        const double w = std::exp(lse_of(k) - lse);
        const double* ok = &part_o_[static_cast<size_t>((k * T + t) * qdim + hq * D)];
        for (int64_t d = 0; d < D; ++d) o[d] = started ? o[d] + w * ok[d] : w * ok[d];
        started = true;
      }
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<float>(o[d]);
    }
}

void host_runtime::attention_ep(int64_t layer, const moebius::kv_state& tables,
                                std::span<const step_item> items) {
  const model_config& c = weights_.config;
  const int P = num_ranks();
  const int64_t T = static_cast<int64_t>(tokens_.size());
  grow(q_, T * c.q_dim());
  grow(part_o_, T * c.q_dim());
  grow(part_lse_, T * c.num_q_heads);
  for (size_t i = 0; i < items.size(); ++i) {
    const moebius::kv_sequence* seq = nullptr;
    int owner = 0;
    for (; owner < P && !seq; ++owner) seq = find_sequence(tables, owner, items[i].seq_id);
    MOEBIUS_CHECK(seq != nullptr, errc::invalid_argument, "step: sequence ", items[i].seq_id,
                  " is in no rank's EP tables");
    // The owner alone, every head: one part, merged exactly.
    const rank_kv kv{owner - 1, parallel_mode::ep, seq};
    const int64_t item = static_cast<int64_t>(i);
    store_new_kv(layer, kv, item, items[i], 0, c.num_kv_heads);
    project_queries(layer, item, items[i], 0, c.num_q_heads);
    partial_attention(layer, kv, item, items[i], 0, c.num_q_heads, 0);
    merge_partials(item, items[i], 0, c.num_q_heads, 1);
  }
  // o_proj on the owner over all heads: one sum.
  const dense_layer& dw = dense_[static_cast<size_t>(layer)];
  const int64_t H = c.hidden, qdim = c.q_dim();
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
  const int64_t H = c.hidden, D = c.head_dim, qdim = c.q_dim(), Hq = c.num_q_heads,
                T = static_cast<int64_t>(tokens_.size());
  const int dcp = static_cast<int>(g.dcp);
  grow(q_, T * qdim);
  grow(part_o_, dcp * T * qdim);
  grow(part_lse_, dcp * T * Hq);
  std::vector<rank_kv> set(static_cast<size_t>(dcp));
  // One DCP set at a time: ranks r0 .. r0+dcp-1 (dcp 1: each rank alone), one head slice.
  for (int r0 = 0; r0 < P; r0 += dcp) {
    const int64_t kv0 = g.tp_slice_of_rank(r0) * g.heads_per_tp_page();
    const int64_t kv1 = kv0 + g.heads_per_tp_page();
    const int64_t set_q0 = r0 * Hq / P, set_q1 = (r0 + dcp) * Hq / P;  // the set's q heads
    for (size_t i = 0; i < items.size(); ++i) {
      const int64_t item = static_cast<int64_t>(i);
      for (int k = 0; k < dcp; ++k) {
        const moebius::kv_sequence* seq = find_sequence(tables, r0 + k, items[i].seq_id);
        MOEBIUS_CHECK(seq != nullptr, errc::invalid_argument, "step: sequence ", items[i].seq_id,
                      " is not in TP rank ", r0 + k, "'s tables");
        set[static_cast<size_t>(k)] = {r0 + k, parallel_mode::tp, seq};
        store_new_kv(layer, set[static_cast<size_t>(k)], item, items[i], kv0, kv1);
      }
      // Q of every member's heads, all-gathered within the set; each member's part over its
      // positions; each member merges its own heads (the LSE all-gather and reduce-scatter).
      project_queries(layer, item, items[i], set_q0, set_q1);
      for (int k = 0; k < dcp; ++k)
        partial_attention(layer, set[static_cast<size_t>(k)], item, items[i], set_q0, set_q1, k);
      for (int r = r0; r < r0 + dcp; ++r)
        merge_partials(item, items[i], r * Hq / P, (r + 1) * Hq / P, dcp);
    }
  }
  std::fill(acc_.begin(), acc_.begin() + T * H, 0.0);
  for (int r = 0; r < P; ++r) {
    const int64_t q0 = r * Hq / P, q1 = (r + 1) * Hq / P;
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
