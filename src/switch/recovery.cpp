// Recovery after an inconsistent switch (switcher::recover, switcher.hpp): which layers' KV the
// wreck's log (transaction.hpp, wreck_log) says is intact and where, the moves that bring it to
// the layout asked for, the tables rebuilt, the experts reloaded by the caller.

#include <algorithm>
#include <optional>
#include <utility>

#include "moebius/detail/nvtx.hpp"
#include "moebius/error.hpp"
#include "moebius/plan/rollback.hpp"
#include "transaction.hpp"

namespace moebius::detail {

switch_transaction::kv_at switch_transaction::kv_of_unit(size_t u) const {
  const unit& un = units_[u];
  if (wreck_.undo_failed_unit >= 0 && static_cast<int64_t>(u) >= wreck_.undo_failed_unit) {
    // Undone (later units), or the unit whose undo failed: its KV is back in the source layout
    // unless the KV's own undo was what failed (then partly reversed: unknown).
    if (static_cast<int64_t>(u) > wreck_.undo_failed_unit) return kv_at::source;
    return wreck_.undo_failed_in_kv ? kv_at::unknown : kv_at::source;
  }
  const int64_t kv_first = un.first_phase + un.weight_phases();
  const int64_t kv_end = un.first_phase + un.phases();
  if (wreck_.unknown_first >= 0 && wreck_.unknown_first < kv_end && kv_first < wreck_.unknown_end) {
    return kv_at::unknown;  // some of its KV rounds may have run past what was reported
  }
  if (phases_done_ >= kv_end) return kv_at::target;
  if (phases_done_ <= kv_first) return kv_at::source;
  return kv_at::unknown;  // partly moved and not undone
}

void switch_transaction::rebuild_kv(parallel_layout layout) {
  const parallel_mode mode = layout.attention;  // the KV's view
  const parallel_mode source = st_.kv.mode;
  std::vector<int64_t> live;  // every live sequence of the source tables
  for (const kv_rank_state& r : st_.kv.ranks)
    for (const kv_sequence& q : r.sequences) live.push_back(q.seq_id);
  std::sort(live.begin(), live.end());
  live.erase(std::unique(live.begin(), live.end()), live.end());

  // Every sequence needs every layer: one unknown layer loses them all.
  bool intact = true;
  for (size_t u = 0; u < units_.size() && intact; ++u)
    intact = units_[u].kv_rounds == 0 || kv_of_unit(u) != kv_at::unknown;
  if (intact) {
    // Move each layer intact in the other layout to `mode`: the unit's KV plan, or its exact
    // reverse. Each touches only its layer's KV and the arena slot it stages through (the
    // arena is reloaded afterwards).
    try {
      for (size_t u = 0; u < units_.size(); ++u) {
        if (units_[u].kv_rounds == 0) continue;
        const kv_at at = kv_of_unit(u);
        const bool in_source = at == kv_at::source;
        if (in_source == (mode == source)) continue;
        const std::shared_ptr<const plan> p = kv_plan_of(u);
        st_.mover.execute(in_source ? *p : rollback_plan(*p, units_[u].kv_rounds));
        ++recovered_.plans_run;
      }
    } catch (const std::exception&) {
      st_.mover.inject_fault(std::nullopt);
      intact = false;  // the move failed part-way: that layer is not intact any more
    }
  }
  if (intact) {
    recovered_.tables = mode == source ? st_.kv : target_tables_;
    recovered_.kept = live;
  } else {
    recovered_.tables = kv_state{};
    recovered_.tables.mode = mode;
    recovered_.tables.ranks.resize(static_cast<size_t>(st_.kv_geom.num_ranks));
    for (kv_rank_state& r : recovered_.tables.ranks) {
      for (int64_t p = 0; p < st_.kv_geom.num_pages(mode); ++p) r.free_pages.push_back(p);
    }
    recovered_.lost = live;
  }
  recovered_.layout = layout;
  recovered_.settled = true;
}

recovery_report switch_transaction::recover(const recovery_request& request) {
  const auto t0 = clock_type::now();
  MOEBIUS_CHECK(!recovered_.settled || recovered_.layout == request.layout,
                errc::invalid_argument, "recover: an earlier attempt rebuilt the KV in ",
                to_string(recovered_.layout), "; recover in ", to_string(recovered_.layout),
                " (asked ", to_string(request.layout), ")");
  // The KV has a plan into the views the switch moved between, and no other.
  MOEBIUS_CHECK(request.layout.attention == st_.kv.mode ||
                    request.layout.attention == target_.attention,
                errc::invalid_argument, "recover: the switch moved the KV between ",
                to_string(st_.kv.mode), " and ", to_string(target_.attention),
                " attention; it cannot come back with ", to_string(request.layout.attention),
                " attention");
  const nvtx_range range("moebius/switch/recover");
  st_.faults.clear();
  st_.mover.inject_fault(std::nullopt);
  if (!recovered_.settled) rebuild_kv(request.layout);
  recovery_report r;
  r.layout = request.layout;
  r.kept = recovered_.kept;
  r.lost = recovered_.lost;
  r.kv_plans_run = recovered_.plans_run;
  const arena_cursor resting = st_.resting(request.layout.experts);
  try {
    request.reload_experts(resting);
  } catch (const std::exception& e) {
    r.error = std::string("recover: reload_experts failed: ") + e.what();
    r.cursor = st_.cursor;
    r.total_ms = ms_between(t0, clock_type::now());
    return r;
  }
  validate(st_.kv_geom, recovered_.tables);
  st_.kv = std::move(recovered_.tables);
  st_.cursor = resting;
  st_.consistent = true;
  st_.inconsistency.clear();
  r.recovered = true;
  r.cursor = resting;
  r.total_ms = ms_between(t0, clock_type::now());
  return r;
}

}  // namespace moebius::detail
