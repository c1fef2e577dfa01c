// TEMPORARY STAND-IN (see kv_pages.hpp in this folder): delete when the model helper's
// examples/mini_engine/kv_pages.cpp is merged.
#include "kv_pages.hpp"

#include <algorithm>
#include <vector>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;
using moebius::kv_rank_state;
using moebius::kv_sequence;
using moebius::parallel_mode;

namespace {

kv_sequence* find(kv_rank_state& r, int64_t id) {
  auto it = std::lower_bound(r.sequences.begin(), r.sequences.end(), id,
                             [](const kv_sequence& a, int64_t v) { return a.seq_id < v; });
  return it != r.sequences.end() && it->seq_id == id ? &*it : nullptr;
}

}  // namespace

int64_t free_pages(const moebius::kv_state& s, int rank) {
  return static_cast<int64_t>(s.ranks[static_cast<size_t>(rank)].free_pages.size());
}

int64_t pages_needed(const moebius::kv_geometry& g, parallel_mode, int64_t num_tokens) {
  return moebius::pages_for_tokens(num_tokens, g.page_size);
}

int owner_of(const moebius::kv_state& s, int64_t seq_id) {
  if (s.mode == parallel_mode::tp) return -1;
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    if (find(const_cast<kv_rank_state&>(s.ranks[r]), seq_id) != nullptr) return static_cast<int>(r);
  }
  return -1;
}

void reserve_tokens(const moebius::kv_geometry& g, moebius::kv_state& s, int64_t seq_id,
                    int64_t num_tokens, int owner) {
  MOEBIUS_CHECK(num_tokens >= 1, errc::invalid_argument, "reserve_tokens: num_tokens ", num_tokens);
  const int P = static_cast<int>(s.ranks.size());
  std::vector<int> ranks;
  if (s.mode == parallel_mode::ep) {
    const int at = owner_of(s, seq_id);
    MOEBIUS_CHECK(at >= 0 || (owner >= 0 && owner < P), errc::invalid_argument,
                  "reserve_tokens: owner ", owner);
    ranks.push_back(at >= 0 ? at : owner);
  } else {
    for (int r = 0; r < P; ++r) ranks.push_back(r);
  }
  const int64_t want = moebius::pages_for_tokens(num_tokens, g.page_size);
  for (int r : ranks) {
    kv_sequence* q = find(s.ranks[static_cast<size_t>(r)], seq_id);
    const int64_t have = q != nullptr ? q->num_pages() : 0;
    MOEBIUS_CHECK(q == nullptr || q->num_tokens <= num_tokens, errc::invalid_argument,
                  "reserve_tokens: cannot shrink");
    MOEBIUS_CHECK(want - have <= free_pages(s, r), errc::capacity, "reserve_tokens: rank ", r,
                  " has ", free_pages(s, r), " free pages, sequence ", seq_id, " needs ",
                  want - have);
  }
  for (int r : ranks) {
    kv_rank_state& rs = s.ranks[static_cast<size_t>(r)];
    kv_sequence* q = find(rs, seq_id);
    if (q == nullptr) {
      auto it = std::lower_bound(rs.sequences.begin(), rs.sequences.end(), seq_id,
                                 [](const kv_sequence& a, int64_t v) { return a.seq_id < v; });
      q = &*rs.sequences.insert(it, kv_sequence{.seq_id = seq_id});
    }
    const int64_t need = want - q->num_pages();
    q->pages.insert(q->pages.end(), rs.free_pages.begin(), rs.free_pages.begin() + need);
    rs.free_pages.erase(rs.free_pages.begin(), rs.free_pages.begin() + need);
    q->num_tokens = num_tokens;
    q->last_page_len = num_tokens - (q->num_pages() - 1) * g.page_size;
  }
}

void release_sequence(moebius::kv_state& s, int64_t seq_id) {
  for (kv_rank_state& rs : s.ranks) {
    kv_sequence* q = find(rs, seq_id);
    if (q == nullptr) continue;
    std::vector<int64_t> merged;
    std::vector<int64_t> mine = q->pages;
    std::sort(mine.begin(), mine.end());
    std::merge(rs.free_pages.begin(), rs.free_pages.end(), mine.begin(), mine.end(),
               std::back_inserter(merged));
    rs.free_pages = std::move(merged);
    rs.sequences.erase(rs.sequences.begin() + (q - rs.sequences.data()));
  }
}

}  // namespace mini_engine
