#pragma once

// What an attention kernel reads: one rank's paged KV pool in one mode, with a CSR page table
// (FlashInfer's paged_kv_t shape). Trivially copyable; pass it to kernels by value.
//
// The view carries the pool's layout (where bytes lie: kv_pool_layout, any engine's cache) and,
// in TP with geometry.dcp > 1, this rank's DCP share: the page table lists only the pages of
// each sequence this rank holds (logical pages k, k+dcp, k+2dcp, .. for DCP index k), in token
// order, and last_page_len is the fill of this rank's last page of the sequence. So a kernel
// attends to its local tokens as to an ordinary paged sequence (num_tokens() is the local
// count; the partial outputs are merged across the DCP set by log-sum-exp), and element() maps
// a token of the WHOLE sequence to (its DCP rank, local page, slot): the one address rule.
//
//   two sequences of 40 and 3 tokens, page_size 16, pages {7,2,9} and {4}:
//   page_indptr = {0, 3, 4}, page_indices = {7, 2, 9, 4}, last_page_len = {8, 3}.
//   The same with dcp 2, on the rank of DCP index 0: pages {7, 9} (logical 0, 2) and {4};
//   last_page_len = {8, 3}; on DCP index 1: pages {2} (logical 1) and none, last_page_len
//   = {16, 0}: num_tokens = 16 and 0.

#include <cstddef>
#include <cstdint>

#include "moebius/detail/host_device.hpp"
#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/kv_pool_layout.hpp"

namespace moebius {

struct kv_view {
  kv_geometry geometry;                   // the pool's shape (both modes) and its dcp
  kv_pool_layout layout;                  // where its bytes lie (present_kv_layout(geometry))
  parallel_mode mode = parallel_mode::ep; // which view of the bytes
  int rank = 0;                           // this rank (TP: selects the head slice, DCP index)
  std::byte* pool = nullptr;              // [layout.pool_bytes] this rank's kv_pool
  int64_t num_seqs = 0;                   // sequences in the batch
  const int64_t* page_indptr = nullptr;   // [num_seqs + 1] CSR row pointers into page_indices
  const int64_t* page_indices = nullptr;  // [page_indptr[num_seqs]] this rank's page ids of
                                          // each sequence, token order
  const int64_t* last_page_len = nullptr; // [num_seqs] tokens in this rank's last page of each
                                          // sequence, [1, page_size]; 0 when it holds none

  // DCP index of this rank: 0 in EP (a sequence is whole on its owner), rank % dcp in TP.
  MOEBIUS_HOST_DEVICE constexpr int64_t dcp_rank() const {
    return mode == parallel_mode::ep ? 0 : geometry.dcp_rank(rank);
  }
  // Ranks splitting a sequence's tokens with this one: 1 in EP, dcp in TP.
  MOEBIUS_HOST_DEVICE constexpr int64_t dcp() const {
    return mode == parallel_mode::ep ? 1 : geometry.dcp;
  }
  // Heads this rank serves: H_kv (EP), heads_per_tp_page (TP).
  MOEBIUS_HOST_DEVICE constexpr int64_t local_heads() const {
    return mode == parallel_mode::ep ? geometry.heads_per_ep_page()
                                     : geometry.heads_per_tp_page();
  }
  // Global index of local head h: h (EP), slice * heads_per_tp_page + h (TP).
  MOEBIUS_HOST_DEVICE constexpr int64_t global_head(int64_t h) const {
    return mode == parallel_mode::ep
               ? h
               : geometry.tp_slice_of_rank(rank) * geometry.heads_per_tp_page() + h;
  }
  // Tokens of sequence `seq` this rank holds (all of them unless TP with dcp > 1).
  MOEBIUS_HOST_DEVICE constexpr int64_t num_tokens(int64_t seq) const {
    const int64_t pages = page_indptr[seq + 1] - page_indptr[seq];
    return pages == 0 ? 0 : (pages - 1) * geometry.page_size + last_page_len[seq];
  }
  // Whether token `token` of the whole sequence is on this rank (always, unless dcp > 1).
  MOEBIUS_HOST_DEVICE constexpr bool holds(int64_t token) const {
    return (token / geometry.page_size) % dcp() == dcp_rank();
  }
  // Address of element 0 of (layer, K|V, seq, token of the whole sequence, local head).
  // Requires holds(token). dcp 2, page 16, DCP index 1: token 21 is local page 0, slot 5.
  MOEBIUS_HOST_DEVICE std::byte* element(int64_t layer, kv_tensor t, int64_t seq, int64_t token,
                                         int64_t head) const {
    kv_geometry g = geometry;
    if (mode == parallel_mode::ep) g.dcp = 1;
    const kv_token_place at = g.token_place(token);
    const int64_t page = page_indices[page_indptr[seq] + at.local_page];
    return pool + layout.offset(mode, layer, t, page, head, at.slot, 0);
  }
};

}  // namespace moebius
