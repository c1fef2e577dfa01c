#pragma once

// The switcher: the one call an engine makes between two decode steps to go from EP to TP or
// back (DESIGN.md §2 item 6). It owns the layout state of the arena (its cursor) and of the
// KV pool (page tables and free lists), runs
//
//   capacity check -> expert weights, layer by layer -> KV migration in rounds -> new page
//   tables -> flip of the runtime selector
//
// on any transport, and either commits or puts everything back.
//
// Failure protocol. Every phase of every plan writes only bytes that were free before it
// (plan/rollback.hpp), so after a failure at weight phase k or KV round r the switcher runs
// the undo of the completed KV rounds, then the weight plan from the cursor reached back to
// the starting cursor: the arena, the KV pool's live pages and the tables are exactly as
// before the call, and the selector never moved (outcome rolled_back). If the undo fails too,
// or the failure was a barrier timeout or a device/communicator error (a slow peer may still
// pass the barrier and write past the phase the transport reports, so no undo is trusted),
// the outcome is `inconsistent`: the
// report names the cursor the arena was last known to rest at, and the engine must reload
// its experts and KV before serving; the switcher refuses further switches. A refused switch
// (capacity) moves nothing.

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "moebius/kv/page_table.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/plan/switch_workload.hpp"
#include "moebius/transport/transport.hpp"

namespace moebius {

enum class switch_outcome : uint8_t {
  committed,          // weights, KV and tables are in the target mode; the selector flipped
  already_there,      // the switcher was already in the target mode: nothing moved
  refused_capacity,   // the target mode cannot hold the live KV: nothing moved
  rolled_back,        // a failure; everything is back as before the call
  inconsistent,       // a failure and a failed undo: see switch_report::error and cursor
  in_progress,        // a progressive switch has begun and not yet finished
};

constexpr bool is_valid(switch_outcome o) {
  return static_cast<uint8_t>(o) <= static_cast<uint8_t>(switch_outcome::in_progress);
}

const char* to_string(switch_outcome o);

// What one switch_to() did.
struct switch_report {
  parallel_mode from = parallel_mode::ep;
  parallel_mode to = parallel_mode::ep;
  switch_outcome outcome = switch_outcome::already_there;
  std::string error;          // the failure (and the undo's failure), "" when none
  arena_cursor cursor;        // where the arena rests after the call

  int64_t weight_phases = 0;            // phases of the weight plan
  int64_t weight_phases_completed = 0;  // of them, completed before a failure (or all)
  int64_t kv_rounds = 0;                // rounds of the KV migration
  int64_t kv_rounds_completed = 0;
  std::vector<int64_t> weight_bytes_sent;  // per rank, bytes leaving it for other ranks
  std::vector<int64_t> kv_bytes_sent;      // per rank
  kv_migration_stats kv_stats;
  kv_capacity_report capacity;

  // Host wall time of each stage, in milliseconds (a stage that did not run is 0).
  // capacity_ms: the detailed capacity report of a refused switch (an accepted one checks
  // capacity while planning, inside plan_ms).
  double capacity_ms = 0, plan_ms = 0, weights_ms = 0, kv_ms = 0, verify_ms = 0, undo_ms = 0,
         total_ms = 0;
  bool verified = false;  // the verify hook ran and its checksums matched
};

std::ostream& operator<<(std::ostream& os, const switch_report& r);

// What a switch moved, for the cost model (policy/cost_model.hpp, a layer above: feed it from
// there; this header does not include it): the busiest rank's bytes,
// the weight phases and KV rounds that ran. Feed it with the measured time to
// cost_model::update() so predictions follow the hardware.
switch_workload workload_of(const switch_report& r);

struct switcher_options {
  // Lend the arena's free slot to the KV migration as staging for pages whose destination is
  // not free yet (lets a switch succeed near full occupancy).
  bool stage_kv_in_free_slot = true;
  int64_t max_kv_rounds = 4096;
  // Called at commit with the new mode, after every byte has moved: the engine flips its
  // runtime selector here (which set of CUDA graphs and views it launches next step).
  std::function<void(parallel_mode)> on_commit;
  // Optional end-to-end check: called before moving anything and after the last byte moved;
  // returns a layout-independent checksum of the state (see switch/checksum.hpp). A mismatch
  // is a failure, handled like a transport error (undo, rolled_back).
  std::function<uint64_t(arena_cursor, const kv_state&)> verify;
};

// A test hook: a fault injected into one stage of the next switch_to().
struct switch_fault {
  enum class stage : uint8_t { weights, kv, undo } where = stage::weights;
  fault_point at;  // phase (layer index within the weight plan, or KV round) and op
};

class switcher {
 public:
  // `weights` and `kv` describe one rank's arena and KV pool (the transport's memory spaces
  // arena and kv_pool); `kv_tables` is the KV state now (its mode is the current mode), and
  // `cursor` where the arena rests now. The two must agree: cursor 0 with EP tables, cursor L
  // with TP tables. Throws errc::invalid_argument otherwise, or when the geometries' rank
  // counts differ from the transport's.
  switcher(const arena_geometry& weights, const kv_geometry& kv, transport& t, kv_state kv_tables,
           arena_cursor cursor, switcher_options options = {});
  ~switcher();
  switcher(const switcher&) = delete;
  switcher& operator=(const switcher&) = delete;

  // The runtime selector: the mode the engine must run in now (meaningless once
  // consistent() is false).
  parallel_mode mode() const { return kv_.mode; }
  arena_cursor cursor() const { return cursor_; }
  const kv_state& kv_tables() const { return kv_; }
  // The engine adds and retires sequences between switches; the tables must stay valid.
  kv_state& mutable_kv_tables() { return kv_; }

  // Whether a switch to `target` would be accepted by the capacity check; moves nothing.
  // Throws errc::invalid_argument for a target that names neither EP nor TP.
  kv_capacity_report check(parallel_mode target) const;

  // Switches everything to `target` (see the failure protocol above). Never throws once bytes
  // may move: a transport error, a fault, a verify mismatch or a throwing verify hook all
  // end in the report. Throws errc::invalid_argument for a target that names neither EP nor
  // TP, or when the KV tables are invalid (nothing moved).
  switch_report switch_to(parallel_mode target);

  // False after an `inconsistent` outcome: switch_to() then refuses, moving nothing.
  bool consistent() const { return consistent_; }

  // --- Progressive switch (DESIGN.md §7): a few layers per decode step ---------------------
  //
  //   begin(target)    capacity check and plans; moves nothing
  //   advance(n, s)    enqueues the next n layers (each layer's weights, then that layer's KV
  //                    rounds) on the caller's streams and returns without waiting
  //   poll()           true once the last advance finished; the cursor then moves past it
  //   finish()         advances the rest, waits, commits (tables, selector)
  //   abort()          waits, then puts every moved layer back: the state of begin()
  //
  // While a switch is in progress layer l runs TP when l < cursor() and EP otherwise, with the
  // page tables of that mode (tables_for()); both sets coexist, one per layer. The tables are
  // frozen from begin() to finish(): a sequence may fill the tokens its tables already hold
  // (reserve them before begin()), and new sequences wait for finish(). Layers of an
  // outstanding advance are in flight: the engine must order its reads and KV writes of those
  // layers around the copies (the streams it passes to advance()), or advance between steps.
  // A failure anywhere (an advance, the undo of an abort) follows the failure protocol above:
  // everything is put back (rolled_back) or the switcher is inconsistent.
  //
  // Outcome of begin(): in_progress, or already_there / refused_capacity / inconsistent
  // (nothing started).
  switch_report begin(parallel_mode target);
  bool in_progress() const { return progress_ != nullptr; }
  // Layers not yet enqueued by advance().
  int64_t layers_remaining() const;
  // Enqueues the next min(layers, layers_remaining()) layers; returns how many. `streams`: one
  // per local rank of the transport, or empty (see transport::enqueue). Throws
  // errc::invalid_argument when no switch is in progress, an advance is still outstanding
  // (poll() first), or layers < 1.
  int64_t advance(int64_t layers, std::span<const stream_handle> streams = {});
  // True when no advance is outstanding (never blocks). When the outstanding one has just
  // finished, the cursor moves past its layers; when it failed, the switch is rolled back
  // (see progress_report()) and in_progress() becomes false.
  bool poll();
  // Advances every remaining layer, waits, and commits; or rolls back on failure.
  switch_report finish();
  // Waits for an outstanding advance, then undoes every moved layer (last first).
  switch_report abort();
  // The report of the switch in progress (or of the last one that ended).
  const switch_report& progress_report() const { return progress_report_; }
  // The page tables layers of mode `m` read: during a switch both modes have tables; outside
  // one only mode() does (errc::invalid_argument otherwise).
  const kv_state& tables_for(parallel_mode m) const;
  // The mode layer `layer` runs in now: TP iff layer < cursor().
  parallel_mode layer_mode(int64_t layer) const {
    return layer < cursor_.tp_layers ? parallel_mode::tp : parallel_mode::ep;
  }

  // Arms a one-shot fault for one stage of the next switch_to() (tests of the failure
  // protocol); several calls arm several stages; std::nullopt disarms them all.
  void inject_fault(std::optional<switch_fault> fault) {
    if (fault) faults_.push_back(*fault);
    else faults_.clear();
  }

 private:
  // Runs `p`; on failure returns the error text, sets `completed` to the phases done and
  // `state_unknown` when no undo can be trusted (barrier timeout, device error).
  std::string run(const plan& p, switch_fault::stage stage, int64_t& completed,
                  bool& state_unknown);

  kv_migration_options kv_options(arena_cursor weights_at) const;
  // Opens `rep` for a switch to `target` (from, to, cursor) and returns the resting cursor of
  // `target`, or nothing when the report is already final: refused because the switcher is
  // inconsistent, or already_there. switch_to() and begin() start alike.
  std::optional<arena_cursor> open_report(switch_report& rep, parallel_mode target) const;
  // Arms the first armed fault whose stage `matches` on the transport, and drops it.
  void arm_fault(const std::function<bool(switch_fault::stage)>& matches);

  // Progressive switch state (src/switch/progressive.cpp).
  struct progress;
  void wait_advance();
  void undo_progress(int64_t layers_done, int64_t partial_phases);
  switch_report end_progress();

  arena_geometry weights_;
  kv_geometry kv_geometry_;
  transport& transport_;
  kv_state kv_;
  arena_cursor cursor_;
  switcher_options options_;
  std::vector<switch_fault> faults_;
  bool consistent_ = true;
  std::string inconsistency_;
  std::unique_ptr<progress> progress_;
  switch_report progress_report_;
};

}  // namespace moebius
