#pragma once

// Internal to the KV migration planner: turns page moves into copy_ops.
//
// Addresses come from the pool's kv_pool_layout. With the present layout every page move is ONE
// op strided over all tensors (rows = num_tensors, pitch region_bytes) whenever a head slice is
// contiguous in the EP page, so a later pass can restrict a plan to a range of layers by cutting
// rows. Other layouts coalesce as far as their pitches allow: all tensors at one pitch (K and V
// regions evenly spaced), or K and V of a layer side by side as one row (vLLM FlashInfer), or
// one op per K|V over the layers. Only NHD with page_size > 1 interleaves the heads of a token:
// there a slice is a 2-D grid of (tensor, token) pieces and the larger side becomes the rows.

#include <cstdint>
#include <vector>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "moebius/kv/kv_pool_layout.hpp"
#include "moebius/plan/plan.hpp"

namespace moebius::kv_detail {

// Where one page (of one kind) starts and how far apart its per-tensor pieces are: tensor
// (layer, t) at base + layer * layer_pitch + t * kv_pitch (a pool page: the layout's strides; a
// staging slot: dense, tensor k at k * page bytes).
struct page_ref {
  memory_space space = memory_space::kv_pool;
  int rank = 0;
  int64_t base = 0;         // offset of tensor (0, K)'s piece
  int64_t layer_pitch = 0;  // bytes between layer l and l+1 pieces
  int64_t kv_pitch = 0;     // bytes between the K and V pieces of a layer
};

class copy_emitter {
 public:
  copy_emitter(const kv_geometry& g, const kv_pool_layout& layout, const kv_staging& staging)
      : g_(g), layout_(layout), staging_(staging), block_(kv_slice_is_block(g, layout)) {}

  // Ops go to `ops` until the next call (the current phase's ops or restores).
  void target(std::vector<copy_op>* ops) { ops_ = ops; }
  // Bytes of every op emitted while counting (restores are not counted).
  int64_t bytes() const { return bytes_; }
  void count_bytes(bool on) { counting_ = on; }

  page_ref pool(parallel_mode m, int rank, int64_t page) const;
  // Staging slot `slot` (one page of kind m over all tensors).
  page_ref stage(parallel_mode m, int rank, int64_t slot) const;
  // Head slice j of an EP page reference (block slices only: kv_slice_is_block): a TP-kind
  // reference.
  page_ref slice_of(const page_ref& ep, int64_t j) const;

  // A whole page of kind m (all tensors): one op.
  void whole(parallel_mode m, const page_ref& src, const page_ref& dst);
  // Head slice j of EP page `ep` <-> TP page `tp` (to_tp: ep -> tp, else tp -> ep).
  void slice(const page_ref& ep, int64_t j, const page_ref& tp, bool to_tp);

 private:
  void op(const page_ref& s, int64_t s_off, int64_t s_pitch, const page_ref& d, int64_t d_off,
          int64_t d_pitch, int64_t rows, int64_t row_bytes);
  // `row` bytes of every tensor, at s_off (resp. d_off) + the tensor's offset in s (resp. d),
  // in as few ops as the pitches allow.
  void per_tensor(const page_ref& s, int64_t s_off, const page_ref& d, int64_t d_off,
                  int64_t row);

  const kv_geometry& g_;
  const kv_pool_layout layout_;  // a copy: callers may pass a temporary
  const kv_staging& staging_;
  bool block_;
  std::vector<copy_op>* ops_ = nullptr;
  int64_t bytes_ = 0;
  bool counting_ = true;
};

}  // namespace moebius::kv_detail
