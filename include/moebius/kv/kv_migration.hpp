#pragma once

// Migration of the paged KV cache between the EP and TP views (DESIGN.md §4): from the
// current tables, a plan of copy_ops on memory_space::kv_pool (optionally staging through a
// region of memory_space::arena) plus the tables and free lists after it. The plan runs
// unchanged on every transport.
//
// Pages move independently (a shared page moves once; a sequence's pages may move in
// different rounds). A ROUND is one plan phase: copy a batch into pages that are free at the
// start of the phase (or into staging slots), barrier, then the batch's source pages become
// free for later rounds. Staged pieces are drained into the pool in later rounds.
//
// EP->TP, per head slice ("piece") of each live EP page: when slices are contiguous (HND, or
//   NHD with page_size 1, where a page is [head][dim]) the owner's own slice stays in place (EP
//   page p = TP pages p*split+j; slice tp_slice_of_rank(owner) is already where the TP view
//   reads it); piece j goes to the ranks holding slice j (one, or P/H_kv replicas) and, after
//   its round, TP page p*split+j of the owner is free. Pieces of one page move independently,
//   so two full ranks unblock each other. NHD with page_size > 1 interleaves heads per token,
//   so the owner copies its own slice out too and the EP page frees when its last piece left
//   (a full NHD rank then needs one staging slot; its last slot is kept for its own pages'
//   pieces, since other ranks' pieces staged there free none of its pages).
//   Incoming pieces take TP pages of wholly free EP pages first, so the owners' freed pieces
//   stay free and the way back can be in place.
// TP->EP: each sequence gets an owner (placement); each page of the owner gets an aligned
//   group of split TP pages (= one EP page) and gathers every slice into it (from one replica
//   when H_kv < P). Contiguous slices land piece by piece as the group's TP pages free, so
//   every free TP page is used in the round it is free; a page whose own piece already sits at
//   its slice position keeps it there. Pieces that block a destination while spare free pages
//   idle step aside into them (stats.pages_compacted); staging breaks a cycle of waits (also
//   between two pages kept in place). Replicas no owner reads (H_kv < P) free in round 0.
//   Interleaved slices need a wholly free group; owners short of groups compact.
//   Rounds at 90% occupancy, P=2: ~ 8 (pieces to land / free TP pages per rank, plus a tail).
// With dcp > 1 (kv_geometry.hpp) the TP view holds each head slice's tokens once per replica
//   set instead of once per rank: EP->TP sends piece j of logical page i only to the rank of
//   DCP index i % dcp in each set of slice j (the owner keeps its slice in place only when it is
//   that rank; otherwise its slice is sent and its TP page frees), so no replica is made beyond
//   tp_replicas()/dcp and the bytes fall by about dcp; TP->EP reads each (page, slice) from the
//   rank of the page's share (one per set; unread replicas free in round 0 as before). The
//   capacity check counts, per DCP index, the live EP pages at logical pages of that index.
//   Staging, the rounds, rollback and every pool layout are as above; dcp = 1 is the plan above,
//   op for op.
// Within a phase no destination overlaps another destination or a live source
// (find_phase_hazard() in plan.hpp checks it), and every byte a phase frees is either read by it or listed
// in plan_phase::restores (unread TP replicas), so rollback_plan() undoes any prefix of the
// plan. Before anything moves the whole input is validated.
//
//   Qwen3 (H_kv=4, P=8, HND), one 20-token sequence on EP rank 2, pages {3, 7}:
//   EP->TP: one round; rank 2 keeps TP pages 3*4+1=13 and 7*4+1=29 (slice 1 = head 1) in
//   place; ranks 0,1 receive head 0, ranks 3 receives head 1 (rank 2's replica partner),
//   4,5 head 2, 6,7 head 3: 7 ranks x 2 pages = 14 ops of one tensor-strided copy each.
//   The same with dcp 2: page 3 (logical 0) goes to DCP index 0 (ranks 0, 2, 4, 6; rank 2
//   keeps head 1), page 7 (logical 1) to index 1 (ranks 1, 3, 5, 7): 3 + 4 = 7 ops.

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/kv_pool_layout.hpp"
#include "moebius/kv/page_table.hpp"
#include "moebius/kv/placement.hpp"
#include "moebius/plan/plan.hpp"

namespace moebius {

// A caller-lent region on every rank (the arena's free expert slot) used to hold pages whose
// destination is not free yet. bytes == 0: no staging.
struct kv_staging {
  memory_space space = memory_space::arena;
  int64_t offset = 0;  // byte offset of the region in `space`, same on every rank
  int64_t bytes = 0;   // bytes of the region
};

struct kv_migration_options {
  kv_staging staging;        // optional staging region
  int64_t max_rounds = 4096; // give up (errc::capacity) beyond this many rounds
  // TP->EP: owners to use, indexed like kv_demands_of(state); null = place_longest_first
  // with every rank's whole EP pool as capacity.
  const kv_placement* placement = nullptr;
};

struct kv_migration_stats {
  int64_t rounds = 0;          // plan phases
  int64_t pages_moved = 0;     // logical pages migrated (a shared page once, or once/owner)
  int64_t pages_in_place = 0;  // pages whose owner slice stayed where it was
  int64_t pages_staged = 0;    // page pieces that went through staging
  int64_t pages_compacted = 0; // TP pages moved locally (aside) to free a destination
  int64_t bytes_copied = 0;    // all bytes of all ops
  double imbalance = 0.0;      // TP->EP: placement max/mean load; EP->TP: 1
};

struct kv_migration {
  plan copies;            // phases of copy ops (kv_pool, staging space)
  kv_state new_state;     // tables and free lists in the target mode
  kv_migration_stats stats;
};

// Answer of the capacity check.
struct kv_capacity_report {
  bool fits = false;        // the target view can hold every live sequence AND a round
                            // schedule exists within max_rounds
  bool holds = false;       // the target view can hold everything (ignoring scheduling)
  int64_t rounds = 0;       // rounds the migration takes when fits
  int64_t pages_needed = 0; // max over ranks of pages needed in the target view
  int64_t pages_available = 0;  // pages per rank of the target view
  std::string reason;       // why not, naming the rank and the numbers; "" when fits
};

// One run of the planner: the capacity check's answer and, when it fits, the migration it
// planned (what check_kv_capacity and plan_kv_migration each return half of). For a caller that
// needs both, e.g. a switch planned once (switch/switch_plan.hpp). Throws as check_kv_capacity.
struct kv_migration_attempt {
  kv_capacity_report capacity;
  std::optional<kv_migration> migration;  // set iff capacity.fits
};
kv_migration_attempt try_plan_kv_migration(const kv_geometry& g, const kv_state& s,
                                           parallel_mode target,
                                           const kv_migration_options& opt = {});
// The same over a pool in any validated layout (kv_pool_layout.hpp).
kv_migration_attempt try_plan_kv_migration(const kv_geometry& g, const kv_pool_layout& layout,
                                           const kv_state& s, parallel_mode target,
                                           const kv_migration_options& opt = {});

// Whether `s` can migrate to `target` and in how many rounds; moves and changes nothing.
// Throws errc::invalid_argument for an invalid state (validate()).
//   Qwen3 (H_kv=4, P=8) EP at 60% occupancy -> TP: holds = false (TP holds at most 50%:
//   each head lives on 2 ranks), reason names the rank and pages needed vs available. With
//   dcp 2 it holds (up to ~99% with long sequences: the DCP index of each sequence's first page
//   holds up to one page a sequence more than the other).
kv_capacity_report check_kv_capacity(const kv_geometry& g, const kv_state& s,
                                     parallel_mode target, const kv_migration_options& opt = {});

// The migration plan of `s` to `target` (s.mode == target: an empty plan and s itself).
// Throws errc::invalid_argument for an invalid state or staging region, errc::capacity when
// check_kv_capacity says no (nothing is built; the caller's memory was never touched).
kv_migration plan_kv_migration(const kv_geometry& g, const kv_state& s, parallel_mode target,
                               const kv_migration_options& opt = {});

// The same over a pool in any validated layout (kv_pool_layout.hpp: an engine's own cache
// tensors): page tables, rounds, staging and capacity are those of the present layout; only
// the ops' addresses (and how many ops a page piece takes) differ. The overloads above use
// present_kv_layout(g). Also throws errc::invalid_argument when validate(g, layout) does.
//   vLLM FlashInfer cache of Qwen3 (H_kv=4, P=8): EP->TP copies every piece (no slice stays in
//   place: K and V of a block sit side by side, the TP block of a head slice does not).
kv_capacity_report check_kv_capacity(const kv_geometry& g, const kv_pool_layout& layout,
                                     const kv_state& s, parallel_mode target,
                                     const kv_migration_options& opt = {});
kv_migration plan_kv_migration(const kv_geometry& g, const kv_pool_layout& layout,
                               const kv_state& s, parallel_mode target,
                               const kv_migration_options& opt = {});

// Bytes of one staging slot (one page piece of every tensor): num_tensors * page_bytes(m).
// A staging region of n such slots lets n pieces per rank wait for their destination.
int64_t kv_staging_slot_bytes(const kv_geometry& g, parallel_mode target);

std::ostream& operator<<(std::ostream& os, const kv_migration_stats& s);

}  // namespace moebius
