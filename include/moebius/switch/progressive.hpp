#pragma once

// A progressive switch (DESIGN.md §7): the arena cursor advances a few layers per decode step,
// each layer's weights and then that layer's KV, while the engine keeps decoding with hybrid
// steps. switcher::begin(plan) opens it (begin(target): plan, then begin) and returns this
// move-only session:
//
//   const switch_plan p = sw.plan(parallel_mode::tp);       // moves nothing
//   progressive_switch s = sw.begin(p);                      // runs exactly p
//   int64_t n = layers_per_step({step_s, link, 0.55, s.bytes_per_layer().busiest()});
//   while (s.layers_remaining() > 0) {
//     const layer_completion& c = s.advance(n, copy_streams);  // enqueues, never waits
//     step(s.view(), c);        // waits on c.event(l, r) only before a layer l it reads
//     if (s.poll() == progress_state::ended) break;            // failed: rolled back
//     // ... or, with nothing else to do before the next advance: s.wait()
//   }
//   switch_report r = s.finish();   // waits, verifies, commits (or rolls back)
//
// While it is open, layer l's experts run TP when l < view().cursor() and EP otherwise (one
// rule, arena_geometry::mode_of). Its attention moves with them when the switch moves the KV
// (the paper's switch: the layer's attention in the same mode, with the page tables of that
// mode: both sets coexist, read-only), and stays in its one layout when the switch moves the
// experts alone (view().moves_kv() false: one set of tables).
// The tables are frozen from begin() to finish(): a sequence may fill the tokens its tables
// already hold (reserve them before begin()), new sequences wait for finish(), and the
// switcher refuses mutable access meanwhile. Layers of an outstanding advance are in flight:
// order the step's reads and KV writes of those layers after their events (or wait() for the
// advance before the step). A failure anywhere follows the switcher's failure protocol
// (switcher.hpp): everything is put back (rolled_back) or the switcher is inconsistent.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "moebius/kv/page_table.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/layout/parallel_layout.hpp"
#include "moebius/switch/pacing.hpp"
#include "moebius/switch/switch_report.hpp"
#include "moebius/transport/transport.hpp"

namespace moebius {

class switcher;
namespace detail {
class switch_transaction;
struct switch_state;
}

// The layers one advance() enqueued and, per layer and local rank, the event that fires once
// that layer's weights and KV are in place on that rank (transport::phase_event: CUDA events
// on the GPU transports; nullptr, already complete, on the host transport). Valid until the
// next advance().
class layer_completion {
 public:
  // The layers in the order they move (EP->TP ascending, TP->EP descending).
  std::span<const int64_t> layers() const { return layers_; }
  bool contains(int64_t layer) const;
  // Throws errc::out_of_range for a layer this advance did not enqueue or a bad local rank.
  event_handle event(int64_t layer, size_t local_index) const;

 private:
  friend class detail::switch_transaction;
  std::vector<int64_t> layers_;
  std::vector<event_handle> events_;  // [index in layers_ * num_local_ + local rank]
  size_t num_local_ = 0;
};

// The events a decode step recorded after each of its layers on each local rank (the S_l of
// switch/overlap.hpp). An advance enqueued beside that step waits for them where copy_waits()
// says, so its copies start while the step still computes and overwrite nothing it reads.
class step_layer_events {
 public:
  step_layer_events(int64_t num_layers, size_t num_local);
  int64_t num_layers() const { return num_layers_; }
  size_t num_local() const { return num_local_; }
  // Throws errc::out_of_range for a layer or local rank outside the set.
  void set(int64_t layer, size_t local_index, event_handle e);
  event_handle get(int64_t layer, size_t local_index) const;

 private:
  int64_t num_layers_ = 0;
  size_t num_local_ = 0;
  std::vector<event_handle> events_;  // [layer * num_local_ + local rank]
};

// What a step reads during the switch: the layout of each layer, the page tables (both sets
// when the KV moves) and the cursor (layers whose copies are known complete: the cursor moves
// in poll()).
class switch_step_view {
 public:
  arena_cursor cursor() const { return cursor_; }
  // Whether the switch moves the KV (the attention's layout changes with the experts'); false:
  // the experts alone move and every layer's attention reads the one set of tables.
  bool moves_kv() const { return source() != target(); }
  // The attention's modes before and after the switch (the same when !moves_kv()).
  parallel_mode source() const { return source_->mode; }
  parallel_mode target() const { return target_->mode; }
  // The experts' mode of layer `layer` (the arena's: TP below the cursor).
  parallel_mode mode_of(int64_t layer) const { return arena_geometry::mode_of(cursor_, layer); }
  // Layer `layer`'s attention: with its experts when the KV moves, else where it rests.
  parallel_mode attention_of(int64_t layer) const {
    return moves_kv() ? mode_of(layer) : source();
  }
  parallel_layout layout_of(int64_t layer) const { return {attention_of(layer), mode_of(layer)}; }
  // The tables attention of mode `m` reads (`m` is the source's or the target's mode).
  const kv_state& tables(parallel_mode m) const { return m == target() ? *target_ : *source_; }
  const kv_state& tables_of_layer(int64_t layer) const { return tables(attention_of(layer)); }

 private:
  friend class detail::switch_transaction;
  arena_cursor cursor_;
  const kv_state* source_ = nullptr;
  const kv_state* target_ = nullptr;
};

// What poll() found.
enum class progress_state : uint8_t {
  in_flight,  // the last advance's copies are still running
  ready,      // no advance outstanding: the cursor is past every enqueued layer
  ended,      // the switch ended: a failed advance was rolled back, or left the switcher
              // inconsistent (report().outcome says which); the session is closed
};

const char* to_string(progress_state s);

class progressive_switch {
 public:
  progressive_switch(progressive_switch&&) noexcept;
  progressive_switch& operator=(progressive_switch&&) noexcept;
  progressive_switch(const progressive_switch&) = delete;
  progressive_switch& operator=(const progressive_switch&) = delete;
  // An open session that is destroyed aborts (waits for its copies, puts every moved layer
  // back); the outcome is the switcher's last_report().
  ~progressive_switch();

  // Begun and not yet ended (finish, abort, or a failed advance).
  bool open() const { return txn_ != nullptr; }
  // The switch so far; once it ended, how it ended.
  const switch_report& report() const;

  // Layers not yet enqueued by advance() (0 once ended).
  int64_t layers_remaining() const;
  // The pacing input: what each layer sends per rank (every layer moves alike), planned with
  // the switcher's own options from the frozen tables. Throws errc::invalid_argument once the
  // session has ended.
  const layer_bytes& bytes_per_layer() const;
  // Read-only view for the step (see above). Throws errc::invalid_argument once ended.
  switch_step_view view() const;

  // Enqueues the next min(layers, layers_remaining()) layers on `streams` (one per local rank
  // of the transport, or empty: see transport::enqueue) and returns without waiting. `beside`:
  // the layer events of a step that runs at view().cursor() while these copies run (the
  // copies wait for them, switch/overlap.hpp); null when no step overlaps. Throws
  // errc::invalid_argument when the session has ended, an advance is still in flight (poll()
  // until ready first), layers < 1, or `beside` does not have one event per layer and local
  // rank; nothing was enqueued then.
  const layer_completion& advance(int64_t layers, std::span<const stream_handle> streams = {},
                                  const step_layer_events* beside = nullptr);
  // Never blocks. When the outstanding advance has just finished, the cursor moves past its
  // layers (ready); when it failed, the switch is undone and the session ends (ended).
  progress_state poll();
  // Blocks until the outstanding advance has finished (ready: the cursor is past its layers)
  // or failed (ended: undone, as poll() would find it). Without one outstanding, returns at
  // once what poll() would; on an ended session, ended.
  progress_state wait();
  // Advances every remaining layer, waits, verifies and commits (or rolls back); ends the
  // session. On an ended session returns its report.
  switch_report finish();
  // Waits for an outstanding advance, then undoes every moved layer (last first); ends the
  // session. On an ended session returns its report.
  switch_report abort();

 private:
  friend class switcher;  // opens sessions (begin)
  progressive_switch(detail::switch_state& owner, std::unique_ptr<detail::switch_transaction> txn,
                     switch_report report);
  void close();  // hands the ended transaction's report to the switcher

  detail::switch_state* owner_ = nullptr;  // the switcher's state
  std::unique_ptr<detail::switch_transaction> txn_;
  switch_report report_;  // a session that never opened, or has ended
};

}  // namespace moebius
