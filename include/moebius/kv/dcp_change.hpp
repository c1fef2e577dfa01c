#pragma once

// A change of the TP view's KV-parallel degree (kv_geometry.hpp, dcp): the KV alone moves,
// TP(dcp a) -> TP(dcp b), both views TP, the pool and its layout unchanged. A plan of the same
// kind as kv_migration.hpp's (rounds of copy_ops, the tables after it, rollback of any prefix).
//
// What moves. Within a head slice the tp_replicas() = R ranks are numbered x = 0..R-1 (x = r %
// R); at dcp a rank x holds logical page i of every sequence iff i % a == x % a, at dcp b iff
// i % b == x % b. So rank x
//   keeps   the pages it holds at both: i == x (mod lcm(a, b)), i.e. its share at dcp
//           lcm(a, b) (a and b divide R, so lcm(a, b) does too: an allowed dcp);
//   drops   what it holds only at a (nobody reads it: every page has a keeper, below);
//   receives what it holds only at b, from the page's KEEPER in its own set of lcm(a, b)
//           consecutive ranks: the rank holding i there at dcp lcm(a, b) (g.tp_rank_of of
//           that geometry). Keepers never change, so any number of readers may read them in any
//           round, and the reads are balanced: every rank sends what it receives.
//   dcp 1 -> 2: every rank keeps its share and drops the rest: no copy at all, no phase; only
//               the tables change.
//   dcp 2 -> 1: every rank keeps its share and receives the other share from its partner.
//   R = 6, dcp 2 -> 3: rank x keeps i == x (mod 6) and receives i == x + 3 (mod 6) from rank
//               x + 3 (mod 6) of its slice; it drops i == x + 2, x + 4 (mod 6).
//
// Rounds. Round 0 copies into the pages free at the start and drops every dropped page (each
// listed in the phase's restores, re-created from its keeper on rollback); round 1 copies the
// rest into the pages the drops freed. Whenever the target holds the live KV (each rank's share
// at dcp b, shared pages once, fits its TP pages) a round-1 copy always finds a free page, so a
// dcp change takes at most 2 rounds at any occupancy up to 100% and never stages: the only
// pages a rank waits for are its own drops, which nobody reads and which free at the first
// barrier. When the target does not hold (dcp 2 -> 1 above 50% occupancy: every rank then
// holds every page; or many short sequences, which all start on DCP index 0), the check
// refuses with the rank and the numbers and nothing moves. Each page is one whole-TP-page op
// over all tensors (kv_pool_layout.hpp: any layout), so per-layer plans and rollback_plan()
// work as for the other planners.
//
//   Qwen3 (H_kv=4, P=8, so R=2), a 5-page sequence, dcp 2 -> 1: rank 0 (x = 0) keeps logical
//   pages 0, 2, 4 and receives 1, 3 from rank 1; rank 1 keeps 1, 3 and receives 0, 2, 4 from
//   rank 0: 5 ops of one TP page per head slice, 20 in all, 1 round. Back to dcp 2: rank 0
//   drops 1, 3, rank 1 drops 0, 2, 4: 0 ops, 0 rounds.

#include <cstdint>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "moebius/kv/kv_pool_layout.hpp"
#include "moebius/kv/page_table.hpp"

namespace moebius {

// One run of the dcp-change planner over a pool in `layout`: the capacity answer (pages per
// rank of the TP view at dcp `dcp`) and, when it fits, the migration: its copies, its tables
// (valid for with_dcp(g, dcp)) and its stats (pages_moved: TP pages copied, one per receiving
// rank and distinct page; pages_in_place: TP pages kept, per rank; pages_staged 0). `g` is the
// pool's geometry at the source dcp (g.dcp) and `s` a state of it. An EP state, or dcp ==
// g.dcp, is the identity (no phase, the tables unchanged: the EP view does not depend on dcp).
// opt.staging is validated and never used (see above); opt.placement is ignored.
// Throws errc::invalid_argument for an invalid state or layout, a dcp that with_dcp(g, dcp)
// refuses (naming it), or a page shared at logical pages that the two dcp values place on
// different ranks (pages of a shared prefix sit at one logical index in every sharer).
kv_migration_attempt try_plan_kv_dcp_change(const kv_geometry& g, const kv_pool_layout& layout,
                                            const kv_state& s, int64_t dcp,
                                            const kv_migration_options& opt = {});

// The migration of `s` to dcp `dcp`; throws errc::capacity, with the reason, when the target
// cannot hold the live KV (or more than opt.max_rounds rounds would be needed), and as above.
//   make_kv_geometry(94, 4, 128, 16, 64, 8) (dcp 1), every TP rank 94% full, to dcp 2: 0
//   rounds, 0 bytes; each rank keeps its share (about half its pages) and frees the rest.
kv_migration plan_kv_dcp_change(const kv_geometry& g, const kv_state& s, int64_t dcp,
                                const kv_migration_options& opt = {});
kv_migration plan_kv_dcp_change(const kv_geometry& g, const kv_pool_layout& layout,
                                const kv_state& s, int64_t dcp,
                                const kv_migration_options& opt = {});

}  // namespace moebius
