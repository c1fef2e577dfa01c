#include "designs_report.hpp"

#include <algorithm>
#include <cstdio>
#include <initializer_list>
#include <iterator>

#include "configuration.hpp"
#include "paper_report.hpp"

namespace mini_engine::demo {

std::vector<std::pair<run_kind, double>> design_bounds_s(const std::vector<run_outcome>& runs,
                                                         const step_clock& clock, int num_ranks) {
  struct design {
    run_kind kind;
    configuration a, b;
    run_kind static_a, static_b;
  };
  const design designs[] = {
      {run_kind::switching, k_ep, k_tp, run_kind::static_ep, run_kind::static_tp},
      {run_kind::switching_dcp2, k_ep, k_tp_dcp2, run_kind::static_ep, run_kind::static_tp_dcp2},
      {run_kind::experts_only, k_tep_dcp2, k_tp_dcp2, run_kind::static_tep_dcp2,
       run_kind::static_tp_dcp2},
      {run_kind::dcp_only, k_tp_dcp2, k_tp, run_kind::static_tp_dcp2, run_kind::static_tp},
  };
  std::vector<std::pair<run_kind, double>> out;
  for (const design& d : designs) {
    const run_outcome* a = find_run(runs, d.static_a);
    const run_outcome* b = find_run(runs, d.static_b);
    if (find_run(runs, d.kind) == nullptr || a == nullptr || b == nullptr) continue;
    out.emplace_back(d.kind,
                     std::min(free_switch_bound_s(a->result, clock, num_ranks, d.a, d.b),
                              free_switch_bound_s(b->result, clock, num_ranks, d.a, d.b)));
  }
  return out;
}

std::optional<designs_verdict> designs_verdict_of(
    const std::vector<run_outcome>& runs, const std::vector<paper_metrics>& m, bool rollout,
    const std::vector<std::pair<run_kind, double>>& bounds_s) {
  const run_kind beyond[] = {run_kind::static_tp_dcp2, run_kind::static_tep_dcp2,
                             run_kind::switching_dcp2, run_kind::experts_only,
                             run_kind::dcp_only};
  if (std::none_of(std::begin(beyond), std::end(beyond),
                   [&](run_kind k) { return find_run(runs, k) != nullptr; }))
    return std::nullopt;
  // Better: less rollout time; interactive, more interactive goodput, then more tokens/s.
  auto better = [&](size_t a, size_t b) {
    if (rollout) return m[a].rollout_total_s < m[b].rollout_total_s;
    if (m[a].goodput_rps[0] != m[b].goodput_rps[0]) return m[a].goodput_rps[0] > m[b].goodput_rps[0];
    return m[a].tokens_per_s > m[b].tokens_per_s;
  };
  int served = 0;
  auto best_of = [&](std::initializer_list<run_kind> kinds) {
    size_t best = runs.size();
    served = 0;
    for (const run_kind k : kinds) {
      if (find_run(runs, k) == nullptr) continue;
      ++served;
      const size_t i = index_of(runs, k);
      if (best == runs.size() || better(i, best)) best = i;
    }
    return best;
  };
  designs_verdict v;
  // The default design first: a tie names it (best_of keeps the first of equals).
  v.design = best_of({run_kind::dcp_only, run_kind::switching, run_kind::switching_dcp2,
                      run_kind::experts_only});
  v.paper = best_of({run_kind::static_tp, run_kind::static_ep});
  v.best_static = best_of({run_kind::static_tp, run_kind::static_ep, run_kind::static_tp_dcp2,
                           run_kind::static_tep_dcp2});
  if (v.paper == runs.size() || v.design == runs.size()) return std::nullopt;
  const size_t d = v.design;
  // "1.162x static EP": the design's speed-up; interactive, its figures beside the static's.
  auto against = [&](size_t s) {
    char buf[200];
    if (rollout)
      std::snprintf(buf, sizeof buf, "%.3fx %s", m[s].rollout_total_s / m[d].rollout_total_s,
                    label_of(runs[s].kind));
    else
      std::snprintf(buf, sizeof buf, "against %s: goodput %.2f vs %.2f/s, %s",
                    label_of(runs[s].kind), m[d].goodput_rps[0], m[s].goodput_rps[0],
                    changes(m[d], m[s]).c_str());
    return std::string(buf);
  };
  char buf[400];
  if (rollout) {
    double bound = 0;
    for (const auto& [kind, s] : bounds_s)
      if (kind == runs[d].kind) bound = s;
    char within[120] = "";
    if (bound > 0)
      std::snprintf(within, sizeof within, "; %.3fx its design's free-switch bound of %.0f s",
                    bound / m[d].rollout_total_s, bound);
    std::snprintf(buf, sizeof buf, "designs: the best switching design is %s (%.0f s%s): ",
                  label_of(runs[d].kind), m[d].rollout_total_s, within);
  }
  else
    std::snprintf(buf, sizeof buf,
                  "designs: the best switching design (interactive goodput, then tokens/s) is "
                  "%s, ",
                  label_of(runs[d].kind));
  v.line = buf;
  const std::string all = "the best of the " + std::to_string(served) + " static configurations";
  if (v.paper == v.best_static) {
    v.line += against(v.paper) + " (the better of static TP and EP, and " + all + ")";
  } else {
    v.line += against(v.paper) + " (the better of static TP and EP); " + against(v.best_static) +
              " (" + all + ")";
  }
  return v;
}

void print_designs_verdict(const std::vector<run_outcome>& runs,
                           const std::vector<paper_metrics>& m, bool rollout,
                           const std::vector<std::pair<run_kind, double>>& bounds_s) {
  if (const std::optional<designs_verdict> v = designs_verdict_of(runs, m, rollout, bounds_s))
    std::printf("  %s\n", v->line.c_str());
}

}  // namespace mini_engine::demo
