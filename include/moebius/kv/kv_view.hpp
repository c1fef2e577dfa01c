#pragma once

// What an attention kernel reads: one rank's paged KV pool in one mode, with a CSR page table
// (FlashInfer's paged_kv_t shape). Trivially copyable; pass it to kernels by value.
//
//   two sequences of 40 and 3 tokens, page_size 16, pages {7,2,9} and {4}:
//   page_indptr = {0, 3, 4}, page_indices = {7, 2, 9, 4}, last_page_len = {8, 3}.

#include <cstddef>
#include <cstdint>

#include "moebius/detail/host_device.hpp"
#include "moebius/kv/kv_geometry.hpp"

namespace moebius {

struct kv_view {
  kv_geometry geometry;                   // the pool's shape (both modes)
  parallel_mode mode = parallel_mode::ep; // which view of the bytes
  int rank = 0;                           // this rank (TP: selects the head slice)
  std::byte* pool = nullptr;              // [pool_bytes] this rank's kv_pool
  int64_t num_seqs = 0;                   // sequences in the batch
  const int64_t* page_indptr = nullptr;   // [num_seqs + 1] CSR row pointers into page_indices
  const int64_t* page_indices = nullptr;  // [page_indptr[num_seqs]] page ids, token order
  const int64_t* last_page_len = nullptr; // [num_seqs] tokens in each last page, [1, page_size]

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
  MOEBIUS_HOST_DEVICE constexpr int64_t num_tokens(int64_t seq) const {
    return (page_indptr[seq + 1] - page_indptr[seq] - 1) * geometry.page_size + last_page_len[seq];
  }
  // Address of element 0 of (layer, K|V, seq, token, local head).
  MOEBIUS_HOST_DEVICE std::byte* element(int64_t layer, kv_tensor t, int64_t seq, int64_t token,
                                         int64_t head) const {
    const int64_t page = page_indices[page_indptr[seq] + token / geometry.page_size];
    return pool + geometry.offset(mode, layer, t, page, head, token % geometry.page_size, 0);
  }
};

}  // namespace moebius
