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

#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <vector>

#include "moebius/plan/memory_space.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/transport/transport.hpp"

namespace moebius {

// Bytes of each memory space (indexed by memory_space) that every rank has.
struct dry_run_spaces {
  int64_t arena_bytes = 0;
  int64_t kv_pool_bytes = 0;
};

class dry_run_transport final : public transport {
 public:
  // Throws errc::invalid_argument unless num_ranks >= 1 and both sizes are >= 0.
  dry_run_transport(int num_ranks, dry_run_spaces spaces);

  int num_ranks() const override { return num_ranks_; }
  std::vector<int> local_ranks() const override;
  // Every op must fit the ranks' spaces (plan.hpp's validate).
  void validate(const plan& p) const override;
  // Validates `p`, then "runs" it phase by phase up to an armed fault, counting its traffic;
  // `streams` must be empty or all nullptr (there is no device).
  void enqueue(const plan& p, std::span<const stream_handle> streams = {}) override;
  bool poll() override { return true; }
  void wait() override;
  int64_t completed_phases() const override { return completed_phases_; }
  // Faults fire as host_transport's do: before op `at.op` of phase `at.phase`, with `at.code`.
  void inject_fault(std::optional<fault_point> at) override { fault_ = at; }
  // Nothing runs on a device: every event is nullptr, every wait must name nullptr events.
  void mark_phases(std::span<const int64_t> after_phases) override;
  void wait_before_phases(std::span<const phase_wait> waits) override;
  event_handle phase_event(size_t mark, size_t local_index) const override;

  // What the plans enqueued so far would have moved (phases that completed), per rank, summed.
  const plan_traffic& traffic() const { return traffic_; }
  int64_t plans_run() const { return plans_run_; }

 private:
  int num_ranks_;
  int64_t space_bytes_[num_memory_spaces] = {};
  std::optional<fault_point> fault_;
  std::vector<int64_t> pending_marks_;
  size_t num_marks_ = 0;
  int64_t completed_phases_ = 0;
  bool outstanding_ = false;
  std::exception_ptr failure_;
  plan_traffic traffic_;
  int64_t plans_run_ = 0;
};

}  // namespace moebius
