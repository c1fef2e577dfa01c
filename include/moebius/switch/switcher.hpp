#pragma once

// The switcher: what an engine calls to go from one parallel layout to another
// (layout/parallel_layout.hpp: the attention's and the experts' layouts; DESIGN.md §2 item 6):
// the paper's switch, EP <-> TP, moves the experts and the KV; a switch of the experts alone
// under a fixed attention layout (TP attention, experts EP <-> TP) moves no KV byte; a switch
// of the attention alone moves the KV and no expert (stop the world only), and so does a
// change of the TP view's KV-parallel degree (plan_dcp: TP(dcp a) -> TP(dcp b), the layout
// unchanged; kv/dcp_change.hpp). It owns
// the layout state of the arena (its cursor) and of the KV pool (page tables and free lists),
// and runs one switch transaction on any transport:
//
//   plan (switcher::plan: capacity check, per-layer bytes, weight and KV plans; moves nothing)
//   -> run (expert weights layer by layer, each layer's or all layers' KV in rounds) -> verify
//   (optional hook) -> commit (new tables, cursor, flip of the runtime selector) or undo
//
// The plan is a value (switch/switch_plan.hpp), made once per decision: check(target) and
// layer_bytes_of(target) are views of plan(target), and switch_to(plan) / begin(plan) run that
// plan without planning again. A plan made before the state moved on (mutable_kv_tables(), a
// switch, recover()) is stale and refused by name. It runs in one of two styles that share
// the transaction:
//   switch_to(plan)     stop the world: the whole switch between two decode steps;
//   begin(plan)         progressive: a session (switch/progressive.hpp) that moves a few layers
//                       per decode step while the engine keeps serving with hybrid steps.
// switch_to(target) and begin(target) plan, then run. switch_to() is begin + advance(every
// layer) + finish, with all layers' weights first and then all layers' KV in one migration
// (fewer barriers than layer by layer).
//
// Failure protocol. Every phase of every plan writes only bytes that were free before it
// (plan/rollback.hpp), so after a failure at any phase the transaction runs the exact reverse
// of what completed (the KV rounds of a layer, then its weights, last layer first): the arena,
// the KV pool's live pages and the tables are exactly as before the switch, and the selector
// never moved (outcome rolled_back). If the undo fails too, or the failure was a barrier
// timeout or a device/communicator error (a slow peer may still pass the barrier and write
// past the phase the transport reports, so no undo is trusted), the outcome is `inconsistent`:
// the report names the cursor the arena was last known to rest at; the switcher refuses further
// switches until recover() (below) has rebuilt a consistent state: the experts reloaded from the
// caller's source of truth, the KV tables rebuilt from what is intact, the sequences whose KV was
// lost named so that the engine resumes or fails them. No process restart. A refused switch
// (capacity) moves nothing.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "moebius/kv/kv_pool_layout.hpp"
#include "moebius/kv/page_table.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/layout/parallel_layout.hpp"
#include "moebius/switch/pacing.hpp"
#include "moebius/switch/progressive.hpp"
#include "moebius/switch/switch_plan.hpp"
#include "moebius/switch/switch_report.hpp"
#include "moebius/transport/transport.hpp"

namespace moebius {

struct switcher_options {
  // Lend the arena's free slot to the KV migration as staging for pages whose destination is
  // not free yet (lets a switch succeed near full occupancy).
  bool stage_kv_in_free_slot = true;
  int64_t max_kv_rounds = 4096;
  // Called at commit with the new layout, after every byte has moved: the engine flips its
  // runtime selector here (which set of CUDA graphs and views it launches next step). A dcp
  // change calls it with the layout it keeps; switcher::dcp() then says the new dcp (the engine
  // rebuilds its TP views' DCP shares).
  std::function<void(parallel_layout)> on_commit;
  // Optional end-to-end check: called before moving anything and after the last byte moved;
  // returns a layout-independent checksum of the state (see switch/checksum.hpp). A mismatch
  // is a failure, handled like a transport error (undo, rolled_back). A progressive switch
  // calls it at begin() and at finish(): the tables are frozen between, but the engine writes
  // tokens into their reserved room meanwhile, so its hook must cover only what no step
  // writes during the switch (the mini-engine checks the tokens each sequence had written at
  // begin and excludes the rest). A dcp change (plan_dcp) calls it, and verify_layer, with the
  // tables at the dcp they are in: before the move at dcp(), after it at the plan's to_dcp
  // (dcp() changes at commit, after the last check): a hook reads the pool through them with
  // with_dcp(geometry, that dcp).
  std::function<uint64_t(arena_cursor, const kv_state&)> verify;
  // Optional per-layer check: a checksum of layer `layer` alone, its experts as they rest in
  // `mode` (weight_checksum with cursor 0 for EP, L for TP) and its K/V through `tables` (in
  // the attention's mode, tables.mode: the same as `mode` for the paper's layouts). Called for every layer before anything moves (source mode and
  // tables), and for each layer once it has moved (target mode and tables): a progressive
  // switch checks a layer in the poll() (or finish()) that finds its copies complete, so a
  // corrupted layer fails the switch at the advance that moved it; switch_to() checks every
  // layer before commit. The same rule as `verify` on tokens written during the switch. Needs
  // one KV layer per MoE layer (switch_to throws errc::invalid_argument otherwise, as begin()
  // always does).
  std::function<uint64_t(int64_t layer, parallel_mode mode, const kv_state& tables)> verify_layer;
  // TP -> EP: the owner of each live sequence, indexed like kv_demands_of(tp_tables)
  // (kv_migration_options::placement), instead of longest-first by the pages in use. An engine
  // that reserves room for its sequences to grow places them by what they will hold, so that
  // no owner ends up holding more reservations than pages. Called once by plan(), whose KV
  // plans both use it (switch_plan::ep_placement); a placement with fits == false refuses the
  // switch (capacity).
  std::function<kv_placement(const kv_state& tp_tables)> ep_placement;
  // Where the KV pool's bytes lie (kv_pool_layout.hpp): the cache as the engine's attention
  // kernels read it, so that every page and head slice lands where those kernels look for it.
  // Empty: the present layout (present_kv_layout). Every plan, stop-the-world and per layer,
  // is made over it; a progressive switch shifts layer 0's plan by the layout's layer stride.
  // The constructor validates it against the KV geometry (errc::invalid_argument).
  std::optional<kv_pool_layout> kv_layout;
};

// A test hook: a fault injected into one stage of the next switch.
struct switch_fault {
  // weights, kv: switch_to()'s weight plan and KV migration (phase = layer index within the
  // weight plan, or KV round); an advance() of a progressive switch carries weights and KV
  // together, so either arms it (phase within the advance's plan). undo: the first undo plan.
  enum class stage : uint8_t { weights, kv, undo } where = stage::weights;
  fault_point at;  // phase and op
};

// What recover() needs from the caller.
struct recovery_request {
  // The layout to come back in (a parallel_mode: its uniform layout). The KV that is intact in
  // the other view is moved to the attention's view (its per-layer plans or their exact
  // reverse); the experts are reloaded in the experts' layout.
  parallel_layout layout;
  // Writes every layer's experts on every rank where `cursor` (0: EP, L: TP) places them, from
  // the caller's source of truth (the checkpoint, or a host copy it keeps): no byte of the
  // arena is trusted after an inconsistent switch. Required. May throw: recover() then reports
  // the failure and may be called again. Runs after the KV moves recover() makes; on a device
  // transport it must first wait for the failed switch's copies (after a barrier timeout,
  // copies already queued on a rank still run: synchronize the devices).
  std::function<void(arena_cursor)> reload_experts;
};

struct recovery_report {
  bool recovered = false;      // consistent again, in `layout`, with the tables kv_tables() shows
  parallel_layout layout;
  arena_cursor cursor;         // where the arena rests (resting cursor of layout.experts)
  std::vector<int64_t> kept;   // sequences whose K/V was intact: in the tables, every byte
  std::vector<int64_t> lost;   // sequences whose K/V a layer lost: removed, their pages freed
  int64_t kv_plans_run = 0;    // per-layer KV plans (or reverses) that moved intact KV to `mode`
  std::string error;           // why not recovered; "" when recovered
  double total_ms = 0;
};

namespace detail {
struct switch_state;
}

class switcher {
 public:
  // `weights` and `kv` describe one rank's arena and KV pool (the transport's memory spaces
  // arena and kv_pool); `kv_tables` is the KV state now (its mode is the attention's layout),
  // and `cursor` where the arena rests now (0: EP experts, L: TP experts; any of the four
  // combinations). Throws errc::invalid_argument for a cursor that does not rest (0 < cursor <
  // L), or when the geometries' rank counts differ from the transport's.
  switcher(const arena_geometry& weights, const kv_geometry& kv, transport& t, kv_state kv_tables,
           arena_cursor cursor, switcher_options options = {});
  ~switcher();
  switcher(const switcher&) = delete;
  switcher& operator=(const switcher&) = delete;

  // The runtime selector: the layout the engine must run in now (meaningless once
  // consistent() is false). During a progressive switch: the layout it started from (its
  // session's step view says the layout of each layer).
  parallel_layout layout() const;
  // The attention's mode, layout().attention: the KV tables' mode. For the paper's layouts, the
  // mode.
  parallel_mode mode() const;
  arena_cursor cursor() const;
  const kv_state& kv_tables() const;
  // The KV pool's layout every plan is made over (switcher_options::kv_layout).
  const kv_pool_layout& kv_layout() const;
  // The TP view's KV-parallel degree (kv_geometry::dcp): the constructor's geometry's, until a
  // dcp change (plan_dcp) commits another. The tables are at this dcp when the attention is TP.
  int64_t dcp() const;
  // The engine adds and retires sequences between switches; the tables must stay valid. Every
  // call makes the plans made before it stale (the caller may change the tables).
  // Throws errc::invalid_argument while a progressive switch is open: its tables are frozen
  // (the session's step view gives read-only access to both sets).
  kv_state& mutable_kv_tables();

  // Plans a switch to `target` from today's tables and cursor with this switcher's own options
  // (switch/switch_plan.hpp): the capacity verdicts, the bytes per layer, the EP placement and
  // the weight and KV plans both switch styles run; moves nothing. A refusal is in the plan
  // (capacity.fits, layer_capacity.fits false), not thrown. A target whose attention layout is
  // today's plans no KV move (the identity migration: 0 rounds, fits); one whose experts'
  // layout is today's plans no weight phase, and no per-layer half (layer_capacity says why).
  // Throws errc::invalid_argument for a target that names neither EP nor TP in either half, or
  // when the KV tables are invalid.
  //   P=2, L=4, EP -> TP: start cursor 0, goal 4, weights 4 phases (layers 0, 1, 2, 3).
  //   P=2, L=4, TP attention with EP experts -> TP: cursor 0 -> 4, 4 weight phases, 0 KV rounds.
  switch_plan plan(parallel_layout target) const { return plan(target, plan_scope::both); }
  // The same, without the per-layer half when `scope` is stop_the_world (layer_kv null,
  // layer_capacity refused with a reason saying it was not planned): begin() refuses such a
  // plan. Throws errc::invalid_argument for a bad scope too.
  switch_plan plan(parallel_layout target, plan_scope scope) const;
  // Plans a change of the TP view's KV-parallel degree to `dcp` (kv_geometry::dcp): the KV
  // alone moves, TP(dcp a) -> TP(dcp b), in at most two rounds and without staging
  // (kv/dcp_change.hpp); the experts and the layout stay. Under EP attention nothing moves: the
  // plan commits the dcp the next switch to TP attention uses. switch_to(plan) runs it, stop
  // the world; begin(plan) refuses it (a progressive switch advances with the experts). A
  // target that cannot hold the live KV is refused in the plan (capacity.fits false, with the
  // rank and the numbers); after an inconsistent end recover() brings the KV back at the
  // source dcp. Throws errc::invalid_argument for a dcp the KV geometry does not allow
  // (with_dcp: it names the dcp), or when the KV tables are invalid.
  //   Qwen3 (H_kv=4, P=8) TP at dcp 1 -> plan_dcp(2): 0 rounds, 0 bytes (each rank drops
  //   the other share); plan_dcp(1) from there: 1 round, each rank receives the other share.
  switch_plan plan_dcp(int64_t dcp) const;
  // "" when `p` can run now; otherwise why it is stale: planned on another switcher, or before
  // the state moved on (a mutable_kv_tables() call, a switch, a recover(): named).
  std::string why_stale(const switch_plan& p) const;

  // Whether a switch to `target` would be accepted by the capacity check; moves nothing:
  // plan(target).capacity.
  kv_capacity_report check(parallel_layout target) const;

  // What each layer of a progressive switch to `target` would send per rank (the pacing input,
  // moebius/switch/pacing.hpp): plan(target).bytes_per_layer. Throws errc::capacity when the
  // target cannot hold the live KV (plan(target).layer_capacity refused).
  layer_bytes layer_bytes_of(parallel_layout target) const;

  // Switches everything as `p` says (see the failure protocol above), running `p`'s weight plan
  // and all-layers KV plan. Never throws once bytes may move: a transport error, a fault, a
  // verify mismatch or a throwing verify hook all end in the report. A plan whose capacity
  // refused gives the refused_capacity report, moving nothing. Throws errc::invalid_argument
  // for a stale plan (why_stale), when a progressive switch is open, or when the KV tables are
  // invalid (nothing moved).
  switch_report switch_to(const switch_plan& p);
  // switch_to(plan(target)); also throws errc::invalid_argument for a target that names neither
  // EP nor TP.
  switch_report switch_to(parallel_layout target);
  // switch_to(plan_dcp(dcp)); also throws as plan_dcp.
  switch_report switch_dcp(int64_t dcp);

  // Opens a progressive switch as `p` says (switch/progressive.hpp), running `p`'s weight plan
  // and one-layer KV plan; nothing moves. The session is open when its report's outcome is
  // in_progress; otherwise it says why not (already_there, refused_capacity when
  // p.layer_capacity refused, inconsistent, or rolled_back when the verify hook failed). Needs
  // one KV layer per MoE layer (each layer's weights and KV move together):
  // errc::invalid_argument otherwise, for a stale plan, when a session is already open, or for
  // a switch of the attention alone, a dcp change included (it advances with the experts'
  // layers: use switch_to).
  // The session must not outlive the switcher.
  progressive_switch begin(const switch_plan& p);
  // begin(plan(target)); also throws errc::invalid_argument for a bad target.
  progressive_switch begin(parallel_layout target);
  bool in_progress() const;

  // False after an `inconsistent` outcome: switch_to() and begin() then refuse, moving nothing,
  // until recover() succeeds.
  bool consistent() const;

  // After an `inconsistent` outcome: rebuilds a consistent state in request.layout without a
  // restart. Which KV is intact follows from how far the switch got: a layer whose KV plan
  // never started is intact in the source layout, one whose plan (or its undo) completed is
  // intact in the layout it reached, and one whose plan was running when the failure left the
  // bytes unknown (a barrier timeout, a device error, a failed undo) is not. When every layer
  // is intact the live sequences are kept (intact KV in the other layout is moved: the layer's
  // plan, or its exact reverse); otherwise every live sequence is lost (each needs every
  // layer) and the tables come back empty. Then reload_experts(resting cursor of mode), and
  // the switcher is consistent. A failed KV move loses the sequences instead; a throwing
  // reload_experts leaves the switcher inconsistent (report.error), and a later call retries
  // the reload (in the mode of the first attempt, whose KV is already rebuilt). Throws
  // errc::invalid_argument when the switcher is consistent, while a progressive switch is
  // open, for a bad layout, without reload_experts, or for a retry in another layout.
  //   P=2, EP->TP stop the world, the KV's undo failed: every sequence lost, EP tables empty.
  recovery_report recover(const recovery_request& request);
  // The report of the last switch that ended (either style).
  const switch_report& last_report() const;

  // Arms a one-shot fault for one stage of the next switch (tests of the failure protocol);
  // several calls arm several stages; std::nullopt disarms them all.
  void inject_fault(std::optional<switch_fault> fault);

 private:
  std::unique_ptr<detail::switch_state> state_;
};

}  // namespace moebius
