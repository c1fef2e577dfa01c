#pragma once

// The switch transaction (switcher.hpp): run a switch_plan, verify, commit or undo; after an
// inconsistent end, recover (recovery.cpp). It plans nothing: switcher::plan did
// (switch_plan.cpp), and it changes the switcher's state (switch_state.hpp) that it is lent.
// Both switch styles are one transaction; they differ only in how the work is cut:
//
//   whole      (switcher::switch_to) one unit: the weights of every layer (one phase each),
//              then all layers' KV in one migration; run as two plans, weights then KV.
//   per_layer  (switcher::begin)     one unit per layer: that layer's weights (one phase),
//              then that layer's KV rounds; an advance of n layers is one plan of n units,
//              with a phase mark (an event per local rank) after each unit.
//
// Why per-layer KV plans are valid. A page id names the same page in every layer, so the KV
// migration's page-state evolution (which page is free in which round) is the same for every
// layer. The migration is therefore planned once (switch_plan::layer_kv), for a one-layer
// geometry (layer 0's tensors, staging at offset 0), and shifted to layer l: pool offsets by
// l's tensor offset, staging offsets to the arena slot that is free right after l's weights
// moved (EP->TP: layer l goes from slot l+1 to slot l, so slot l+1 comes free; TP->EP: from
// slot l to l+1, slot l comes free). Each shifted plan only touches layer l's KV and the free
// slot, and drains its staging before the next layer's weights write that slot.
//
// Progress is counted in phases of the whole switch: units laid end to end, each unit's weight
// phases then its KV rounds. `phases_done` says how far the switch got; the cursor at any
// count follows from it (cursor_at), and so does the undo: the exact reverse of what ran, unit
// by unit from the last (rollback_plan of the unit's completed KV rounds, then its weights
// back), so that each unit's staging slot is free again when its KV undo needs it.

#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moebius/kv/page_table.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/switch/pacing.hpp"
#include "moebius/switch/progressive.hpp"
#include "moebius/switch/switch_report.hpp"
#include "moebius/switch/switch_plan.hpp"
#include "moebius/switch/switcher.hpp"
#include "switch_state.hpp"

namespace moebius::detail {

using clock_type = std::chrono::steady_clock;

inline double ms_between(clock_type::time_point a, clock_type::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// A plan's failure as the transaction needs it: its text, and whether an undo can be trusted.
// A barrier timed out (a slow peer may still pass it and write past the reached phase), or the
// device or the communicator failed: the bytes after completed_phases() are unknown. Injected
// faults and rejected plans are exact. (undo.cpp)
struct failure_info {
  std::string text;
  bool state_unknown = false;
};
failure_info classify(const std::exception_ptr& e);

class switch_transaction {
 public:
  enum class style : uint8_t { whole, per_layer };

  // Runs `p` on `st` (p current, and not already_there: the switcher checked) from `rep`, which
  // the switcher has opened. Returns nullptr with `rep` final when the plan refused this style
  // (capacity) or the verify hook failed before anything moved; otherwise the transaction, whose
  // report (a copy of `rep` from here on) has outcome in_progress.
  static std::unique_ptr<switch_transaction> open(switch_state& st, const switch_plan& p,
                                                  style how, switch_report& rep,
                                                  clock_type::time_point t0);

  const switch_report& report() const { return rep_; }
  bool ended() const { return ended_; }
  int64_t units_remaining() const { return num_units() - units_enqueued_; }
  const layer_bytes& bytes_per_layer() const { return bytes_per_layer_; }
  switch_step_view view() const;

  // Enqueues the next min(units, units_remaining()) units (the caller checked units >= 1 and
  // that nothing is outstanding) and returns their completion (per_layer: one event per unit
  // and local rank).
  // `beside`: the layer events of a step overlapping these copies (per_layer only; checked).
  const layer_completion& enqueue(int64_t units, std::span<const stream_handle> streams,
                                  const step_layer_events* beside = nullptr);
  bool outstanding() const { return current_ != nullptr || !queued_.empty(); }
  // Never blocks: collects a finished plan, starts the next queued one; a failure undoes the
  // switch and ends the transaction.
  progress_state poll();
  // Blocks until nothing is outstanding (or the transaction ended on a failure).
  void wait();
  // Runs what is left, waits, verifies and commits (or undoes). Ends the transaction.
  void finish();
  // Waits, then undoes everything that completed. Ends the transaction.
  void abort(const std::string& why);
  // After the transaction ended inconsistent (switcher::recover; recovery.cpp): rebuilds the KV
  // tables in request.layout from what is intact, reloads the experts, and makes the switcher
  // consistent.
  recovery_report recover(const recovery_request& request);

 private:
  // The weights of `from` .. `to` (one phase per layer), then `kv_rounds` KV rounds.
  struct unit {
    arena_cursor from, to;
    int64_t first_phase = 0;  // in the whole switch
    int64_t kv_rounds = 0;
    int64_t weight_phases() const;
    int64_t phases() const { return weight_phases() + kv_rounds; }
    // The layer a per_layer unit moves: EP->TP layer `from` (into slot from), TP->EP layer `to`.
    int64_t layer() const { return to.tp_layers > from.tp_layers ? from.tp_layers : to.tp_layers; }
  };
  // A plan given to the transport, covering phases [first_phase, first_phase + phases) of the
  // switch.
  struct segment {
    std::shared_ptr<const plan> work;  // shared: switch_to's plans are not copied to run
    switch_fault::stage stage;  // which armed fault it takes; weights/kv: also its timer
    bool timed = false;         // whole style: its time is the stage's (weights_ms, kv_ms)
    int64_t first_phase = 0;
    std::vector<int64_t> marks;  // phase marks within `work` (transport::mark_phases)
    std::vector<transport::phase_wait> waits;  // within `work` (wait_before_phases)
  };
  // What an inconsistent end leaves for recover(): the phases of the switch whose bytes are
  // unknown ([unknown_first, unknown_end), a barrier timeout or device error), and the unit
  // whose undo failed (units after it were undone; its KV undo failed or not).
  struct wreck_log {
    int64_t unknown_first = -1, unknown_end = -1;
    int64_t undo_failed_unit = -1;
    bool undo_failed_in_kv = false;
  };
  // recover()'s KV part, once done (a retry after a failed reload only reloads).
  struct recovered_kv {
    bool settled = false;
    parallel_layout layout;
    kv_state tables;
    std::vector<int64_t> kept, lost;
    int64_t plans_run = 0;
  };

  switch_transaction(switch_state& st, const switch_plan& p, style how, const switch_report& rep,
                     clock_type::time_point t0);
  bool take_plan(const switch_plan& p);  // false: refused, or verify failed (rep final)

  int64_t num_units() const { return static_cast<int64_t>(units_.size()); }
  // The cursor once the first `phases` phases of the switch completed.
  arena_cursor cursor_at(int64_t phases) const;
  // Unit u's weights: whole, the plan's; per_layer, its phase u.
  std::shared_ptr<const plan> weight_plan_of(size_t u) const;
  // Unit u's KV plan: whole, the planned migration itself; per_layer, layer 0's shifted.
  std::shared_ptr<const plan> kv_plan_of(size_t u) const;

  // Enqueues `s`; a failure to enqueue is rethrown (nothing started, nothing changed) or kept
  // for collect() (the switch fails and is undone).
  void start(segment s, bool rethrow);
  bool collect();                // waits for the current plan; false on failure (undone)
  void settle(int64_t phases);   // phases_done, cursor, report counters
  // Runs an undo plan to completion: "" or the failure; `completed` its phases that completed
  // and `state_unknown` set when no later undo can be trusted.
  std::string run_undo(const plan& p, int64_t& completed, bool& state_unknown);
  void fail(std::string failure, bool state_unknown);
  void undo();
  void mark_inconsistent(const std::string& why);
  // Where unit u's KV is intact after an inconsistent end: in the source layout, the target
  // layout, or nowhere (its bytes unknown).
  enum class kv_at : uint8_t { source, target, unknown };
  kv_at kv_of_unit(size_t u) const;
  // recover()'s KV part: recovered_ in `layout`'s attention view (runs the moves it needs).
  void rebuild_kv(parallel_layout layout);
  void end(switch_outcome outcome);
  uint64_t checksum(arena_cursor c, const kv_state& tables, std::string& failure);
  // verify_layer of layer `layer` in `mode` through `tables` (time counted as verify_ms).
  uint64_t layer_checksum(int64_t layer, parallel_mode mode, const kv_state& tables,
                          std::string& failure);
  // verify_layer after the move of every completed unit not yet checked (all units: whole);
  // false when one differs (the switch failed and was undone).
  bool verify_moved_layers();
  void arm(switch_fault::stage stage);

  switch_state& st_;
  parallel_layout target_;
  int64_t target_dcp_;  // the TP view's dcp at commit (switch_plan::to_dcp)
  arena_cursor start_, goal_;
  style how_;
  switch_report rep_;
  clock_type::time_point t0_;

  std::vector<unit> units_;
  std::shared_ptr<const plan> kv_;       // whole: all layers' migration; per_layer: layer 0's
  std::shared_ptr<const plan> weights_;  // every layer's weights, one phase per layer
  kv_state target_tables_;
  layer_bytes bytes_per_layer_;  // per_layer only
  uint64_t checksum_before_ = 0;
  std::vector<uint64_t> layer_before_;  // [L] verify_layer before anything moved
  size_t units_verified_ = 0;           // per_layer: units whose layer was checked after

  int64_t units_enqueued_ = 0;
  int64_t phases_done_ = 0;
  std::unique_ptr<segment> current_;  // on the transport
  std::exception_ptr start_failure_;  // enqueue of current_ threw after work may have started
  clock_type::time_point current_started_;
  std::deque<segment> queued_;        // to start once current_ finished
  std::vector<stream_handle> streams_;
  layer_completion completion_;
  bool ended_ = false;

  wreck_log wreck_;
  recovered_kv recovered_;
};

}  // namespace moebius::detail
