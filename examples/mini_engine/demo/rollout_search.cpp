#include "rollout_search.hpp"

#include <cstdio>
#include <utility>

namespace mini_engine::demo {

search_result search_of(std::vector<int64_t> grid, std::vector<paper_metrics> runs) {
  search_result s;
  s.grid = std::move(grid);
  s.runs = std::move(runs);
  for (size_t i = 1; i < s.runs.size(); ++i)
    if (s.runs[i].rollout_total_s < s.runs[s.best_single].rollout_total_s) s.best_single = i;
  const size_t steps = s.runs.front().rollout_step_s.size();
  for (size_t k = 0; k < steps; ++k) {
    size_t best = 0;
    for (size_t i = 1; i < s.runs.size(); ++i)
      if (s.runs[i].rollout_step_s[k] < s.runs[best].rollout_step_s[k]) best = i;
    s.best_per_step.push_back(best);
    s.per_step_total_s += s.runs[best].rollout_step_s[k];
  }
  return s;
}

void print_search(const search_result& s, double best_static_s, double switching_s) {
  std::printf(
      "\n  offline search: the rollout rule at T_h = T_l = b, rules alone, the trace served "
      "once per b:\n   ");
  for (size_t i = 0; i < s.grid.size(); ++i)
    std::printf(" b=%lld %.0f s%s", static_cast<long long>(s.grid[i]), s.runs[i].rollout_total_s,
                i + 1 < s.grid.size() ? "," : "\n");
  std::printf("    best single b = %lld: %.1f s, %.3fx the better static layout\n",
              static_cast<long long>(s.grid[s.best_single]), s.runs[s.best_single].rollout_total_s,
              best_static_s / s.runs[s.best_single].rollout_total_s);
  std::printf("    best b per rollout step (");
  for (size_t k = 0; k < s.best_per_step.size(); ++k)
    std::printf("%lld%s", static_cast<long long>(s.grid[s.best_per_step[k]]),
                k + 1 < s.best_per_step.size() ? ", " : "");
  std::printf("): %.1f s, %.3fx the better static layout; the switching run takes %.3fx its time\n",
              s.per_step_total_s, best_static_s / s.per_step_total_s,
              switching_s / s.per_step_total_s);
}

nlohmann::json search_json(const std::string& trace, const search_result& s) {
  nlohmann::json j;
  j["trace"] = trace;
  j["run"] = "offline search";
  j["grid"] = s.grid;
  std::vector<double> totals;
  for (const paper_metrics& r : s.runs) totals.push_back(r.rollout_total_s);
  j["grid_total_s"] = totals;
  j["best_single_b"] = s.grid[s.best_single];
  std::vector<int64_t> per_step;
  for (const size_t i : s.best_per_step) per_step.push_back(s.grid[i]);
  j["best_b_per_step"] = per_step;
  j["rollout_total_s"] = s.per_step_total_s;
  return j;
}

}  // namespace mini_engine::demo
