#pragma once

// The contract between the mini-engine's serving loop and its model runtimes (host and GPU):
// what one forward step is given and what it returns. The serving loop owns the requests,
// the KV page tables (through moebius::switcher) and the schedule; a runtime owns the model's
// weights (experts in the Moebius arena, the rest beside it) and computes.

#include <cstdint>
#include <span>
#include <vector>

#include <moebius/error.hpp>
#include <moebius/kv/page_table.hpp>
#include <moebius/layout/arena_geometry.hpp>
#include <moebius/switch/progressive.hpp>

namespace mini_engine {

// One sequence's work in one step.
struct step_item {
  int64_t seq_id = 0;               // the seq_id of its kv_sequence in the page tables
  std::span<const int32_t> tokens;  // new tokens: a prefill chunk, or the one decode token
  int64_t start_position = 0;       // tokens of this sequence already in the KV cache
  bool sample = false;              // return the next token (last prefill chunk, or decode)
};

// Where the model's layers are: the page tables and the arena cursor.
//
// Static (tables set, tp_tables/ep_tables null): every layer's attention runs in the mode of
// `tables` (TP: over the tables' geometry's KV-parallel degree, kv_geometry::dcp); each layer's
// MoE follows the cursor (layers below it TP, the rest EP). A static layout may rest at any
// cursor with either table mode: attention by the tables, experts by the cursor.
//   EP tables, cursor 0: data-parallel attention, EP experts;  TP tables, cursor L: all TP;
//   TP tables, cursor 0: TP attention, EP experts;  EP tables, cursor L: data-parallel
//   attention, TP experts;  any cursor in between: the first layers' experts TP, the rest EP.
// (A moebius::switcher starts from and commits only cursor 0 with EP tables or L with TP
// tables; the mixed layouts are static deployments it does not switch.)
//
// Hybrid (tp_tables and ep_tables both set; `tables` ignored): a progressive switch is in
// progress (moebius::progressive_switch, built from its view() by during()). Layer l runs
// wholly in one mode, TP iff l < cursor: its attention with that mode's tables and head
// split, its MoE with that mode's arena view. Where the mode changes between two layers the
// activations are handed off: TP -> EP (data-parallel attention) each rank keeps its own
// sequences' rows (the EP owner in ep_tables); EP -> TP an all-gather of every owner's rows.
//   L=4, cursor 1: layer 0 TP (tp_tables), hand-off, layers 1..3 EP (ep_tables).
// A runtime that cannot run hybrid steps must refuse them (check hybrid()).
struct step_layout {
  const moebius::kv_state* tables = nullptr;
  moebius::arena_cursor cursor;
  const moebius::kv_state* tp_tables = nullptr;
  const moebius::kv_state* ep_tables = nullptr;
  // The TP tables' KV-parallel degree (kv_geometry::dcp: switcher::dcp() after a dcp change);
  // 0: the runtime's own. The host runtime follows it from this step on; the GPU runtime
  // follows any of the dcp it captured graphs for (gpu_runtime_options::serve_dcps) and refuses
  // another by name.
  int64_t dcp = 0;

  static step_layout hybrid_of(const moebius::kv_state& tp, const moebius::kv_state& ep,
                               moebius::arena_cursor cursor) {
    step_layout l;
    l.cursor = cursor;
    l.tp_tables = &tp;
    l.ep_tables = &ep;
    return l;
  }
  // A step during a progressive switch: the session's view. When the switch moves the KV, a
  // hybrid step (both sets of tables, the cursor); when it moves the experts alone, a static
  // one: every layer's attention over the one set of tables, each layer's MoE by the cursor.
  // The view's tables live in the switcher and stay put until the switch ends.
  static step_layout during(const moebius::switch_step_view& v) {
    if (!v.moves_kv()) {
      step_layout l;
      l.tables = &v.tables(v.source());
      l.cursor = v.cursor();
      return l;
    }
    return hybrid_of(v.tables(moebius::parallel_mode::tp), v.tables(moebius::parallel_mode::ep),
                     v.cursor());
  }
  bool hybrid() const { return tp_tables != nullptr && ep_tables != nullptr; }
  // The mode of layer `layer`'s attention (hybrid: also of its MoE).
  moebius::parallel_mode attention_mode(int64_t layer) const {
    if (!hybrid()) return tables->mode;
    return moebius::arena_geometry::mode_of(cursor, layer);
  }
  // The tables layer `layer`'s attention reads.
  const moebius::kv_state& tables_of_layer(int64_t layer) const {
    if (!hybrid()) return *tables;
    return attention_mode(layer) == moebius::parallel_mode::tp ? *tp_tables : *ep_tables;
  }
};

// What a step is asked to do beyond its items.
struct step_options {
  // Record, after each layer on every rank's stream, the event moebius::step_layer_events
  // holds: a progressive switch's next advance will be enqueued beside this step and its
  // copies wait for them (DESIGN.md §7, "Overlap").
  bool layer_events = false;
  // The eager rerun of a step whose routing overflowed (step_result::overflowed): it writes
  // every layer's K/V of the step's positions again and is timed from the first pass's start.
  bool rerun = false;
  // When not null, receives per sampled item in order the vocab-sized row of logits.
  std::vector<std::vector<float>>* logits = nullptr;
};

// A step the runtime has enqueued and not yet finished (runtime::enqueue). Its items (and the
// tables its layout points to) must stay alive until runtime::finish.
struct pending_step {
  // Per layer and rank, an event recorded after that layer on the stream it ran on, when the
  // step was asked for them (step_options::layer_events) and has layer boundaries to give:
  // copies enqueued beside it wait on these (moebius::copy_waits). Null when the step has
  // already run to its end (a runtime that computes at enqueue: the host runtime) or runs as
  // one piece (a static layout on the GPU: one whole-model graph): copies must then follow
  // runtime::finish.
  const moebius::step_layer_events* layer_events = nullptr;
  int64_t serial = 0;  // the runtime's count of enqueued steps: finish() checks it
};

// What a finished step gave.
struct step_result {
  // Per item, the greedy next token (-1 where sample is false); empty when overflowed.
  std::vector<int32_t> tokens;
  // The routing overflowed the expert capacity the step's graphs were captured with (the GPU
  // runtime: 1.25x the balanced load): its outputs are incomplete. The caller runs it again
  // (step_options::rerun), at the layout the switch beside it has settled at, if any: the
  // first pass's copies may have overwritten what it read. Only runtimes with graphs do this.
  bool overflowed = false;
  // Seconds the step took as the runtime measured it itself (the GPU runtime: CUDA events on
  // every rank's stream, the longest rank; a rerun: both passes), or < 0: the serving loop
  // then times it on the host.
  double measured_s = -1;
};

// A model runtime: one step at a time, in two phases so that the caller can put work beside
// it (a progressive switch's copies). The caller orders everything; a runtime never calls back:
//
//   pending_step p = rt.enqueue(layout, items, {.layer_events = true});
//   session.advance(n, {}, p.layer_events);    // copies beside the step (or after finish
//   step_result r = rt.finish(p);              //   when p.layer_events is null)
//   if (r.overflowed) { session.wait(); r = rt.finish(p = rt.enqueue(again, items, {.rerun = true})); }
class runtime {
 public:
  virtual ~runtime() = default;

  // Enqueues one forward step of every item and returns before it has finished where the
  // runtime can (the GPU runtime; the host runtime computes here). Before the call the caller
  // has grown each item's page tables (hybrid: both sets) to hold start_position +
  // tokens.size() tokens; the step writes the new tokens' K and V into those pages and attends
  // over all of them. One step at a time: finish() it before the next enqueue(). Throws
  // moebius::error (errc::invalid_argument) on items or a layout the runtime cannot run, and
  // errc::internal when a step is still pending; nothing is enqueued then.
  virtual pending_step enqueue(const step_layout& layout, std::span<const step_item> items,
                               const step_options& options = {}) = 0;
  // Waits for the step `p` and returns what it gave. Throws errc::invalid_argument when `p`
  // is not the pending step.
  virtual step_result finish(const pending_step& p) = 0;

  // enqueue() and finish(), and the rerun when the routing overflowed (at the same layout:
  // nothing runs beside it): the tokens per item. For callers with nothing to put beside.
  std::vector<int32_t> step(const step_layout& layout, std::span<const step_item> items,
                            std::vector<std::vector<float>>* logits = nullptr) {
    step_options o;
    o.logits = logits;
    step_result r = finish(enqueue(layout, items, o));
    if (r.overflowed) {
      o.rerun = true;
      r = finish(enqueue(layout, items, o));
    }
    last_measured_s_ = r.measured_s;
    return std::move(r.tokens);
  }
  // measured_s of the last step() (< 0 before one, or when the runtime does not measure).
  double measured_step_s() const { return last_measured_s_; }

  // Whether copies enqueued beside a step run while it computes (the GPU runtime, on copy
  // streams), rather than after it (the host runtime: steps and copies share one CPU).
  virtual bool overlaps_copies() const { return false; }
  // Token ids a step accepts: [0, vocab_size()); 0 when the runtime does not say (the serving
  // loop then cannot refuse a bad id at admission, and the step refuses it when it runs).
  virtual int64_t vocab_size() const { return 0; }

 private:
  double last_measured_s_ = -1;
};

// A runtime that computes a whole step when it is enqueued (on the host: nothing to overlap).
// Implementers write compute(); pending steps carry no layer events and never overflow.
class synchronous_runtime : public runtime {
 public:
  pending_step enqueue(const step_layout& layout, std::span<const step_item> items,
                       const step_options& options = {}) final {
    MOEBIUS_CHECK(!pending_, moebius::errc::internal,
                  "runtime::enqueue: step ", serial_, " is still pending (finish it first)");
    tokens_ = compute(layout, items, options.logits);
    pending_ = true;
    return pending_step{nullptr, ++serial_};
  }
  step_result finish(const pending_step& p) final {
    MOEBIUS_CHECK(pending_ && p.serial == serial_, moebius::errc::invalid_argument,
                  "runtime::finish: step ", p.serial, " is not the pending step (", serial_,
                  pending_ ? ")" : ", finished)");
    pending_ = false;
    step_result r;
    r.tokens = std::move(tokens_);
    return r;
  }

 protected:
  // Runs one step to its end (runtime::enqueue's contract) and returns the tokens per item.
  virtual std::vector<int32_t> compute(const step_layout& layout, std::span<const step_item> items,
                                       std::vector<std::vector<float>>* logits) = 0;

 private:
  std::vector<int32_t> tokens_;
  bool pending_ = false;
  int64_t serial_ = 0;
};

}  // namespace mini_engine
