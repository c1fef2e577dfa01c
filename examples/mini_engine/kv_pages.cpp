#include "kv_pages.hpp"

#include <algorithm>
#include <moebius/error.hpp>
#include <cstddef>
#include <utility>
#include <vector>

namespace mini_engine {

using moebius::errc;
using moebius::kv_rank_state;
using moebius::kv_sequence;
using moebius::parallel_mode;

namespace {

template <class Sequences>  // const or mutable
auto seq_lower_bound(Sequences& seqs, int64_t seq_id) {
  return std::lower_bound(seqs.begin(), seqs.end(), seq_id,
                          [](const kv_sequence& a, int64_t id) { return a.seq_id < id; });
}

// Pages rank `rank` lists for a sequence of `num_tokens` tokens in mode m: every logical page,
// or in TP with dcp > 1 its DCP share (logical pages k, k + dcp, ..; kv_geometry.hpp).
int64_t pages_on_rank(const moebius::kv_geometry& g, parallel_mode m, int64_t num_tokens,
                      int rank) {
  return moebius::pages_held(g, m, rank, moebius::pages_for_tokens(num_tokens, g.page_size));
}

// Grows (or inserts) the sequence on one rank; the caller checked the free pages.
void grow(const moebius::kv_geometry& g, parallel_mode m, kv_rank_state& r, int rank,
          int64_t seq_id, int64_t num_tokens) {
  const int64_t page_size = g.page_size;
  auto it = seq_lower_bound(r.sequences, seq_id);
  if (it == r.sequences.end() || it->seq_id != seq_id) {
    kv_sequence fresh;
    fresh.seq_id = seq_id;
    it = r.sequences.insert(it, std::move(fresh));
  }
  const int64_t need = pages_on_rank(g, m, num_tokens, rank) - it->num_pages();
  // The highest free pages, highest first, from the back of the ascending list (see the header).
  for (int64_t i = 0; i < need; ++i) {
    it->pages.push_back(r.free_pages.back());
    r.free_pages.pop_back();
  }
  // The fields other than pages describe the whole sequence (with dcp > 1 too).
  it->num_tokens = num_tokens;
  it->last_page_len = num_tokens - (moebius::pages_for_tokens(num_tokens, page_size) - 1) * page_size;
}

}  // namespace

const kv_sequence* find_sequence(const moebius::kv_state& s, int rank, int64_t seq_id) {
  const auto& seqs = s.ranks[static_cast<size_t>(rank)].sequences;
  const auto it = seq_lower_bound(seqs, seq_id);
  return (it != seqs.end() && it->seq_id == seq_id) ? &*it : nullptr;
}

int64_t free_pages(const moebius::kv_state& s, int rank) {
  return static_cast<int64_t>(s.ranks[static_cast<size_t>(rank)].free_pages.size());
}

int64_t pages_needed(const moebius::kv_geometry& g, parallel_mode m, int64_t num_tokens) {
  // A TP page holds the same tokens as an EP page (fewer heads), so the count is the same in
  // both modes with dcp 1; TP takes it on every rank. With dcp > 1 a TP rank takes its share,
  // and DCP index 0 (whose share starts at logical page 0) the largest.
  return pages_on_rank(g, m, num_tokens, 0);
}

int owner_of(const moebius::kv_state& s, int64_t seq_id) {
  if (s.mode == parallel_mode::tp) return -1;
  for (size_t r = 0; r < s.ranks.size(); ++r)
    if (find_sequence(s, static_cast<int>(r), seq_id)) return static_cast<int>(r);
  return -1;
}

void reserve_tokens(const moebius::kv_geometry& g, moebius::kv_state& s, int64_t seq_id,
                    int64_t num_tokens, int owner) {
  MOEBIUS_CHECK(num_tokens >= 1, errc::invalid_argument, "reserve_tokens: sequence ", seq_id,
                " needs num_tokens >= 1 (got ", num_tokens, ")");
  const int P = static_cast<int>(s.ranks.size());
  std::vector<int> ranks;
  if (s.mode == parallel_mode::ep) {
    const int at = owner_of(s, seq_id);
    if (at >= 0) {
      ranks.push_back(at);
    } else {
      MOEBIUS_CHECK(owner >= 0 && owner < P, errc::invalid_argument, "reserve_tokens: owner ",
                    owner, " of new sequence ", seq_id, " is not a rank of ", P);
      ranks.push_back(owner);
    }
  } else {
    for (int r = 0; r < P; ++r) ranks.push_back(r);
  }
  // Check every rank first, so that a refusal changes nothing.
  for (int r : ranks) {
    const kv_sequence* seq = find_sequence(s, r, seq_id);
    const int64_t have = seq ? seq->num_tokens : 0;
    MOEBIUS_CHECK(num_tokens >= have, errc::invalid_argument, "reserve_tokens: sequence ", seq_id,
                  " holds ", have, " tokens, cannot shrink to ", num_tokens);
    const int64_t need = pages_on_rank(g, s.mode, num_tokens, r) - (seq ? seq->num_pages() : 0);
    MOEBIUS_CHECK(need <= free_pages(s, r), errc::capacity, "reserve_tokens: sequence ", seq_id,
                  " needs ", need, " more ", moebius::to_string(s.mode), " pages on rank ", r,
                  " for ", num_tokens, " tokens; ", free_pages(s, r), " are free");
  }
  for (int r : ranks) grow(g, s.mode, s.ranks[static_cast<size_t>(r)], r, seq_id, num_tokens);
}

void release_sequence(moebius::kv_state& s, int64_t seq_id) {
  for (auto& r : s.ranks) {
    auto it = seq_lower_bound(r.sequences, seq_id);
    if (it == r.sequences.end() || it->seq_id != seq_id) continue;
    // Pages shared with other sequences' prefixes stay in use. The freed pages are merged into
    // the ascending free list at once (one pass over it, not one insertion a page).
    std::vector<int64_t> freed;
    freed.reserve(static_cast<size_t>(it->num_pages()));
    for (int64_t i = 0; i < it->num_pages(); ++i) {
      const int64_t page = it->pages[static_cast<size_t>(i)];
      bool shared = false;
      if (i < it->shared_prefix_pages)
        for (const auto& other : r.sequences)
          if (other.seq_id != seq_id &&
              std::find(other.pages.begin(), other.pages.begin() + other.shared_prefix_pages,
                        page) != other.pages.begin() + other.shared_prefix_pages)
            shared = true;
      if (!shared) freed.push_back(page);
    }
    std::sort(freed.begin(), freed.end());
    const auto middle = static_cast<std::ptrdiff_t>(r.free_pages.size());
    r.free_pages.insert(r.free_pages.end(), freed.begin(), freed.end());
    std::inplace_merge(r.free_pages.begin(), r.free_pages.begin() + middle, r.free_pages.end());
    r.sequences.erase(it);
  }
}

moebius::kv_state written_prefix(const moebius::kv_geometry& g, const moebius::kv_state& s,
                                 std::span<const std::pair<int64_t, int64_t>> written) {
  moebius::kv_state out = s;
  for (size_t rank = 0; rank < out.ranks.size(); ++rank) {
    kv_rank_state& r = out.ranks[rank];
    std::vector<kv_sequence> kept;
    for (kv_sequence& q : r.sequences) {
      if (q.shared_prefix_pages > 0) {
        kept.push_back(std::move(q));
        continue;
      }
      const auto it = std::lower_bound(written.begin(), written.end(),
                                       std::pair<int64_t, int64_t>{q.seq_id, 0});
      const int64_t n = it != written.end() && it->first == q.seq_id
                            ? std::min(it->second, q.num_tokens)
                            : 0;
      const int64_t pages = pages_on_rank(g, s.mode, n, static_cast<int>(rank));
      for (size_t p = static_cast<size_t>(pages); p < q.pages.size(); ++p) {
        r.free_pages.insert(std::lower_bound(r.free_pages.begin(), r.free_pages.end(), q.pages[p]),
                            q.pages[p]);
      }
      if (n == 0) continue;
      q.pages.resize(static_cast<size_t>(pages));
      q.num_tokens = n;
      q.last_page_len = n - (moebius::pages_for_tokens(n, g.page_size) - 1) * g.page_size;
      kept.push_back(std::move(q));
    }
    r.sequences = std::move(kept);
  }
  return out;
}

bool no_live_sequences(const moebius::kv_state& s) {
  return std::all_of(s.ranks.begin(), s.ranks.end(),
                     [](const moebius::kv_rank_state& r) { return r.sequences.empty(); });
}

void release_all_sequences(moebius::kv_state& s) {
  std::vector<int64_t> ids;
  for (const moebius::kv_rank_state& r : s.ranks)
    for (const moebius::kv_sequence& q : r.sequences) ids.push_back(q.seq_id);
  for (const int64_t id : ids) release_sequence(s, id);
}

moebius::kv_state make_empty_kv_state(const moebius::kv_geometry& g, parallel_mode m) {
  return moebius::make_kv_state(
      g, m, std::vector<std::vector<kv_sequence>>(static_cast<size_t>(g.num_ranks)));
}

}  // namespace mini_engine
