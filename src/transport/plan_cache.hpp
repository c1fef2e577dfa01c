#pragma once

// What a transport derives from a plan (descriptors, graphs, NCCL schedules), kept for the
// plans it saw last, so that enqueueing the same plan again skips preparing it. Keyed by
// fingerprint_of(plan) (O(phases)) and confirmed by plan equality, least recently used
// dropped first. Both GPU transports keep one (private to src/transport/). Not keyed by
// hash_of(plan): it mixes every field of every op (~110 cycles an op), and paying that before
// every enqueue of a 30k-op KV plan made KV migration 1.3-1.6x slower than its copies alone
// (docs/BENCHMARKS.md); a hit pays only the equality check (~5 ns an op).
//   cache.find(p)                   -> nullptr: prepare, then cache.insert(p, prepared, 8)
//   cache.find(p) (p equal again)   -> that prepared form, now the most recently used

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>

#include "moebius/plan/plan.hpp"

namespace moebius::detail {

template <class Prepared>
class plan_cache {
 public:
  // The prepared form of a plan equal to `p`, made the most recently used; nullptr when none.
  std::shared_ptr<const Prepared> find(const plan& p) {
    const uint64_t key = fingerprint_of(p);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->key == key && it->copy == p) {
        entries_.splice(entries_.begin(), entries_, it);
        return entries_.front().prepared;
      }
    }
    return nullptr;
  }

  // Keeps `prepared` as the most recently used entry for `p`, then drops the least recently
  // used entries beyond `capacity` (0: keeps nothing).
  void insert(const plan& p, std::shared_ptr<const Prepared> prepared, int64_t capacity) {
    if (capacity <= 0) return;
    entries_.push_front(entry{fingerprint_of(p), p, std::move(prepared)});
    while (static_cast<int64_t>(entries_.size()) > capacity) entries_.pop_back();
  }

  void clear() { entries_.clear(); }
  size_t size() const { return entries_.size(); }

 private:
  struct entry {
    uint64_t key;  // fingerprint_of(copy)
    plan copy;
    std::shared_ptr<const Prepared> prepared;
  };
  std::list<entry> entries_;  // most recently used first
};

}  // namespace moebius::detail
