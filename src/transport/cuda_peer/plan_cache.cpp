// cuda_peer_transport's cache of prepared plans: keyed by a sampled key of the plan (sizes and
// a few ops per phase, O(phases)), confirmed by plan equality, least recently used dropped
// first.
//
// Why not hash_of(plan): it mixes every field of every op through a splitmix finaliser, a
// serial chain of ~110 cycles an op (1.2 ms for the 30k-op HND KV plan at 90% on a 2.8 GHz
// Xeon; the hash before it cost ~30 cycles an op). Every enqueue(const plan&) paid it before a
// single launch, on top of the equality check, and for KV plans that was as much host time as
// the copies themselves: the 1.3-1.6x KV migration slowdown of the transport rework. The
// equality check alone (~5 ns an op, a memory-bound field compare) is what a hit must pay: only
// the caller's plan says whether it still equals the cached one.

#include <algorithm>

#include "impl.hpp"

namespace moebius {
namespace {

uint64_t mix(uint64_t h, uint64_t v) {
  uint64_t x = h ^ (v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  return x ^ (x >> 29);
}

uint64_t mix_op(uint64_t h, const copy_op& op) {
  h = mix(h, static_cast<uint64_t>(op.src_offset));
  h = mix(h, static_cast<uint64_t>(op.dst_offset));
  h = mix(h, static_cast<uint64_t>(op.rows) ^ (static_cast<uint64_t>(op.row_bytes) << 20));
  h = mix(h, static_cast<uint64_t>(op.src_pitch) ^ (static_cast<uint64_t>(op.dst_pitch) << 7));
  return mix(h, (static_cast<uint64_t>(static_cast<uint32_t>(op.src_rank)) << 32) ^
                    static_cast<uint32_t>(op.dst_rank) ^
                    (static_cast<uint64_t>(op.src_space) << 24) ^
                    (static_cast<uint64_t>(op.dst_space) << 16));
}

// Mixes up to k_samples ops of `ops` spread evenly, the first and the last included.
//   ops.size() == 1000: ops 0, 66, 133, ..., 999 (16 of them)
constexpr size_t k_samples = 16;
uint64_t mix_sampled(uint64_t h, const std::vector<copy_op>& ops) {
  const size_t n = ops.size();
  h = mix(h, n);
  if (n == 0) return h;
  const size_t count = std::min(n, k_samples);
  for (size_t i = 0; i < count; ++i) {
    const size_t at = count == 1 ? 0 : i * (n - 1) / (count - 1);
    h = mix_op(h, ops[at]);
  }
  return h;
}

}  // namespace

uint64_t cuda_peer::sampled_plan_key(const plan& p) {
  uint64_t h = mix(0, static_cast<uint64_t>(static_cast<uint32_t>(p.num_ranks)));
  h = mix(h, p.phases.size());
  for (const plan_phase& ph : p.phases) {
    h = mix(h, ph.label.size());
    h = mix_sampled(h, ph.ops);
    h = mix_sampled(h, ph.restores);
  }
  return h;
}

std::shared_ptr<const cuda_prepared_plan> cuda_peer_transport::impl::lookup_or_prepare(
    const plan& p, bool& from_cache, double& prepare_seconds, double& lookup_seconds) {
  const auto t0 = cuda_peer::clock_type::now();
  const uint64_t key = cuda_peer::sampled_plan_key(p);
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
