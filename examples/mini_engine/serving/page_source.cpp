#include "page_source.hpp"

#include <algorithm>
#include <moebius/error.hpp>

#include "kv_pages.hpp"

namespace mini_engine {

int64_t held_tokens(const moebius::kv_state& kv, int64_t id) {
  for (int r = 0; r < static_cast<int>(kv.ranks.size()); ++r)
    if (const moebius::kv_sequence* q = find_sequence(kv, r, id)) return q->num_tokens;
  return 0;
}

int64_t growing_pages::grant(int64_t id, int64_t in_kv, int64_t n, int owner) {
  try {
    // A sequence may already hold more (reserve_for_switch): then nothing grows.
    if (held_tokens(kv_, id) < in_kv + n) reserve_tokens(g_, kv_, id, in_kv + n, owner);
  } catch (const moebius::error& e) {
    if (e.code() != moebius::errc::capacity) throw;
    return 0;
  }
  return n;
}

void growing_pages::release(int64_t id) {
  release_sequence(kv_, id);
}

int64_t frozen_pages::grant(int64_t id, int64_t in_kv, int64_t n, int) {
  return std::max<int64_t>(0, std::min(n, held_tokens(kv_, id) - in_kv));
}

void release_deferred(moebius::kv_state& tables, std::vector<int64_t>& deferred) {
  for (const int64_t id : deferred) release_sequence(tables, id);
  deferred.clear();
}

}  // namespace mini_engine
