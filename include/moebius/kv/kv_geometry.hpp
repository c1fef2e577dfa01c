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
//
// Decode context parallel (dcp, issue 40; vLLM `-dcp`): the tp_replicas() ranks that hold one
// head slice in TP stop holding every token of every sequence. They form tp_replicas()/dcp
// replica sets of dcp consecutive ranks (rank r has DCP index r % dcp), and within a set the
// ranks split each sequence's tokens at page granularity: logical page i of a sequence (its
// tokens [i*page_size, (i+1)*page_size)) lives on the rank of DCP index i % dcp, as that
// rank's local page i / dcp of the sequence. Why this interleave (vLLM interleaves tokens;
// pages are our unit of allocation and of copying):
//   - shares stay balanced as a sequence grows: the ranks' page counts differ by at most one
//     at every length, so a decode step appends to one rank and the pools fill evenly;
//   - the last (partial, growing) page of an n-page sequence is on DCP index (n-1) % dcp,
//     known from the token count alone, with no table lookup;
//   - page-table arithmetic is a division: token t -> (DCP index (t/page_size) % dcp, local
//     page (t/page_size) / dcp, slot t % page_size), and DCP index k holds
//     ceil((n-k)/dcp) of n pages.
// (Contiguous blocks of pages per rank would put every new token on one rank and need each
// sequence's final length to size the blocks.) The price: every sequence starts on DCP index
// 0, so index 0 holds up to one page a sequence more than the others. At the paper's
// deployment (2,048 requests of thousands of tokens) that is < 1% of the pool; many
// sequences of a page or two make it large (a start rotated by sequence would even it out,
// at the cost of a per-sequence offset in every table and kernel). The EP view and the pool's bytes do not change:
// a TP rank still has num_tp_pages() pages of heads_per_tp_page() heads; it holds 1/dcp of the
// tokens, so the TP view holds dcp x the tokens (max_tokens()). dcp = 1 is the plain TP view.
// Allowed: dcp | tp_replicas() (H_kv < P: dcp | P/H_kv; H_kv >= P: dcp = 1; latent KV, which
// TP replicates on every rank: dcp | P).
//   Qwen3 above, dcp 2: ranks 0,1 share head 0 and split its tokens: rank 0 holds logical pages
//   0,2,4.. of every sequence, rank 1 pages 1,3,5..; a 5-page sequence is 3 pages on rank 0 and
//   2 on rank 1, its last page on rank 0 (DCP index 4 % 2 = 0). TP holds as much as EP.

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

// Byte strides of one view of a pool (kv_pool_layout.hpp). `head` is the head index within the
// view's page (EP: [0, H_kv), TP: [0, heads_per_tp_page)); `kv` is ignored for latent KV (one
// tensor per layer). offset() is THE description of where a KV byte lies: kv_geometry::offset
// (the present pool), kv_pool_layout::offset (any engine's pool), kv_view::element (what a
// kernel reads) and deployment_memory::kv_region all come down to it.
struct kv_strides {
  int64_t base = 0;  // offset of element (layer 0, K, page 0, token 0, head 0, dim 0)
  int64_t layer = 0;
  int64_t kv = 0;  // K -> V of one layer
  int64_t page = 0;
  int64_t token = 0;
  int64_t head = 0;
  int64_t dim = 0;

  // Offset of page 0 of tensor (layer, t).
  MOEBIUS_HOST_DEVICE constexpr int64_t tensor(int64_t l, kv_tensor t) const {
    return base + l * layer + static_cast<int64_t>(t) * kv;
  }
  // Offset of element (layer, K|V, page, head, token in page, dim).
  //   present pool of Qwen3 (below), EP: (1, V, 5, 2, 3, 0) = 3*region + 5*16384 + (2*16+3)*256.
  MOEBIUS_HOST_DEVICE constexpr int64_t offset(int64_t l, kv_tensor t, int64_t p, int64_t h,
                                               int64_t tok, int64_t d) const {
    return tensor(l, t) + p * page + tok * token + h * head + d * dim;
  }
  friend constexpr bool operator==(const kv_strides&, const kv_strides&) = default;
};

// Where a token of a sequence lies in the TP view with dcp (kv_geometry::token_place).
struct kv_token_place {
  int64_t dcp_rank = 0;    // DCP index of the rank holding it, [0, dcp)
  int64_t local_page = 0;  // index among that rank's pages of the sequence
  int64_t slot = 0;        // token within the page, [0, page_size)
  friend constexpr bool operator==(const kv_token_place&, const kv_token_place&) = default;
};

struct kv_geometry {
  int64_t num_layers = 0;      // L: attention layers with a KV cache
  int64_t num_kv_heads = 0;    // H_kv; 0 = latent KV (MLA): one head-less tensor, no V
  int64_t head_dim = 0;        // D: elements per head (latent: the latent width, e.g. 576)
  int64_t page_size = 0;       // tokens per page, in both views
  int64_t num_ep_pages = 0;    // EP pages per rank (TP pages per rank: num_tp_pages())
  int num_ranks = 1;           // P
  dtype type = dtype::bf16;    // element type of K and V
  kv_layout layout = kv_layout::hnd;
  int64_t dcp = 1;             // TP view: ranks splitting one head slice's tokens (see above)

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
  // Sets of dcp ranks that each hold a whole copy of a head slice: tp_replicas() / dcp.
  //   Qwen3 (P=8, H_kv=4): dcp 1 -> 2 sets of one rank; dcp 2 -> 1 set {2j, 2j+1} per head j.
  MOEBIUS_HOST_DEVICE constexpr int64_t tp_replica_sets() const { return tp_replicas() / dcp; }
  // DCP index of TP rank r within its set: r % dcp. Qwen3, dcp 2: rank 5 -> 1.
  MOEBIUS_HOST_DEVICE constexpr int64_t dcp_rank(int64_t rank) const { return rank % dcp; }
  // The TP rank holding head slice j, in replica set `set`, with DCP index k:
  // j*tp_replicas() + set*dcp + k. Qwen3, dcp 2: (slice 2, set 0, k 1) -> rank 5.
  MOEBIUS_HOST_DEVICE constexpr int64_t tp_rank_of(int64_t slice, int64_t set, int64_t k) const {
    return slice * tp_replicas() + set * dcp + k;
  }
  // Replica set of TP rank r within its slice: (r % tp_replicas()) / dcp.
  MOEBIUS_HOST_DEVICE constexpr int64_t tp_replica_set(int64_t rank) const {
    return (rank % tp_replicas()) / dcp;
  }
  // Pages of an n-page sequence held by DCP index k: ceil((n - k) / dcp), 0 when n <= k.
  //   dcp 2, n = 5: k 0 -> 3 (logical 0, 2, 4), k 1 -> 2 (logical 1, 3).
  MOEBIUS_HOST_DEVICE constexpr int64_t dcp_pages_held(int64_t n, int64_t k) const {
    return n > k ? (n - k + dcp - 1) / dcp : 0;
  }
  // Logical page of local page `local` held by DCP index k: local * dcp + k (dcp 2: k 1,
  // local 2 -> 5).
  MOEBIUS_HOST_DEVICE constexpr int64_t dcp_logical_page(int64_t k, int64_t local) const {
    return local * dcp + k;
  }
  // The DCP index holding logical page i, and i's local page there (dcp_logical_page's
  // inverse): i % dcp, i / dcp. dcp 2: page 5 -> index 1, local page 2.
  MOEBIUS_HOST_DEVICE constexpr int64_t dcp_rank_of_page(int64_t i) const { return i % dcp; }
  MOEBIUS_HOST_DEVICE constexpr int64_t dcp_local_page(int64_t i) const { return i / dcp; }
  // Where token t of a sequence lies: DCP index (t/page_size) % dcp, local page
  // (t/page_size) / dcp, slot t % page_size. Page 16, dcp 2: token 35 -> (0, 1, 3).
  MOEBIUS_HOST_DEVICE constexpr kv_token_place token_place(int64_t token) const {
    const int64_t page = token / page_size;
    return {dcp_rank_of_page(page), dcp_local_page(page), token % page_size};
  }
  // Tokens of a `num_tokens`-token sequence held by DCP index k (its pages' tokens).
  //   page 16, dcp 2, 40 tokens (pages 16+16+8): k 0 -> 24 (pages 0, 2), k 1 -> 16.
  MOEBIUS_HOST_DEVICE constexpr int64_t dcp_tokens_held(int64_t num_tokens, int64_t k) const {
    const int64_t n = (num_tokens + page_size - 1) / page_size;
    const int64_t held = dcp_pages_held(n, k);
    if (held == 0) return 0;
    const bool has_last = (n - 1) % dcp == k;  // the last page is partial
    return has_last ? (held - 1) * page_size + (num_tokens - (n - 1) * page_size)
                    : held * page_size;
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
  // Tokens the whole view holds at most (every page full, all ranks): EP P * num_ep_pages *
  // page_size; TP num_tp_pages * page_size * dcp (every sequence is in every head slice; a
  // replica set of dcp ranks holds one copy). Qwen3 (P=8), 64 EP pages of 16: EP 8192; TP 4096
  // with dcp 1, 8192 with dcp 2.
  MOEBIUS_HOST_DEVICE constexpr int64_t max_tokens(parallel_mode m) const {
    return m == parallel_mode::ep ? num_ranks * num_ep_pages * page_size
                                  : num_tp_pages() * page_size * dcp;
  }
  // Strides of the present pool (Moebius's own: [layer][K|V][page], pages dense in `layout`
  // order) in view m. Qwen3, TP, HND: page 4096, head 16*256, token 256, dim 2.
  MOEBIUS_HOST_DEVICE constexpr kv_strides present_strides(parallel_mode m) const {
    const int64_t hb = head_bytes();
    const int64_t heads = m == parallel_mode::ep ? heads_per_ep_page() : heads_per_tp_page();
    kv_strides s;
    s.dim = dtype_bytes(type);
    s.token = layout == kv_layout::hnd ? hb : heads * hb;
    s.head = layout == kv_layout::hnd ? page_size * hb : hb;
    s.page = page_bytes(m);
    s.kv = latent() ? 0 : region_bytes();
    s.layer = kv_tensors() * region_bytes();
    return s;
  }
  // Byte offset of tensor `k` (= layer * kv_tensors + K|V) within a rank's pool.
  MOEBIUS_HOST_DEVICE constexpr int64_t tensor_offset(int64_t layer, kv_tensor t) const {
    return present_strides(parallel_mode::ep).tensor(layer, t);
  }

  // Byte offset in a rank's pool of element (layer, K|V, page, head, token, dim) in mode m.
  // `head` is the head index within the page: [0, H_kv) in EP, [0, heads_per_tp_page) in TP
  // (global head = tp_slice_of_rank(r) * heads_per_tp_page + head).
  //   Qwen3 above, EP, HND: (layer 1, V, page 5, head 2, token 3, dim 0)
  //     = (1*2+1)*region + 5*16384 + (2*16 + 3)*128*2.
  MOEBIUS_HOST_DEVICE constexpr int64_t offset(parallel_mode m, int64_t layer, kv_tensor t,
                                               int64_t page, int64_t head, int64_t token,
                                               int64_t dim) const {
    return present_strides(m).offset(layer, t, page, head, token, dim);
  }

  friend constexpr bool operator==(const kv_geometry&, const kv_geometry&) = default;
};

// Throws errc::invalid_argument (naming the constraint and values) unless: L >= 1,
// H_kv >= 0, D >= 1, page_size >= 1, num_ep_pages >= 0, P >= 1, and P | H_kv when H_kv >= P,
// H_kv | P when 0 < H_kv < P, dcp >= 1 and dcp | tp_replicas() (dcp = 1 when H_kv >= P, dcp | P
// when latent); errc::overflow when pool_bytes does not fit in 64 bits.
void validate(const kv_geometry& g);

// Builds and validates a geometry. Qwen3-235B, 64 pages per rank, P=8:
//   make_kv_geometry(94, 4, 128, 16, 64, 8) -> pool_bytes = 188 * 64 * 16384 = 197 MB.
kv_geometry make_kv_geometry(int64_t num_layers, int64_t num_kv_heads, int64_t head_dim,
                             int64_t page_size, int64_t num_ep_pages, int num_ranks,
                             dtype type = dtype::bf16, kv_layout layout = kv_layout::hnd);

// `g` with KV-parallel degree `dcp` in its TP view, validated (the pool is unchanged).
//   with_dcp(make_kv_geometry(94, 4, 128, 16, 64, 8), 2): ranks 2j, 2j+1 split head j's tokens.
//   with_dcp(same, 4): throws errc::invalid_argument, "dcp must divide tp_replicas() ...".
kv_geometry with_dcp(kv_geometry g, int64_t dcp);

// The largest num_ep_pages whose pool fits in `pool_bytes` (the engine's KV budget per rank).
int64_t ep_pages_for_bytes(const kv_geometry& g, int64_t pool_bytes);

std::ostream& operator<<(std::ostream& os, const kv_geometry& g);

}  // namespace moebius
