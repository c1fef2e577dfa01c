// cuda_peer_transport's cache of prepared plans: keyed by fingerprint_of(plan) (plan.hpp: sizes
// and a few ops per phase, O(phases)), confirmed by plan equality, least recently used dropped
// first. Not hash_of(plan): it mixes every field of every op (~110 cycles an op), and paying
// that before every enqueue of a 30k-op KV plan made KV migration 1.3-1.6x slower than the
// copies alone (docs/BENCHMARKS.md); a hit pays only the equality check (~5 ns an op).

#include "impl.hpp"

namespace moebius {

std::shared_ptr<const cuda_prepared_plan> cuda_peer_transport::impl::lookup_or_prepare(
    const plan& p, bool& from_cache, double& prepare_seconds, double& lookup_seconds) {
  const auto t0 = cuda_peer::clock_type::now();
  const uint64_t key = fingerprint_of(p);
  for (auto it = cache.begin(); it != cache.end(); ++it) {
    if (it->key == key && it->plan_copy == p) {
      cache.splice(cache.begin(), cache, it);
      from_cache = true;
      prepare_seconds = 0;
      lookup_seconds = cuda_peer::seconds_since(t0);
      return cache.front().prepared;
    }
  }
  lookup_seconds = cuda_peer::seconds_since(t0);
  const auto t1 = cuda_peer::clock_type::now();
  std::shared_ptr<const cuda_prepared_plan> prepared = prepare(p);
  prepare_seconds = cuda_peer::seconds_since(t1);
  from_cache = false;
  if (config.max_cached_plans > 0) {
    cache.push_front(cache_entry{key, p, prepared});
    while (static_cast<int>(cache.size()) > config.max_cached_plans) cache.pop_back();
  }
  return prepared;
}

void cuda_peer_transport::prepare(const plan& p) {
  bool from_cache = false;
  double prepare_seconds = 0;
  double lookup_seconds = 0;
  (void)impl_->lookup_or_prepare(p, from_cache, prepare_seconds, lookup_seconds);
}

void cuda_peer_transport::clear_plan_cache() { impl_->cache.clear(); }

}  // namespace moebius
