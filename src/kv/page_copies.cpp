#include "page_copies.hpp"

namespace moebius::kv_detail {

page_ref copy_emitter::pool(parallel_mode m, int rank, int64_t page) const {
  return {memory_space::kv_pool, rank, page * g_.page_bytes(m), g_.region_bytes()};
}

page_ref copy_emitter::stage(parallel_mode m, int rank, int64_t slot) const {
  const int64_t pb = g_.page_bytes(m);
  return {staging_.space, rank, staging_.offset + slot * g_.num_tensors() * pb, pb};
}

page_ref copy_emitter::slice_of(const page_ref& ep, int64_t j) const {
  return {ep.space, ep.rank, ep.base + j * g_.tp_page_bytes(), ep.k_pitch};
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

void copy_emitter::whole(parallel_mode m, const page_ref& s, const page_ref& d) {
  op(s, s.base, s.k_pitch, d, d.base, d.k_pitch, g_.num_tensors(), g_.page_bytes(m));
}

void copy_emitter::slice(const page_ref& e, int64_t j, const page_ref& t, bool to_tp) {
  if (slices_contiguous(g_)) {
    if (to_tp) whole(parallel_mode::tp, slice_of(e, j), t);
    else whole(parallel_mode::tp, t, slice_of(e, j));
    return;
  }
  const int64_t row = g_.heads_per_tp_page() * g_.head_bytes();
  const int64_t ep_pitch = g_.heads_per_ep_page() * g_.head_bytes();
  if (g_.page_size >= g_.num_tensors()) {
    for (int64_t k = 0; k < g_.num_tensors(); ++k) {  // rows = tokens
      const int64_t eo = e.base + k * e.k_pitch + j * row;
      const int64_t to = t.base + k * t.k_pitch;
      if (to_tp) op(e, eo, ep_pitch, t, to, row, g_.page_size, row);
      else op(t, to, row, e, eo, ep_pitch, g_.page_size, row);
    }
    return;
  }
  for (int64_t i = 0; i < g_.page_size; ++i) {  // rows = tensors
    const int64_t eo = e.base + i * ep_pitch + j * row;
    const int64_t to = t.base + i * row;
    if (to_tp) op(e, eo, e.k_pitch, t, to, t.k_pitch, g_.num_tensors(), row);
    else op(t, to, t.k_pitch, e, eo, e.k_pitch, g_.num_tensors(), row);
  }
}

}  // namespace moebius::kv_detail
