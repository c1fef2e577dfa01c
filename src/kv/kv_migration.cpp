// Entry points of the KV migration planner; the directions live in ep_to_tp.cpp and
// tp_to_ep.cpp, the rounds they share in round_scheduler.hpp.

#include "moebius/kv/kv_migration.hpp"

#include <algorithm>
#include <ostream>
#include <utility>

#include "migration_directions.hpp"
#include "moebius/detail/enum_check.hpp"
#include "moebius/error.hpp"

namespace moebius {

namespace kv_detail {

int64_t staging_slots(const kv_geometry& g, const kv_migration_options& opt, parallel_mode m) {
  MOEBIUS_CHECK(opt.staging.bytes >= 0 && opt.staging.offset >= 0, errc::invalid_argument,
                "staging region needs offset >= 0 and bytes >= 0 (offset=", opt.staging.offset,
                ", bytes=", opt.staging.bytes, ")");
  MOEBIUS_CHECK(opt.staging.bytes == 0 || opt.staging.space != memory_space::kv_pool,
                errc::invalid_argument,
                "staging must be outside the kv_pool (it would overlap live pages)");
  const int64_t slot = kv_staging_slot_bytes(g, m);
  return slot == 0 ? 0 : opt.staging.bytes / slot;
}

namespace {

outcome run(const kv_geometry& g, const kv_pool_layout& layout, const kv_state& s,
            parallel_mode target, const kv_migration_options& opt) {
  detail::check_enum(target, "target (parallel_mode)");
  validate(g, s);
  validate(g, layout);
  MOEBIUS_CHECK(opt.max_rounds >= 1, errc::invalid_argument,
                "max_rounds must be >= 1 (max_rounds=", opt.max_rounds, ")");
  if (s.mode == target) {
    outcome out;
    out.result.copies.num_ranks = g.num_ranks;
    out.result.new_state = s;
    out.pages_available = g.num_pages(target);
    for (int r = 0; r < g.num_ranks; ++r)
      out.pages_needed = std::max(out.pages_needed, used_pages(g, s, r));
    return out;
  }
  return target == parallel_mode::tp ? plan_ep_to_tp(g, layout, s, opt)
                                      : plan_tp_to_ep(g, layout, s, opt);
}

}  // namespace
}  // namespace kv_detail

int64_t kv_staging_slot_bytes(const kv_geometry& g, parallel_mode target) {
  return g.num_tensors() * g.page_bytes(target);
}

kv_capacity_report check_kv_capacity(const kv_geometry& g, const kv_state& s,
                                     parallel_mode target, const kv_migration_options& opt) {
  return check_kv_capacity(g, present_kv_layout(g), s, target, opt);
}

namespace kv_detail {

kv_capacity_report capacity_of(const outcome& o) {
  kv_capacity_report rep;
  rep.fits = o.ok;
  rep.holds = o.holds;
  rep.rounds = o.ok ? o.result.stats.rounds : 0;
  rep.pages_needed = o.pages_needed;
  rep.pages_available = o.pages_available;
  rep.reason = o.reason;
  return rep;
}

kv_migration_attempt attempt_of(outcome o) {
  kv_migration_attempt a;
  a.capacity = capacity_of(o);
  if (o.ok) a.migration = std::move(o.result);
  return a;
}

}  // namespace kv_detail

kv_capacity_report check_kv_capacity(const kv_geometry& g, const kv_pool_layout& layout,
                                     const kv_state& s, parallel_mode target,
                                     const kv_migration_options& opt) {
  return kv_detail::capacity_of(kv_detail::run(g, layout, s, target, opt));
}

kv_migration_attempt try_plan_kv_migration(const kv_geometry& g, const kv_state& s,
                                           parallel_mode target,
                                           const kv_migration_options& opt) {
  return try_plan_kv_migration(g, present_kv_layout(g), s, target, opt);
}

kv_migration_attempt try_plan_kv_migration(const kv_geometry& g, const kv_pool_layout& layout,
                                           const kv_state& s, parallel_mode target,
                                           const kv_migration_options& opt) {
  return kv_detail::attempt_of(kv_detail::run(g, layout, s, target, opt));
}

kv_migration plan_kv_migration(const kv_geometry& g, const kv_state& s, parallel_mode target,
                               const kv_migration_options& opt) {
  return plan_kv_migration(g, present_kv_layout(g), s, target, opt);
}

kv_migration plan_kv_migration(const kv_geometry& g, const kv_pool_layout& layout,
                               const kv_state& s, parallel_mode target,
                               const kv_migration_options& opt) {
  kv_detail::outcome o = kv_detail::run(g, layout, s, target, opt);
  MOEBIUS_CHECK(o.ok, errc::capacity, "KV migration ", to_string(s.mode), "->",
                to_string(target), " impossible: ", o.reason);
  return std::move(o.result);
}

std::ostream& operator<<(std::ostream& os, const kv_migration_stats& s) {
  return os << "rounds=" << s.rounds << " pages_moved=" << s.pages_moved
            << " in_place=" << s.pages_in_place << " staged=" << s.pages_staged
            << " compacted=" << s.pages_compacted << " bytes=" << s.bytes_copied
            << " imbalance=" << s.imbalance;
}

}  // namespace moebius
