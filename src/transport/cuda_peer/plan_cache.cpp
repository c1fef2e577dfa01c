// cuda_peer_transport's cache of prepared plans (detail/plan_cache.hpp), and the times a
// lookup and a prepare took, for cuda_execute_stats.

#include "impl.hpp"

namespace moebius {

std::shared_ptr<const cuda_prepared_plan> cuda_peer_transport::impl::lookup_or_prepare(
    const plan& p, bool& from_cache, double& prepare_seconds, double& lookup_seconds) {
  const auto t0 = cuda_peer::clock_type::now();
  std::shared_ptr<const cuda_prepared_plan> prepared = cache.find(p);
  lookup_seconds = cuda_peer::seconds_since(t0);
  from_cache = prepared != nullptr;
  prepare_seconds = 0;
  if (from_cache) return prepared;
  const auto t1 = cuda_peer::clock_type::now();
  prepared = prepare(p);
  prepare_seconds = cuda_peer::seconds_since(t1);
  cache.insert(p, prepared, config.max_cached_plans);
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
