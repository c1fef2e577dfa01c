#pragma once

// What a switcher is beyond its geometry (switcher.hpp): the tables and the cursor, whether they
// are consistent, the open progressive switch, the wreck of an inconsistent one, the last
// report, the armed faults and the state generation that plans are stamped with
// (switch_plan.hpp). The switcher owns it; the transaction that changes it (transaction.hpp),
// the recovery that rebuilds it (recovery.cpp) and the session that closes a progressive switch
// (progressive.cpp) are lent it by reference.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "moebius/kv/kv_pool_layout.hpp"
#include "moebius/kv/page_table.hpp"
#include "moebius/detail/enum_check.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/layout/parallel_layout.hpp"
#include "moebius/switch/switch_report.hpp"
#include "moebius/switch/switcher.hpp"
#include "moebius/transport/transport.hpp"

namespace moebius::detail {

class switch_transaction;

// check_enum for both halves of a layout a caller hands in.
inline void check_layout(parallel_layout l, const std::string& what) {
  check_enum(l.attention, (what + " attention (parallel_mode)").c_str());
  check_enum(l.experts, (what + " experts (parallel_mode)").c_str());
}

struct switch_state {
  switch_state(const arena_geometry& weights, const kv_geometry& kv, transport& t,
               kv_state kv_tables, arena_cursor cursor, switcher_options options);
  ~switch_state();
  switch_state(const switch_state&) = delete;
  switch_state& operator=(const switch_state&) = delete;

  const arena_geometry weights;
  kv_geometry kv_geom;  // the pool's; its dcp changes when a dcp change commits
  const kv_pool_layout kv_layout;  // switcher_options::kv_layout, or the present layout
  transport& mover;  // moves the bytes: the transport of every plan
  const switcher_options options;
  const uint64_t id;  // switch_plan_origin::switcher_id

  kv_state kv;          // the tables; kv.mode is the mode (the runtime selector)
  arena_cursor cursor;  // where the arena rests
  std::vector<switch_fault> faults;  // armed for the next switch
  bool consistent = true;
  std::string inconsistency;  // why not consistent
  const switch_transaction* open = nullptr;  // the open progressive switch
  // The transaction that ended inconsistent (what recover() rebuilds from).
  std::unique_ptr<switch_transaction> wreck;
  switch_report last_report;  // of the last switch that ended
  // Moves on with everything that may change what a plan assumed (switch_plan.hpp); `change`
  // says what moved it last, for the message that refuses a stale plan.
  uint64_t generation = 0;
  std::string change;

  void move_on(std::string why) {
    ++generation;
    change = std::move(why);
  }
  // Cursor 0 for EP experts, L for TP.
  arena_cursor resting(parallel_mode m) const {
    return arena_cursor{m == parallel_mode::tp ? weights.shape.num_layers : 0};
  }
  // The layout at rest: the attention's is the tables' mode, the experts' the cursor's.
  parallel_layout layout() const {
    return {kv.mode, cursor == resting(parallel_mode::tp) && weights.shape.num_layers > 0
                         ? parallel_mode::tp
                         : parallel_mode::ep};
  }
  // The KV planner's options for a switch to `target` with the weights at `weights_at` (staging
  // in its free slot when the options lend it), placing TP->EP sequences by `placement` (null:
  // longest-first in the planner).
  kv_migration_options kv_options(arena_cursor weights_at, const kv_placement* placement) const;
};

}  // namespace moebius::detail
