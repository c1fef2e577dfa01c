#include "page_copies.hpp"

namespace moebius::kv_detail {

page_ref copy_emitter::pool(parallel_mode m, int rank, int64_t page) const {
  const kv_strides& s = layout_.view(m);
  return {memory_space::kv_pool, rank, s.base + page * s.page, s.layer, s.kv};
}

page_ref copy_emitter::stage(parallel_mode m, int rank, int64_t slot) const {
  const int64_t pb = g_.page_bytes(m);
  return {staging_.space, rank, staging_.offset + slot * g_.num_tensors() * pb,
          g_.kv_tensors() * pb, pb};
}

page_ref copy_emitter::slice_of(const page_ref& ep, int64_t j) const {
  return {ep.space, ep.rank, ep.base + j * g_.tp_page_bytes(), ep.layer_pitch, ep.kv_pitch};
}

void copy_emitter::op(const page_ref& s, int64_t s_off, int64_t s_pitch, const page_ref& d,
                      int64_t d_off, int64_t d_pitch, int64_t rows, int64_t row_bytes) {
  if (counting_) bytes_ += rows * row_bytes;
  copy_op c;
  c.src_space = s.space;
  c.dst_space = d.space;
  c.src_rank = s.rank;
  c.dst_rank = d.rank;
  c.src_offset = s_off;
  c.dst_offset = d_off;
  c.rows = rows;
  c.row_bytes = row_bytes;
  c.src_pitch = rows == 1 ? row_bytes : s_pitch;
  c.dst_pitch = rows == 1 ? row_bytes : d_pitch;
  ops_->push_back(c);
}

namespace {

// The one pitch between consecutive tensors k = layer * kv_tensors + t, or -1 when the tensors
// are not evenly spaced.
int64_t tensor_pitch(const kv_geometry& g, const page_ref& r) {
  if (g.kv_tensors() == 1) return r.layer_pitch;
  return r.layer_pitch == 2 * r.kv_pitch ? r.kv_pitch : -1;
}

}  // namespace

void copy_emitter::per_tensor(const page_ref& s, int64_t s_off, const page_ref& d, int64_t d_off,
                              int64_t row) {
  const int64_t sp = tensor_pitch(g_, s), dp = tensor_pitch(g_, d);
  if (sp >= 0 && dp >= 0) {  // the present layout and staging: one op over all tensors
    op(s, s_off, sp, d, d_off, dp, g_.num_tensors(), row);
    return;
  }
  if (s.kv_pitch == row && d.kv_pitch == row) {  // K and V side by side: one row per layer
    op(s, s_off, s.layer_pitch, d, d_off, d.layer_pitch, g_.num_layers, 2 * row);
    return;
  }
  for (int64_t t = 0; t < 2; ++t)  // one op per K|V over the layers
    op(s, s_off + t * s.kv_pitch, s.layer_pitch, d, d_off + t * d.kv_pitch, d.layer_pitch,
       g_.num_layers, row);
}

void copy_emitter::whole(parallel_mode m, const page_ref& s, const page_ref& d) {
  per_tensor(s, s.base, d, d.base, g_.page_bytes(m));
}

void copy_emitter::slice(const page_ref& e, int64_t j, const page_ref& t, bool to_tp) {
  if (block_) {
    if (to_tp)
      whole(parallel_mode::tp, slice_of(e, j), t);
    else
      whole(parallel_mode::tp, t, slice_of(e, j));
    return;
  }
  // NHD, page_size > 1: slice j is page_size rows of heads_per_tp_page heads, one per token.
  const int64_t row = g_.heads_per_tp_page() * g_.head_bytes();
  const int64_t ep_pitch = g_.heads_per_ep_page() * g_.head_bytes();
  const int64_t kt = g_.kv_tensors();
  auto at = [&](const page_ref& r, int64_t k) {
    return r.base + (k / kt) * r.layer_pitch + (k % kt) * r.kv_pitch;
  };
  const int64_t ep_k = tensor_pitch(g_, e), tp_k = tensor_pitch(g_, t);
  if ((ep_k < 0 || tp_k < 0) && kt * g_.page_size < g_.num_tensors()) {
    // Tensors not evenly spaced (a layer stride other than 2 x the K|V stride: per-layer
    // allocations): one op per (K|V, token), rows = layers, rather than one per tensor.
    for (int64_t kv = 0; kv < kt; ++kv) {
      for (int64_t i = 0; i < g_.page_size; ++i) {
        const int64_t eo = at(e, kv) + i * ep_pitch + j * row;
        const int64_t to = at(t, kv) + i * row;
        if (to_tp)
          op(e, eo, e.layer_pitch, t, to, t.layer_pitch, g_.num_layers, row);
        else
          op(t, to, t.layer_pitch, e, eo, e.layer_pitch, g_.num_layers, row);
      }
    }
    return;
  }
  if (g_.page_size >= g_.num_tensors() || ep_k < 0 || tp_k < 0) {
    for (int64_t k = 0; k < g_.num_tensors(); ++k) {  // rows = tokens
      const int64_t eo = at(e, k) + j * row;
      const int64_t to = at(t, k);
      if (to_tp)
        op(e, eo, ep_pitch, t, to, row, g_.page_size, row);
      else
        op(t, to, row, e, eo, ep_pitch, g_.page_size, row);
    }
    return;
  }
  for (int64_t i = 0; i < g_.page_size; ++i) {  // rows = tensors
    const int64_t eo = e.base + i * ep_pitch + j * row;
    const int64_t to = t.base + i * row;
    if (to_tp)
      op(e, eo, ep_k, t, to, tp_k, g_.num_tensors(), row);
    else
      op(t, to, tp_k, e, eo, ep_k, g_.num_tensors(), row);
  }
}

}  // namespace moebius::kv_detail
