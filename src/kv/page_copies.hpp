#pragma once

// Internal to the KV migration planner: turns page moves into copy_ops.
//
// Every page move is ONE op strided over all tensors (rows = num_tensors, pitch region_bytes)
// whenever a head slice is contiguous in the EP page, so a later pass can restrict a plan to a
// range of layers by cutting rows. Only NHD with page_size > 1 interleaves the heads of a token:
// there a slice is a 2-D grid of (tensor, token) pieces and the larger side becomes the rows.

#include <cstdint>
#include <vector>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "moebius/plan/plan.hpp"

namespace moebius::kv_detail {

// Whether head slice j of EP page p is exactly TP page p*split + j (bytes and layout): HND,
// an unsplit page, or NHD with one token per page ([token][head][dim] with one token is
// [head][dim]). Then the TP pages of an EP page fill (and empty) one by one.
//   Qwen3 (H_kv=4) NHD page 1, P=2: EP page 5 = TP pages 10 (heads 0,1) and 11 (heads 2,3).
constexpr bool slices_contiguous(const kv_geometry& g) {
  return g.layout == kv_layout::hnd || g.page_size == 1 || g.tp_pages_per_ep_page() == 1;
}

// Where one page (of one kind) starts and how far apart its per-tensor pieces are.
struct page_ref {
  memory_space space = memory_space::kv_pool;
  int rank = 0;
  int64_t base = 0;     // offset of tensor 0's piece
  int64_t k_pitch = 0;  // bytes between tensor k and k+1 pieces
};

class copy_emitter {
 public:
  copy_emitter(const kv_geometry& g, const kv_staging& staging) : g_(g), staging_(staging) {}

  // Ops go to `ops` until the next call (the current phase's ops or restores).
  void target(std::vector<copy_op>* ops) { ops_ = ops; }
  // Bytes of every op emitted while counting (restores are not counted).
  int64_t bytes() const { return bytes_; }
  void count_bytes(bool on) { counting_ = on; }

  page_ref pool(parallel_mode m, int rank, int64_t page) const;
  // Staging slot `slot` (one page of kind m over all tensors).
  page_ref stage(parallel_mode m, int rank, int64_t slot) const;
  // Head slice j of an EP page reference (contiguous slices only): a TP-kind reference.
  page_ref slice_of(const page_ref& ep, int64_t j) const;

  // A whole page of kind m (all tensors): one op.
  void whole(parallel_mode m, const page_ref& src, const page_ref& dst);
  // Head slice j of EP page `ep` <-> TP page `tp` (to_tp: ep -> tp, else tp -> ep).
  void slice(const page_ref& ep, int64_t j, const page_ref& tp, bool to_tp);

 private:
  void op(const page_ref& s, int64_t s_off, int64_t s_pitch, const page_ref& d, int64_t d_off,
          int64_t d_pitch, int64_t rows, int64_t row_bytes);

  const kv_geometry& g_;
  const kv_staging& staging_;
  std::vector<copy_op>* ops_ = nullptr;
  int64_t bytes_ = 0;
  bool counting_ = true;
};

}  // namespace moebius::kv_detail
