#pragma once

// Page tables and allocator state of the paged KV pool, per rank, for the current mode.
//
// EP mode: each sequence lives on ONE rank (its owner) with EP page ids of that rank.
// TP mode: each sequence lives on EVERY rank, with that rank's own TP page ids (each rank
//          holds its head slice; ids differ between ranks, page counts are the same).
// TP mode, dcp > 1 (kv_geometry.hpp): each rank still lists every sequence, but holds only its
//          DCP share of the pages: rank r (DCP index k = r % dcp) holds logical pages
//          k, k+dcp, k+2dcp, .. of the sequence, in that order, possibly none. The other
//          fields describe the WHOLE sequence, identical on every rank: num_tokens is its
//          token count, last_page_len the fill of its last logical page (held by DCP index
//          (n-1) % dcp), shared_prefix_pages counts logical pages. Ranks of one DCP index hold
//          the same logical pages (with their own ids) and share them alike.
// A page id names the same page in every layer and in K and V (kv_geometry.hpp).
//
// Shared prefixes (prefix caching): the first `shared_prefix_pages` pages of a sequence may
// also appear in other sequences' shared prefixes on the same rank; any other repeated page
// is an error. A shared page must be a full page.
//
//   page_size 16, a 40-token sequence: pages {7, 2, 9}, last_page_len 8,
//   num_tokens = 2*16 + 8 = 40. With dcp 2: DCP index 0 holds {7, 9} (logical 0, 2) and
//   DCP index 1 holds {2} (logical 1); both say num_tokens 40, last_page_len 8.

#include <cstdint>
#include <span>
#include <vector>

#include "moebius/kv/kv_geometry.hpp"

namespace moebius {

// One sequence's page table on one rank.
// Fields other than `pages` describe the whole sequence (with dcp > 1 too; see above).
struct kv_sequence {
  int64_t seq_id = 0;               // engine's id; unique within a rank
  int64_t num_tokens = 0;           // tokens whose K/V is cached: (logical pages-1)*page_size
                                    // + last_page_len
  int64_t last_page_len = 0;        // tokens in the last logical page, [1, page_size]
  int64_t shared_prefix_pages = 0;  // leading logical pages other sequences may share,
                                    // [0, logical pages]
  int64_t prefill_cursor = 0;       // engine's chunked-prefill cursor: carried through untouched
  std::vector<int64_t> pages;       // [num_pages] page ids in this rank's pool, in token order
                                    // (dcp > 1: this rank's share only)

  // Pages on this rank (dcp > 1: its share, not the sequence's).
  int64_t num_pages() const { return static_cast<int64_t>(pages.size()); }
  friend bool operator==(const kv_sequence&, const kv_sequence&) = default;
};

// One rank's tables and allocator.
struct kv_rank_state {
  std::vector<kv_sequence> sequences;  // sorted by seq_id
  std::vector<int64_t> free_pages;     // ascending; with the pages in use: every page once

  friend bool operator==(const kv_rank_state&, const kv_rank_state&) = default;
};

struct kv_state {
  parallel_mode mode = parallel_mode::ep;
  std::vector<kv_rank_state> ranks;  // [P]

  friend bool operator==(const kv_state&, const kv_state&) = default;
};

// The page count `num_tokens` tokens need: ceil(num_tokens / page_size).
constexpr int64_t pages_for_tokens(int64_t num_tokens, int64_t page_size) {
  return (num_tokens + page_size - 1) / page_size;
}

// DCP index of rank r's share in mode m: r % dcp in TP, 0 in EP (a sequence is whole on its
// owner).
constexpr int64_t share_of(const kv_geometry& g, parallel_mode m, int rank) {
  return m == parallel_mode::tp ? g.dcp_rank(rank) : 0;
}

// Of a sequence's first n logical pages, those rank r lists in mode m: n in EP (whole on its
// owner), dcp_pages_held(n, r % dcp) in TP. dcp 2, n = 3: EP 3; TP rank 0 -> 2, rank 1 -> 1.
constexpr int64_t pages_held(const kv_geometry& g, parallel_mode m, int rank, int64_t n) {
  return m == parallel_mode::tp ? g.dcp_pages_held(n, g.dcp_rank(rank)) : n;
}

// The logical pages of sequence `q` (all its pages over its DCP set): ceil(num_tokens /
// page_size). dcp 2, 40 tokens of 16: 3 (rank 0 lists 2 of them, rank 1 one).
inline int64_t logical_pages(const kv_geometry& g, const kv_sequence& q) {
  return pages_for_tokens(q.num_tokens, g.page_size);
}

// Logical page of q.pages[k] on rank r in mode m: k (EP, or dcp 1), k*dcp + r%dcp (TP).
inline int64_t logical_page(const kv_geometry& g, parallel_mode m, int rank, int64_t k) {
  return m == parallel_mode::tp ? g.dcp_logical_page(g.dcp_rank(rank), k) : k;
}

// Throws errc::invalid_argument naming the rank, sequence, page and constraint unless `s`
// is a valid state of `g`: g valid, mode EP or TP, ranks.size() == P; per sequence
// num_tokens >= 1, 1 <= last_page_len <= page_size, num_tokens == (n-1)*page_size +
// last_page_len for its n logical pages, its pages on the rank = n (EP, dcp 1) or
// dcp_pages_held(n, r % dcp) (TP), shared_prefix_pages in [0, n] and (when all pages are
// shared) last_page_len == page_size; seq ids unique and ascending per rank; every page id in [0, num_pages(mode));
// a page used twice only inside shared prefixes of different sequences (never twice in one
// sequence); free_pages ascending, disjoint from pages in use, and together with them
// covering every page (nothing leaked). In EP mode a seq id lives on one rank only; in TP
// mode every rank holds the same sequences with the same token counts and the same sharing
// (two sequence pages share a page id on one rank iff they do on every rank of its DCP index).
void validate(const kv_geometry& g, const kv_state& s);

// A state whose free lists are the complement of the pages in `tables` (sequences sorted by
// seq_id). Validates the result.
kv_state make_kv_state(const kv_geometry& g, parallel_mode mode,
                       std::vector<std::vector<kv_sequence>> tables);

// Pages in use on rank r (distinct ids): num_pages(mode) - free_pages.size().
int64_t used_pages(const kv_geometry& g, const kv_state& s, int rank);

}  // namespace moebius
