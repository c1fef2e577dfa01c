#pragma once

// The offline search of a rollout's switch points (the demo's rollout experiment prints it
// beside the switching runs): what the paper's rollout rule could reach with its thresholds
// chosen after the fact.

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "paper_metrics.hpp"

namespace mini_engine::demo {

// The offline ceiling of a closed-loop rollout: one switch point per rollout step. Every step
// starts at a load of 2,048 (in EP, or switching there at once) and may switch to TP once the
// load falls under b: the paper's rollout rule at T_h = T_l = b, rules alone. Each b of the grid
// serves the whole trace once, and each rollout step takes the b that served it fastest; the
// steps are independent (each starts when the last has finished, and the rule sends it to EP at
// once whatever the last one ended in), so that sum is a schedule's time: the search's best.
struct search_result {
  std::vector<int64_t> grid;
  std::vector<paper_metrics> runs;  // per b
  size_t best_single = 0;           // the b whose whole run was fastest
  std::vector<size_t> best_per_step;
  double per_step_total_s = 0;
};
search_result search_of(std::vector<int64_t> grid, std::vector<paper_metrics> runs);
void print_search(const search_result& s, double best_static_s, double switching_s);
nlohmann::json search_json(const std::string& trace, const search_result& s);

}  // namespace mini_engine::demo
