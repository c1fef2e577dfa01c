#pragma once

// Naive, independent model of the KV pool for tests: every token's K and V for every head is
// a hash of (content, layer, K/V, head, token position, dim, byte), written and checked with
// plain loops and an offset formula of its own (it shares nothing with the library but the
// geometry's plain fields).

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/page_table.hpp"

namespace moebius::testing {

inline uint64_t kv_test_seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("MOEBIUS_TEST_SEED");
    const uint64_t s = env ? std::strtoull(env, nullptr, 10) : std::random_device{}();
    std::cout << "MOEBIUS_TEST_SEED=" << s << std::endl;
    return s;
  }();
  return seed;
}

inline uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Content of page k of a sequence: the share group's prefix (same bytes in every sharer) or the
// sequence's own.
struct seq_content {
  int64_t group_key = -1;  // content id of the shared prefix
};
using content_map = std::map<int64_t, seq_content>;  // seq_id -> content

inline int64_t content_of(const content_map& c, const kv_sequence& q, int64_t page_idx) {
  auto it = c.find(q.seq_id);
  if (page_idx < q.shared_prefix_pages && it != c.end() && it->second.group_key >= 0)
    return it->second.group_key;
  return q.seq_id;
}

inline std::byte ref_value(int64_t content, int64_t layer, int64_t kv, int64_t head,
                           int64_t pos, int64_t dim, int64_t byte) {
  uint64_t h = mix(static_cast<uint64_t>(content));
  h = mix(h ^ static_cast<uint64_t>(layer * 2 + kv));
  h = mix(h ^ static_cast<uint64_t>(head));
  h = mix(h ^ static_cast<uint64_t>(pos));
  h = mix(h ^ static_cast<uint64_t>(dim * 8 + byte));
  return static_cast<std::byte>(h & 0xFF);
}

// Offset of (layer, kv, page, local head, token, dim) in a rank's pool, written from the
// documented layout without the library's helpers.
inline int64_t ref_offset(const kv_geometry& g, parallel_mode m, int64_t layer, int64_t kv,
                          int64_t page, int64_t head, int64_t token, int64_t dim) {
  const int64_t H = g.num_kv_heads == 0 ? 1 : g.num_kv_heads;
  const int64_t tensors_per_layer = g.num_kv_heads == 0 ? 1 : 2;
  const int64_t elem = dtype_bytes(g.type);
  int64_t split = 1;
  if (g.num_kv_heads > 0) split = g.num_kv_heads < g.num_ranks ? g.num_kv_heads : g.num_ranks;
  const int64_t heads = m == parallel_mode::ep ? H : H / split;
  const int64_t ep_page = g.page_size * H * g.head_dim * elem;
  const int64_t region = g.num_ep_pages * ep_page;
  const int64_t page_bytes = g.page_size * heads * g.head_dim * elem;
  int64_t e;
  if (g.layout == kv_layout::hnd) e = (head * g.page_size + token) * g.head_dim + dim;
  else e = (token * heads + head) * g.head_dim + dim;
  return (layer * tensors_per_layer + kv) * region + page * page_bytes + e * elem;
}

// Global heads rank r holds in mode m: [first, first + count).
inline void ref_heads(const kv_geometry& g, parallel_mode m, int r, int64_t& first,
                      int64_t& count) {
  const int64_t H = g.num_kv_heads == 0 ? 1 : g.num_kv_heads;
  if (m == parallel_mode::ep) {
    first = 0;
    count = H;
  } else if (g.num_kv_heads >= g.num_ranks) {
    count = H / g.num_ranks;
    first = r * count;
  } else {  // one head per rank, head r / (P/H) (latent: the one tensor)
    count = 1;
    first = r / (g.num_ranks / H);
  }
}

using pools = std::vector<std::vector<std::byte>>;

// Where (mode, layer, kv, page, local head, token, dim) lies in a pool of another layout than
// the present one (kv_layout_model.hpp); null = ref_offset.
using ref_offset_fn = std::function<int64_t(parallel_mode, int64_t, int64_t, int64_t, int64_t,
                                            int64_t, int64_t)>;

// Visits every valid element of every sequence of `s`: f(rank, offset, expected byte).
template <class F>
void for_each_element(const kv_geometry& g, const kv_state& s, const content_map& c, F&& f,
                      const ref_offset_fn* where = nullptr) {
  const int64_t elem = dtype_bytes(g.type);
  const int64_t tensors_per_layer = g.num_kv_heads == 0 ? 1 : 2;
  for (int r = 0; r < g.num_ranks; ++r) {
    int64_t first = 0, count = 0;
    ref_heads(g, s.mode, r, first, count);
    // DCP (TP, g.dcp > 1): rank r lists logical pages r % dcp, r % dcp + dcp, .. of each
    // sequence; the last logical page is the partial one. dcp 1 and EP: every page, in order.
    const int64_t D = s.mode == parallel_mode::tp ? g.dcp : 1;
    for (const kv_sequence& q : s.ranks[static_cast<size_t>(r)].sequences) {
      const int64_t logical_pages = (q.num_tokens + g.page_size - 1) / g.page_size;
      for (int64_t i = 0; i < static_cast<int64_t>(q.pages.size()); ++i) {
        const int64_t k = i * D + r % D;  // the logical page
        const int64_t content = content_of(c, q, k);
        const int64_t tokens = k + 1 == logical_pages ? q.last_page_len : g.page_size;
        for (int64_t layer = 0; layer < g.num_layers; ++layer)
          for (int64_t kv = 0; kv < tensors_per_layer; ++kv)
            for (int64_t h = 0; h < count; ++h)
              for (int64_t t = 0; t < tokens; ++t)
                for (int64_t d = 0; d < g.head_dim; ++d) {
                  const int64_t page = q.pages[static_cast<size_t>(i)];
                  const int64_t off = where ? (*where)(s.mode, layer, kv, page, h, t, d)
                                            : ref_offset(g, s.mode, layer, kv, page, h, t, d);
                  for (int64_t b = 0; b < elem; ++b)
                    f(r, off + b,
                      ref_value(content, layer, kv, first + h, k * g.page_size + t, d, b));
                }
      }
    }
  }
}

inline void fill_reference(const kv_geometry& g, const kv_state& s, const content_map& c,
                           pools& p, const ref_offset_fn* where = nullptr) {
  for_each_element(
      g, s, c,
      [&](int r, int64_t off, std::byte v) { p[static_cast<size_t>(r)][static_cast<size_t>(off)] = v; },
      where);
}

// "" when every element is where the tables say and equals the reference, else the first
// mismatch.
inline std::string check_reference(const kv_geometry& g, const kv_state& s, const content_map& c,
                                   const pools& p, const ref_offset_fn* where = nullptr) {
  std::string err;
  int64_t bad = 0;
  for_each_element(g, s, c, [&](int r, int64_t off, std::byte v) {
    const std::byte got = p[static_cast<size_t>(r)][static_cast<size_t>(off)];
    if (got != v && bad++ == 0) {
      std::ostringstream os;
      os << "rank " << r << " offset " << off << ": expected " << int(v) << " got " << int(got);
      err = os.str();
    }
  }, where);
  if (bad) err += " (" + std::to_string(bad) + " bytes differ)";
  return err;
}

// Bytes of `s` that hold no token, per rank of `pool_bytes` bytes: every free page (a plan may
// write it, and its rollback need not restore it), and the slots past the last token of a
// partial last page (a page dropped unread is re-created on rollback from a replica, whose
// unused slots hold other bytes). Every other byte (each token's, and those of no page) comes
// back exactly when a plan is rolled back.
inline std::vector<std::vector<uint8_t>> tokenless_bytes(const kv_geometry& g, const kv_state& s,
                                                         int64_t pool_bytes,
                                                         const ref_offset_fn* where = nullptr) {
  std::vector<std::vector<uint8_t>> mask(static_cast<size_t>(g.num_ranks),
                                         std::vector<uint8_t>(static_cast<size_t>(pool_bytes), 0));
  const int64_t elem = dtype_bytes(g.type);
  const int64_t tensors_per_layer = g.num_kv_heads == 0 ? 1 : 2;
  const int64_t D = s.mode == parallel_mode::tp ? g.dcp : 1;
  for (int r = 0; r < g.num_ranks; ++r) {
    int64_t first = 0, heads = 0;
    ref_heads(g, s.mode, r, first, heads);
    auto mark = [&](int64_t page, int64_t first_token) {
      for (int64_t layer = 0; layer < g.num_layers; ++layer)
        for (int64_t kv = 0; kv < tensors_per_layer; ++kv)
          for (int64_t h = 0; h < heads; ++h)
            for (int64_t t = first_token; t < g.page_size; ++t)
              for (int64_t d = 0; d < g.head_dim; ++d) {
                const int64_t off = where ? (*where)(s.mode, layer, kv, page, h, t, d)
                                          : ref_offset(g, s.mode, layer, kv, page, h, t, d);
                for (int64_t b = 0; b < elem; ++b)
                  mask[static_cast<size_t>(r)][static_cast<size_t>(off + b)] = 1;
              }
    };
    for (int64_t p : s.ranks[static_cast<size_t>(r)].free_pages) mark(p, 0);
    for (const kv_sequence& q : s.ranks[static_cast<size_t>(r)].sequences) {
      const int64_t logical_pages = (q.num_tokens + g.page_size - 1) / g.page_size;
      if ((logical_pages - 1) % D == r % D) mark(q.pages.back(), q.last_page_len);
    }
  }
  return mask;
}

// "" when every byte outside `mask` is as in `before`, else the first that differs.
inline std::string outside_diff(const pools& before, const pools& now,
                                const std::vector<std::vector<uint8_t>>& mask) {
  for (size_t r = 0; r < before.size(); ++r)
    for (size_t i = 0; i < before[r].size(); ++i)
      if (!mask[r][i] && before[r][i] != now[r][i])
        return "rank " + std::to_string(r) + " byte " + std::to_string(i);
  return "";
}

// ---- decode context parallel: the interleave rule, from the fields alone ---------------------

// TP pages per EP page ("split"): min(H_kv, P), 1 for latent KV; the ranks holding one head
// slice in TP: P / split.
inline int64_t ref_split(const kv_geometry& g) {
  if (g.num_kv_heads == 0) return 1;
  return g.num_kv_heads < g.num_ranks ? g.num_kv_heads : g.num_ranks;
}
inline int64_t ref_replicas(const kv_geometry& g) { return g.num_ranks / ref_split(g); }

// Bytes of one TP page over all tensors: page_size tokens of H_kv / split heads (latent: one
// head-less tensor a layer).
inline int64_t ref_tp_page_bytes(const kv_geometry& g) {
  const int64_t heads = g.num_kv_heads == 0 ? 1 : g.num_kv_heads / ref_split(g);
  const int64_t tensors = g.num_layers * (g.num_kv_heads == 0 ? 1 : 2);
  return tensors * g.page_size * heads * g.head_dim * dtype_bytes(g.type);
}

// What TP rank r keeps and receives when the TP view goes from dcp a to dcp b: the distinct
// (content, logical page) of its slice it holds at b (rank x = r % replicas holds logical page i
// at dcp d iff i % d == x % d), split by whether it held them at a.
struct ref_rank_moves {
  int64_t kept = 0, received = 0;
};
inline std::vector<ref_rank_moves> ref_dcp_moves(const kv_geometry& g, const kv_state& s,
                                                 const content_map& c, int64_t a, int64_t b) {
  const int64_t R = ref_replicas(g);
  std::vector<ref_rank_moves> out(static_cast<size_t>(g.num_ranks));
  for (int r = 0; r < g.num_ranks; ++r) {
    const int64_t x = r % R;
    std::set<std::pair<int64_t, int64_t>> kept, received;
    for (const kv_sequence& q : s.ranks[static_cast<size_t>(r)].sequences) {
      const int64_t n = (q.num_tokens + g.page_size - 1) / g.page_size;
      for (int64_t i = 0; i < n; ++i) {
        if (i % b != x % b) continue;
        auto& into = i % a == x % a ? kept : received;
        into.emplace(content_of(c, q, i), i);
      }
    }
    out[static_cast<size_t>(r)] = {static_cast<int64_t>(kept.size()),
                                   static_cast<int64_t>(received.size())};
  }
  return out;
}

// What each TP head slice holds of each sequence's logical pages, read from the P pools
// through `s` (present layout): (first head, seq id, logical page) -> the bytes of its tokens,
// every layer, K|V, head and dim. Every rank listing a page must hold the same bytes; "" in
// `error` or the first rank that differs.
using slice_pages = std::map<std::tuple<int64_t, int64_t, int64_t>, std::vector<std::byte>>;
inline slice_pages ref_slice_pages(const kv_geometry& g, const kv_state& s, const pools& p,
                                   std::string& error) {
  slice_pages out;
  const int64_t elem = dtype_bytes(g.type);
  const int64_t tensors_per_layer = g.num_kv_heads == 0 ? 1 : 2;
  const int64_t D = g.dcp;
  for (int r = 0; r < g.num_ranks; ++r) {
    int64_t first = 0, heads = 0;
    ref_heads(g, parallel_mode::tp, r, first, heads);
    for (const kv_sequence& q : s.ranks[static_cast<size_t>(r)].sequences) {
      const int64_t n = (q.num_tokens + g.page_size - 1) / g.page_size;
      for (int64_t k = 0; k < static_cast<int64_t>(q.pages.size()); ++k) {
        const int64_t i = k * D + r % D;
        const int64_t tokens = i + 1 == n ? q.last_page_len : g.page_size;
        std::vector<std::byte> bytes;
        for (int64_t layer = 0; layer < g.num_layers; ++layer)
          for (int64_t kv = 0; kv < tensors_per_layer; ++kv)
            for (int64_t h = 0; h < heads; ++h)
              for (int64_t t = 0; t < tokens; ++t)
                for (int64_t d = 0; d < g.head_dim; ++d) {
                  const int64_t off = ref_offset(g, parallel_mode::tp, layer, kv,
                                                 q.pages[static_cast<size_t>(k)], h, t, d);
                  for (int64_t e = 0; e < elem; ++e)
                    bytes.push_back(p[static_cast<size_t>(r)][static_cast<size_t>(off + e)]);
                }
        const auto [at, fresh] = out.try_emplace({first, q.seq_id, i}, bytes);
        if (!fresh && at->second != bytes && error.empty())
          error = "rank " + std::to_string(r) + " sequence " + std::to_string(q.seq_id) +
                  " logical page " + std::to_string(i) + " differs from another holder's";
      }
    }
  }
  return out;
}

}  // namespace moebius::testing
