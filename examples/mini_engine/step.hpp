#pragma once

// The contract between the mini-engine's serving loop and its model runtimes (host and GPU):
// what one forward step is given and what it returns. The serving loop owns the requests,
// the KV page tables (through moebius::switcher) and the schedule; a runtime owns the model's
// weights (experts in the Moebius arena, the rest beside it) and computes.

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

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
// `tables`; each layer's MoE follows the cursor (layers below it TP, the rest EP). A static
// deployment has cursor 0 (EP) or L (TP) with tables of the same mode.
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

  static step_layout hybrid_of(const moebius::kv_state& tp, const moebius::kv_state& ep,
                               moebius::arena_cursor cursor) {
    step_layout l;
    l.cursor = cursor;
    l.tp_tables = &tp;
    l.ep_tables = &ep;
    return l;
  }
  // A hybrid step during a progressive switch: the session's view (both sets of tables, the
  // cursor). The view's tables live in the switcher and stay put until the switch ends.
  static step_layout during(const moebius::switch_step_view& v) {
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

// The next advance of a progressive switch, enqueued beside a step so that its copies run while
// the step computes (DESIGN.md §7, "Overlap"). The step runs at the cursor from before that
// advance: the layers it moves still run in the source mode, and its copies wait for the step's
// layer events where moebius::copy_waits says, so that they overwrite nothing the step still
// reads and carry the token the step writes.
struct copies_beside {
  // Called exactly once per step, after the step's work is enqueued and before the runtime
  // waits for it, with the step's layer events (moebius::step_layer_events: per layer and rank,
  // an event recorded after that layer on the stream it ran on); nullptr when the step has
  // already finished (nothing to wait for). The caller enqueues the advance here
  // (progressive_switch::advance(n, streams, events)).
  std::function<void(const moebius::step_layer_events* step_events)> enqueue;
  // Called when the step must run again after `enqueue` (the GPU runtime reruns a step whose
  // routing overflowed its graphs' expert capacity): the first pass's copies may already have
  // overwritten what it read, so the caller waits for the advance to settle and returns the
  // layout to rerun at (the cursor it reached, or the one it rolled back to). The rerun
  // writes every layer's K/V of the step's positions again.
  std::function<step_layout()> settle;
};

class runtime {
 public:
  virtual ~runtime() = default;

  // Runs one forward step of every item. Before the call the serving loop has already grown
  // each item's page tables (hybrid: both sets) to hold start_position + tokens.size() tokens; the step writes
  // the new tokens' K and V into those pages and attends over all of them. Returns, per item,
  // the greedy next token (-1 for items with sample == false). When `logits` is not null it
  // receives, per sampled item in order, the vocab-sized row of logits.
  virtual std::vector<int32_t> step(const step_layout& layout, std::span<const step_item> items,
                                    std::vector<std::vector<float>>* logits = nullptr) = 0;

  // Seconds the last step() took as the runtime measured it itself (the GPU runtime: CUDA
  // events around the step on every rank's stream, the longest rank), or < 0 when it does
  // not measure: the serving loop then times step() on the host.
  virtual double measured_step_s() const { return -1; }

  // step() with the next advance of a progressive switch beside it (copies_beside). By default
  // the step runs to its end and then `copies.enqueue(nullptr)` is called: the copies run after
  // the step (the host runtime, whose copies and steps share one CPU). A runtime that runs the
  // copies on the device beside the step overrides this and says so in overlaps_copies().
  virtual std::vector<int32_t> step_beside(const step_layout& layout,
                                           std::span<const step_item> items,
                                           const copies_beside& copies,
                                           std::vector<std::vector<float>>* logits = nullptr) {
    std::vector<int32_t> tokens = step(layout, items, logits);
    copies.enqueue(nullptr);
    return tokens;
  }
  virtual bool overlaps_copies() const { return false; }
  // Token ids a step accepts: [0, vocab_size()); 0 when the runtime does not say (the serving
  // loop then cannot refuse a bad id at admission, and the step refuses it when it runs).
  virtual int64_t vocab_size() const { return 0; }
};

}  // namespace mini_engine
