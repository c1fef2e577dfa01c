#pragma once

// Page bookkeeping of the mini-engine's KV cache over moebius::kv_state: the serving loop
// grows and retires sequences between steps (and between switches, on the switcher's
// mutable_kv_tables()); the runtimes read the page ids. Pages come from the back of each
// rank's ascending free list (highest ids first: taking them costs only the pages taken, where
// taking from the front shifted the whole list, most of a long run's time at 10^4 pages a
// rank) and go back merged in order, so every state this file produces passes
// moebius::validate(g, s).
//
//   page_size 4, 8 pages a rank, EP, P=2, empty: reserve_tokens(g, s, 7, 6, 1) -> rank 1
//   holds seq 7 with pages {7, 6}, last_page_len 2; reserve_tokens(g, s, 7, 9, 0) -> seq 7
//   (still on rank 1) gains page 5, last_page_len 1; release_sequence(s, 7) -> rank 1's free
//   list is whole.

#include <cstdint>
#include <span>
#include <utility>
#include <moebius/kv/kv_geometry.hpp>
#include <moebius/kv/page_table.hpp>

namespace mini_engine {

// Grows (or creates) sequence `seq_id` so that it holds `num_tokens` tokens, taking pages from the
// free lists: in EP on `owner` (a new sequence; an existing one stays on its owner), in TP on every
// rank (with g.dcp > 1 rank r takes only its share, the logical pages k, k + dcp, .. of
// k = r % dcp; every rank lists the sequence, with its whole token count). Throws moebius::error(errc::capacity) and changes nothing when the pages are not there.
// Throws errc::invalid_argument (changing nothing) for num_tokens < 1, fewer tokens than the
// sequence holds already, or an EP owner outside [0, P) for a new sequence.
void reserve_tokens(const moebius::kv_geometry& g, moebius::kv_state& s, int64_t seq_id,
                    int64_t num_tokens, int owner);
// Removes sequence `seq_id` (every rank) and returns its pages to the free lists (kept ascending).
// A sequence that is not there is left alone (no-op).
void release_sequence(moebius::kv_state& s, int64_t seq_id);
// Pages free on `rank`, and pages a sequence of `num_tokens` tokens would need per rank in s.mode
// (TP with dcp > 1: on DCP index 0, whose share is the largest).
int64_t free_pages(const moebius::kv_state& s, int rank);
int64_t pages_needed(const moebius::kv_geometry& g, moebius::parallel_mode m, int64_t num_tokens);
// The EP owner of `seq_id`, or -1 (TP, or absent).
int owner_of(const moebius::kv_state& s, int64_t seq_id);

// Rank r's table of `seq_id`, or nullptr when rank r does not hold it.
const moebius::kv_sequence* find_sequence(const moebius::kv_state& s, int rank, int64_t seq_id);

// The tables `s` cut to the tokens whose K/V has been written: sequence q keeps its first
// written[q] tokens (pairs (seq_id, tokens) sorted by id; an id not listed, or 0 tokens, is
// dropped), the pages past them go back to the free lists. A verify hook checksums this
// (switch/checksum.hpp) so that the room reserved for tokens not yet written, whose bytes are
// stale and get written during a progressive switch, is not part of the check. Sequences with
// shared prefix pages are kept whole (the mini-engine shares none).
//   page_size 4, seq 7 holds 9 tokens in pages {0, 1, 2}, written (7, 5): pages {0, 1},
//   last_page_len 1, page 2 free.
moebius::kv_state written_prefix(const moebius::kv_geometry& g, const moebius::kv_state& s,
                                 std::span<const std::pair<int64_t, int64_t>> written);

// Whether `s` holds no sequence on any rank.
bool no_live_sequences(const moebius::kv_state& s);

// Releases every sequence of `s` (every page goes back to its rank's free list).
void release_all_sequences(moebius::kv_state& s);

// An empty state of `g` in mode `m`: no sequences, every page free.
moebius::kv_state make_empty_kv_state(const moebius::kv_geometry& g, moebius::parallel_mode m);

}  // namespace mini_engine
