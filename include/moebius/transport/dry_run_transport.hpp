#pragma once

// A transport that runs plans without moving a byte: it validates every plan against the sizes
// of its ranks' memory spaces exactly as the other transports do (a plan it accepts, they
// accept; one it refuses, they refuse with the same error), follows the same lifecycle and
// fault semantics, and counts what the plans would have moved. For simulation and planning at a
// deployment's real size without its memory: a switcher over a dry-run transport plans, checks
// and commits every switch (its tables and cursor change as after a real one) while the bytes a
// real transport would have moved are only counted (traffic()). The memory a verify hook would
// read does not exist: a switcher over this transport must run without verify hooks.
//
//   P = 8 ranks of an H200 deployment, arena 20 GiB and KV pool 55 GiB each, no memory at all:
//     dry_run_transport t(8, {20LL << 30, 55LL << 30});
//     switcher sw(arena, kv, t, tables, arena_cursor{0});
//     sw.switch_to(parallel_mode::tp);          // plans run here; t.traffic() has their bytes

#include <cstddef>
#include <cstdint>

#include "moebius/plan/memory_space.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/transport/synchronous_transport.hpp"

namespace moebius {

// Bytes of each memory space (indexed by memory_space) that every rank has.
struct dry_run_spaces {
  int64_t arena_bytes = 0;
  int64_t kv_pool_bytes = 0;
};

// The lifecycle, faults, marks and waits are synchronous_transport's: enqueue() "runs" the plan
// phase by phase up to an armed fault, as host_transport runs it; there is no device.
class dry_run_transport final : public synchronous_transport {
 public:
  // Throws errc::invalid_argument unless num_ranks >= 1 and both sizes are >= 0.
  dry_run_transport(int num_ranks, dry_run_spaces spaces);

  // Every op must fit the ranks' spaces (plan.hpp's validate).
  void validate(const plan& p) const override;

  // What the plans enqueued so far would have moved (phases that completed), per rank, summed.
  const plan_traffic& traffic() const { return traffic_; }

 private:
  // Counts a whole phase's ops; a phase cut short by a fault counts none (it did not complete).
  void run_ops(const plan_phase& phase, size_t num_ops) override;

  int64_t space_bytes_[num_memory_spaces] = {};
  plan_traffic traffic_;
};

}  // namespace moebius
