// cuda_peer_transport's cache of prepared plans: keyed by hash_of(plan) (plan.hpp), confirmed
// by plan equality, least recently used dropped first.

#include "impl.hpp"

namespace moebius {

std::shared_ptr<const cuda_prepared_plan> cuda_peer_transport::impl::lookup_or_prepare(
    const plan& p, bool& from_cache, double& prepare_seconds) {
  const uint64_t h = hash_of(p);
  for (auto it = cache.begin(); it != cache.end(); ++it) {
    if (it->hash == h && it->key == p) {
      cache.splice(cache.begin(), cache, it);
      from_cache = true;
      prepare_seconds = 0;
      return cache.front().prepared;
    }
  }
  const auto t0 = cuda_peer::clock_type::now();
  std::shared_ptr<const cuda_prepared_plan> prepared = prepare(p);
  prepare_seconds = cuda_peer::seconds_since(t0);
  from_cache = false;
  if (config.max_cached_plans > 0) {
    cache.push_front(cache_entry{h, p, prepared});
    while (static_cast<int>(cache.size()) > config.max_cached_plans) cache.pop_back();
  }
  return prepared;
}

void cuda_peer_transport::prepare(const plan& p) {
  bool from_cache = false;
  double prepare_seconds = 0;
  (void)impl_->lookup_or_prepare(p, from_cache, prepare_seconds);
}

void cuda_peer_transport::clear_plan_cache() { impl_->cache.clear(); }

}  // namespace moebius
