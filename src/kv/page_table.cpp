#include "moebius/kv/page_table.hpp"

#include <algorithm>
#include <utility>

#include "moebius/detail/enum_check.hpp"
#include "moebius/error.hpp"

namespace moebius {

namespace {

// In TP with dcp > 1 the rank lists its DCP share of the pages; otherwise every check is the one a
// sequence whole on the rank needs.
void validate_sequence(const kv_geometry& g, parallel_mode m, int rank, const kv_sequence& q) {
  const int64_t n = q.num_pages();
  const bool split = m == parallel_mode::tp && g.dcp > 1;
  if (!split) {
    MOEBIUS_CHECK(n >= 1, errc::invalid_argument, "rank ", rank, " sequence ", q.seq_id,
                  " has no pages (a sequence needs >= 1 page)");
  } else {
    MOEBIUS_CHECK(q.num_tokens >= 1, errc::invalid_argument, "rank ", rank, " sequence ",
                  q.seq_id, " has no tokens (a sequence needs >= 1 token; num_tokens=",
                  q.num_tokens, ")");
  }
  MOEBIUS_CHECK(q.last_page_len >= 1 && q.last_page_len <= g.page_size, errc::invalid_argument,
                "rank ", rank, " sequence ", q.seq_id, " needs 1 <= last_page_len <= page_size (",
                "last_page_len=", q.last_page_len, ", page_size=", g.page_size, ")");
  // Logical pages: the rank's own with dcp 1; the whole sequence's otherwise.
  const int64_t logical = split ? logical_pages(g, q) : n;
  MOEBIUS_CHECK(q.num_tokens == (logical - 1) * g.page_size + q.last_page_len,
                errc::invalid_argument, "rank ", rank, " sequence ", q.seq_id,
                " needs num_tokens == (pages-1)*page_size + last_page_len (num_tokens=",
                q.num_tokens, ", pages=", logical, ", page_size=", g.page_size,
                ", last_page_len=", q.last_page_len, ")");
  if (split) {
    const int64_t k = g.dcp_rank(rank);
    MOEBIUS_CHECK(n == g.dcp_pages_held(logical, k), errc::invalid_argument, "TP rank ", rank,
                  " (DCP index ", k, " of dcp ", g.dcp, ") sequence ", q.seq_id, " lists ", n,
                  " pages but holds ", g.dcp_pages_held(logical, k), " of its ", logical,
                  " (logical pages k, k+dcp, ..)");
  }
  MOEBIUS_CHECK(q.shared_prefix_pages >= 0 && q.shared_prefix_pages <= logical,
                errc::invalid_argument, "rank ", rank, " sequence ", q.seq_id,
                " needs 0 <= shared_prefix_pages <= pages (shared_prefix_pages=",
                q.shared_prefix_pages, ", pages=", logical, ")");
  MOEBIUS_CHECK(q.shared_prefix_pages < logical || q.last_page_len == g.page_size,
                errc::invalid_argument, "rank ", rank, " sequence ", q.seq_id,
                " shares its partial last page (a shared page must be full; last_page_len=",
                q.last_page_len, ", page_size=", g.page_size, ")");
}

}  // namespace

void validate(const kv_geometry& g, const kv_state& s) {
  validate(g);
  detail::check_enum(s.mode, "kv_state mode (parallel_mode)");
  const int P = g.num_ranks;
  MOEBIUS_CHECK(static_cast<int>(s.ranks.size()) == P, errc::invalid_argument,
                "kv_state must have one entry per rank (ranks=", s.ranks.size(), ", P=", P, ")");
  const int64_t num_pages = g.num_pages(s.mode);
  // use[p]: 0 free-unseen, >0 uses; shared[p]: 1 when every use so far was in a shared prefix.
  std::vector<int32_t> use(static_cast<size_t>(num_pages));
  std::vector<uint8_t> shared(static_cast<size_t>(num_pages));
  // last_user[p]: index of the last sequence on this rank that used page p. A page twice in
  // one sequence (shared prefix or not) aliases two token ranges: after a migration they
  // would become two pages holding one copy.
  std::vector<int64_t> last_user(static_cast<size_t>(num_pages));
  for (int r = 0; r < P; ++r) {
    const kv_rank_state& rs = s.ranks[static_cast<size_t>(r)];
    std::fill(use.begin(), use.end(), 0);
    for (size_t i = 0; i < rs.sequences.size(); ++i) {
      const kv_sequence& q = rs.sequences[i];
      validate_sequence(g, s.mode, r, q);
      // Pages of this rank inside the shared prefix (dcp > 1: its share of them).
      const int64_t shared_here = pages_held(g, s.mode, r, q.shared_prefix_pages);
      MOEBIUS_CHECK(i == 0 || rs.sequences[i - 1].seq_id < q.seq_id, errc::invalid_argument,
                    "rank ", r, " sequences must have unique ascending seq ids (", 
                    (i == 0 ? 0 : rs.sequences[i - 1].seq_id), " then ", q.seq_id, ")");
      for (int64_t k = 0; k < q.num_pages(); ++k) {
        const int64_t p = q.pages[static_cast<size_t>(k)];
        MOEBIUS_CHECK(p >= 0 && p < num_pages, errc::invalid_argument, "rank ", r, " sequence ",
                      q.seq_id, " page ", k, " has id ", p, " outside [0, ", num_pages, ") (",
                      to_string(s.mode), " pages per rank)");
        const bool in_shared = k < shared_here;
        auto& u = use[static_cast<size_t>(p)];
        auto& sh = shared[static_cast<size_t>(p)];
        int64_t& last = last_user[static_cast<size_t>(p)];
        MOEBIUS_CHECK(u == 0 || last != static_cast<int64_t>(i), errc::invalid_argument, "rank ",
                      r, " sequence ", q.seq_id, " uses page ", p, " twice (again as page ", k,
                      "); a page may repeat only across sequences' shared prefixes");
        last = static_cast<int64_t>(i);
        if (u == 0) {
          sh = in_shared ? 1 : 0;
        } else {
          MOEBIUS_CHECK(sh && in_shared, errc::invalid_argument, "rank ", r, " page ", p,
                        " is used twice (again by sequence ", q.seq_id, " page ", k,
                        ") but not inside shared prefixes of both users");
        }
        ++u;
      }
    }
    int64_t prev = -1;
    for (int64_t p : rs.free_pages) {
      MOEBIUS_CHECK(p > prev && p < num_pages, errc::invalid_argument, "rank ", r,
                    " free list must be ascending ids in [0, ", num_pages, ") (", p, " after ",
                    prev, ")");
      MOEBIUS_CHECK(use[static_cast<size_t>(p)] == 0, errc::invalid_argument, "rank ", r,
                    " page ", p, " is both free and in use");
      use[static_cast<size_t>(p)] = -1;
      prev = p;
    }
    for (int64_t p = 0; p < num_pages; ++p) {
      MOEBIUS_CHECK(use[static_cast<size_t>(p)] != 0, errc::invalid_argument, "rank ", r,
                    " page ", p, " is neither free nor in use (leaked)");
    }
  }
  if (s.mode == parallel_mode::ep) {
    std::vector<int64_t> ids;
    for (const kv_rank_state& rs : s.ranks)
      for (const kv_sequence& q : rs.sequences) ids.push_back(q.seq_id);
    std::sort(ids.begin(), ids.end());
    const auto dup = std::adjacent_find(ids.begin(), ids.end());
    MOEBIUS_CHECK(dup == ids.end(), errc::invalid_argument, "EP sequence ",
                  (dup == ids.end() ? 0 : *dup), " lives on more than one rank");
    return;
  }
  // TP: the same sequences everywhere, and the same sharing structure among the ranks of one
  // DCP index (they hold the same logical pages; with dcp 1, every rank).
  std::vector<int64_t> fwd(static_cast<size_t>(num_pages)), bwd(static_cast<size_t>(num_pages));
  for (int r = 1; r < P; ++r) {
    // Rank r pairs pages with the first rank of its DCP index; the first rank of each index
    // (r < dcp) compares its sequences with rank 0 and pairs no pages.
    const bool first_of_index = g.dcp_rank(r) == r;
    const int b0 = first_of_index ? 0 : static_cast<int>(g.dcp_rank(r));
    const std::vector<kv_sequence>& base = s.ranks[static_cast<size_t>(b0)].sequences;
    const std::vector<kv_sequence>& seqs = s.ranks[static_cast<size_t>(r)].sequences;
    MOEBIUS_CHECK(seqs.size() == base.size(), errc::invalid_argument, "TP rank ", r, " holds ",
                  seqs.size(), " sequences but rank 0 holds ", base.size(),
                  " (every TP rank holds every sequence)");
    std::fill(fwd.begin(), fwd.end(), -1);
    std::fill(bwd.begin(), bwd.end(), -1);
    for (size_t i = 0; i < seqs.size(); ++i) {
      const kv_sequence& a = base[i];
      const kv_sequence& b = seqs[i];
      MOEBIUS_CHECK(a.seq_id == b.seq_id && a.num_tokens == b.num_tokens &&
                        a.shared_prefix_pages == b.shared_prefix_pages &&
                        a.prefill_cursor == b.prefill_cursor,
                    errc::invalid_argument, "TP rank ", r, " sequence ", b.seq_id,
                    " (tokens ", b.num_tokens, ") differs from rank ", b0, "'s sequence ", a.seq_id,
                    " (tokens ", a.num_tokens, ") in id, tokens, sharing or cursor");
      if (first_of_index) continue;
      for (size_t k = 0; k < a.pages.size(); ++k) {
        const auto pa = static_cast<size_t>(a.pages[k]);
        const auto pb = static_cast<size_t>(b.pages[k]);
        MOEBIUS_CHECK((fwd[pa] == -1 || fwd[pa] == b.pages[k]) &&
                          (bwd[pb] == -1 || bwd[pb] == a.pages[k]),
                      errc::invalid_argument, "TP page tables of rank ", b0, " and rank ", r,
                      " share pages differently (sequence ", b.seq_id, " page ", k, ")");
        fwd[pa] = b.pages[k];
        bwd[pb] = a.pages[k];
      }
    }
  }
}

kv_state make_kv_state(const kv_geometry& g, parallel_mode mode,
                       std::vector<std::vector<kv_sequence>> tables) {
  validate(g);
  detail::check_enum(mode, "make_kv_state mode (parallel_mode)");
  MOEBIUS_CHECK(static_cast<int>(tables.size()) == g.num_ranks, errc::invalid_argument,
                "make_kv_state needs one table list per rank (lists=", tables.size(),
                ", P=", g.num_ranks, ")");
  kv_state s;
  s.mode = mode;
  s.ranks.resize(tables.size());
  const int64_t num_pages = g.num_pages(mode);
  std::vector<uint8_t> used(static_cast<size_t>(num_pages));
  for (size_t r = 0; r < tables.size(); ++r) {
    std::fill(used.begin(), used.end(), 0);
    std::sort(tables[r].begin(), tables[r].end(),
              [](const kv_sequence& a, const kv_sequence& b) { return a.seq_id < b.seq_id; });
    for (const kv_sequence& q : tables[r])
      for (int64_t p : q.pages)
        if (p >= 0 && p < num_pages) used[static_cast<size_t>(p)] = 1;
    s.ranks[r].sequences = std::move(tables[r]);
    for (int64_t p = 0; p < num_pages; ++p)
      if (!used[static_cast<size_t>(p)]) s.ranks[r].free_pages.push_back(p);
  }
  validate(g, s);
  return s;
}

int64_t used_pages(const kv_geometry& g, const kv_state& s, int rank) {
  return g.num_pages(s.mode) -
         static_cast<int64_t>(s.ranks.at(static_cast<size_t>(rank)).free_pages.size());
}

}  // namespace moebius
