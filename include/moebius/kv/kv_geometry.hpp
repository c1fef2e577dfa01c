#pragma once

// Geometry of the paged KV pool (DESIGN.md §4): one fixed allocation per rank (the kv_pool
// memory space) read through two views, EP and TP.
//
// Pool layout, identical in both views (only the page size in bytes differs):
//
//   pool = [tensor k = layer * kv_tensors + (K=0 | V=1)] [region of region_bytes()]
//   region of tensor k = num_ep_pages EP pages of ep_page_bytes()
//                      = num_tp_pages TP pages of tp_page_bytes()   (same bytes)
//
// A page id therefore names the same page in every layer and in K and V: copying one page is
// one strided op of rows = num_tensors() with pitch region_bytes() (HND).
//
// EP page: page_size tokens x all H_kv heads.     HND [head][token][dim], NHD [token][head][dim]
// TP page: page_size tokens x heads_per_tp_page(). HND [head][token][dim], NHD [token][head][dim]
//
// Heads per TP rank ("split" = tp_pages_per_ep_page()):
//   H_kv >= P (P | H_kv): split = P, each TP rank r holds heads [r*H/P, (r+1)*H/P).
//   H_kv <  P (H_kv | P): split = H_kv, each TP rank holds ONE head, head r / (P/H_kv); every
//                          head is replicated on P/H_kv ranks.
//   latent (MLA, num_kv_heads == 0): split = 1, one tensor (no V), replicated whole on every
//                          TP rank; a TP page is an EP page.
// A TP page is 1/split of an EP page, so a TP pool has split x the EP page count in the same
// bytes, and with HND EP page p *is* TP pages p*split .. p*split+split-1, TP page p*split+j
// holding head slice j (DESIGN.md §4). TP rank r's own slice is j = tp_slice_of_rank(r).
//
// Worked example, Qwen3-235B (H_kv=4, head_dim 128, bf16, page_size 16, P=8):
//   ep_page_bytes = 16*4*128*2 = 16384 per (layer, K|V); split = 4; tp_page_bytes = 4096
//   (one head); TP ranks 0,1 hold head 0, ranks 2,3 head 1, 4,5 head 2, 6,7 head 3;
//   num_tp_pages = 4 * num_ep_pages. EP page 5 of rank 3 (HND) is TP pages 20..23 of rank 3,
//   and TP page 21 (head 1 = rank 3's own slice) stays in place on EP->TP. Because every
//   head lives on 2 TP ranks, TP mode holds at most H_kv/P = 1/2 of what EP mode holds.

#include <cstdint>
#include <iosfwd>

#include "moebius/detail/host_device.hpp"
#include "moebius/error.hpp"
#include "moebius/layout/dtype.hpp"
#include "moebius/layout/parallel_mode.hpp"

namespace moebius {

// Order of a page's dimensions. HND makes a head slice of a page one contiguous block (a TP
// page is a contiguous piece of an EP page); NHD slices are page_size strided pieces.
enum class kv_layout : uint8_t {
  hnd,  // [head][token][dim] (default)
  nhd,  // [token][head][dim]
};

constexpr bool is_valid(kv_layout l) { return l == kv_layout::hnd || l == kv_layout::nhd; }

constexpr const char* to_string(kv_layout l) {
  switch (l) {
    case kv_layout::hnd: return "HND";
    case kv_layout::nhd: return "NHD";
  }
  return "unknown";
}

enum class kv_tensor : uint8_t { k = 0, v = 1 };

constexpr bool is_valid(kv_tensor t) { return t == kv_tensor::k || t == kv_tensor::v; }

struct kv_geometry {
  int64_t num_layers = 0;      // L: attention layers with a KV cache
  int64_t num_kv_heads = 0;    // H_kv; 0 = latent KV (MLA): one head-less tensor, no V
  int64_t head_dim = 0;        // D: elements per head (latent: the latent width, e.g. 576)
  int64_t page_size = 0;       // tokens per page, in both views
  int64_t num_ep_pages = 0;    // EP pages per rank (TP pages per rank: num_tp_pages())
  int num_ranks = 1;           // P
  dtype type = dtype::bf16;    // element type of K and V
  kv_layout layout = kv_layout::hnd;

  MOEBIUS_HOST_DEVICE constexpr bool latent() const { return num_kv_heads == 0; }
  // K and V (2), or the latent tensor alone (1).
  MOEBIUS_HOST_DEVICE constexpr int64_t kv_tensors() const { return latent() ? 1 : 2; }
  // Per-layer tensors in the pool: L * kv_tensors.
  MOEBIUS_HOST_DEVICE constexpr int64_t num_tensors() const { return num_layers * kv_tensors(); }
  // Heads of an EP page: H_kv (latent: 1).
  MOEBIUS_HOST_DEVICE constexpr int64_t heads_per_ep_page() const {
    return latent() ? 1 : num_kv_heads;
  }
  // TP pages per EP page ("split"): min(H_kv, P), latent 1.
  MOEBIUS_HOST_DEVICE constexpr int64_t tp_pages_per_ep_page() const {
    return latent() ? 1 : (num_kv_heads < num_ranks ? num_kv_heads : num_ranks);
  }
  // Heads of a TP page: H_kv/P (H_kv >= P), 1 (H_kv < P or latent).
  MOEBIUS_HOST_DEVICE constexpr int64_t heads_per_tp_page() const {
    return heads_per_ep_page() / tp_pages_per_ep_page();
  }
  // Head slice j (TP page p*split+j of EP page p) held by TP rank r: r*split/P.
  //   H=8,P=4: rank 2 -> slice 2 = heads 4..5.   H=4,P=8: rank 5 -> slice 2 = head 2.
  MOEBIUS_HOST_DEVICE constexpr int64_t tp_slice_of_rank(int64_t rank) const {
    return rank * tp_pages_per_ep_page() / num_ranks;
  }
  // Ranks holding each slice in TP: P/split (1 when H_kv >= P).
  MOEBIUS_HOST_DEVICE constexpr int64_t tp_replicas() const {
    return num_ranks / tp_pages_per_ep_page();
  }
  MOEBIUS_HOST_DEVICE constexpr int64_t num_tp_pages() const {
    return num_ep_pages * tp_pages_per_ep_page();
  }
  MOEBIUS_HOST_DEVICE constexpr int64_t num_pages(parallel_mode m) const {
    return m == parallel_mode::ep ? num_ep_pages : num_tp_pages();
  }
  // Bytes of one element, one head of one token (D * dtype).
  MOEBIUS_HOST_DEVICE constexpr int64_t head_bytes() const { return head_dim * dtype_bytes(type); }
  // Bytes of one page of one tensor (one layer, K or V).
  MOEBIUS_HOST_DEVICE constexpr int64_t ep_page_bytes() const {
    return page_size * heads_per_ep_page() * head_bytes();
  }
  MOEBIUS_HOST_DEVICE constexpr int64_t tp_page_bytes() const {
    return page_size * heads_per_tp_page() * head_bytes();
  }
  MOEBIUS_HOST_DEVICE constexpr int64_t page_bytes(parallel_mode m) const {
    return m == parallel_mode::ep ? ep_page_bytes() : tp_page_bytes();
  }
  // Bytes of one tensor's region: num_ep_pages * ep_page_bytes.
  MOEBIUS_HOST_DEVICE constexpr int64_t region_bytes() const {
    return num_ep_pages * ep_page_bytes();
  }
  // Bytes of one rank's pool: num_tensors * region_bytes.
  MOEBIUS_HOST_DEVICE constexpr int64_t pool_bytes() const { return num_tensors() * region_bytes(); }
  // Bytes one page occupies over all layers and K/V.
  MOEBIUS_HOST_DEVICE constexpr int64_t page_bytes_all_tensors(parallel_mode m) const {
    return num_tensors() * page_bytes(m);
  }
  // Byte offset of tensor `k` (= layer * kv_tensors + K|V) within a rank's pool.
  MOEBIUS_HOST_DEVICE constexpr int64_t tensor_offset(int64_t layer, kv_tensor t) const {
    return (layer * kv_tensors() + static_cast<int64_t>(t)) * region_bytes();
  }

  // Byte offset in a rank's pool of element (layer, K|V, page, head, token, dim) in mode m.
  // `head` is the head index within the page: [0, H_kv) in EP, [0, heads_per_tp_page) in TP
  // (global head = tp_slice_of_rank(r) * heads_per_tp_page + head).
  //   Qwen3 above, EP, HND: (layer 1, V, page 5, head 2, token 3, dim 0)
  //     = (1*2+1)*region + 5*16384 + (2*16 + 3)*128*2.
  MOEBIUS_HOST_DEVICE constexpr int64_t offset(parallel_mode m, int64_t layer, kv_tensor t,
                                               int64_t page, int64_t head, int64_t token,
                                               int64_t dim) const {
    const int64_t heads = m == parallel_mode::ep ? heads_per_ep_page() : heads_per_tp_page();
    const int64_t in_page = layout == kv_layout::hnd ? (head * page_size + token) * head_dim + dim
                                                     : (token * heads + head) * head_dim + dim;
    return tensor_offset(layer, t) + page * page_bytes(m) + in_page * dtype_bytes(type);
  }

  friend constexpr bool operator==(const kv_geometry&, const kv_geometry&) = default;
};

// Throws errc::invalid_argument (naming the constraint and values) unless: L >= 1,
// H_kv >= 0, D >= 1, page_size >= 1, num_ep_pages >= 0, P >= 1, and P | H_kv when H_kv >= P,
// H_kv | P when 0 < H_kv < P; errc::overflow when pool_bytes does not fit in 64 bits.
void validate(const kv_geometry& g);

// Builds and validates a geometry. Qwen3-235B, 64 pages per rank, P=8:
//   make_kv_geometry(94, 4, 128, 16, 64, 8) -> pool_bytes = 188 * 64 * 16384 = 197 MB.
kv_geometry make_kv_geometry(int64_t num_layers, int64_t num_kv_heads, int64_t head_dim,
                             int64_t page_size, int64_t num_ep_pages, int num_ranks,
                             dtype type = dtype::bf16, kv_layout layout = kv_layout::hnd);

// The largest num_ep_pages whose pool fits in `pool_bytes` (the engine's KV budget per rank).
int64_t ep_pages_for_bytes(const kv_geometry& g, int64_t pool_bytes);

std::ostream& operator<<(std::ostream& os, const kv_geometry& g);

}  // namespace moebius
