#include "moebius/switch/switch_stats.hpp"

#include <numeric>

namespace moebius {

namespace {

int64_t sum_of(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

}  // namespace

switch_stats stats_of(const switch_report& r) {
  switch_stats s;
  auto at = [&](switch_stage st) -> switch_stage_stats& { return s.stages[static_cast<int>(st)]; };
  at(switch_stage::capacity).ms = r.capacity_ms;
  at(switch_stage::plan).ms = r.plan_ms;
  at(switch_stage::weights) = {sum_of(r.weight_bytes_sent), r.weights_ms};
  at(switch_stage::kv) = {sum_of(r.kv_bytes_sent), r.kv_ms};
  at(switch_stage::verify).ms = r.verify_ms;
  at(switch_stage::undo).ms = r.undo_ms;
  s.total_ms = r.total_ms;
  return s;
}

void for_each_metric(const switch_report& r,
                     const std::function<void(std::string_view name, double value)>& fn) {
  // Literal names, so that an exporter may keep the string_view.
  static constexpr const char* bytes_names[num_switch_stages] = {
      "moebius_switch_capacity_bytes", "moebius_switch_plan_bytes",
      "moebius_switch_weights_bytes",  "moebius_switch_kv_bytes",
      "moebius_switch_verify_bytes",   "moebius_switch_undo_bytes"};
  static constexpr const char* ms_names[num_switch_stages] = {
      "moebius_switch_capacity_ms", "moebius_switch_plan_ms",   "moebius_switch_weights_ms",
      "moebius_switch_kv_ms",       "moebius_switch_verify_ms", "moebius_switch_undo_ms"};
  const switch_stats s = stats_of(r);
  for (int i = 0; i < num_switch_stages; ++i) {
    fn(bytes_names[i], static_cast<double>(s.stages[i].bytes));
    fn(ms_names[i], s.stages[i].ms);
  }
  fn("moebius_switch_total_ms", s.total_ms);
  fn("moebius_switch_weight_phases", static_cast<double>(r.weight_phases));
  fn("moebius_switch_kv_rounds", static_cast<double>(r.kv_rounds));
  fn("moebius_switch_committed", r.outcome == switch_outcome::committed ? 1.0 : 0.0);
  fn("moebius_switch_rolled_back", r.outcome == switch_outcome::rolled_back ? 1.0 : 0.0);
  fn("moebius_switch_inconsistent", r.outcome == switch_outcome::inconsistent ? 1.0 : 0.0);
  fn("moebius_switch_weight_phases_completed", static_cast<double>(r.weight_phases_completed));
  fn("moebius_switch_kv_rounds_completed", static_cast<double>(r.kv_rounds_completed));
  fn("moebius_switch_kv_pages_moved", static_cast<double>(r.kv_stats.pages_moved));
  fn("moebius_switch_refused_capacity",
     r.outcome == switch_outcome::refused_capacity ? 1.0 : 0.0);
  fn("moebius_switch_already_there", r.outcome == switch_outcome::already_there ? 1.0 : 0.0);
  fn("moebius_switch_verified", r.verified ? 1.0 : 0.0);
}

std::vector<switch_metric> metrics_of(const switch_report& r) {
  std::vector<switch_metric> out;
  for_each_metric(r, [&](std::string_view name, double value) { out.push_back({name, value}); });
  return out;
}

}  // namespace moebius
