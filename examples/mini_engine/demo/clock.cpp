#include "clock.hpp"

#include <algorithm>
#include <cstdio>
#include <moebius/error.hpp>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "collective_table.hpp"
#include "curves_step_clock.hpp"
#include "sim_deployment.hpp"
#include "step_curves.hpp"

namespace mini_engine::demo {

priced_model priced_of(const options& o, int64_t run_kv_heads) {
  priced_model m;
  if (o.priced == priced_kind::qwen3_235b_a22b) {
    m = qwen3_235b_a22b_priced();
  } else {
    m.num_kv_heads = run_kv_heads;  // the run's KV heads (H_kv < P: TP replicates)
  }
  m.context_scale = o.context_scale;
  return m;
}

int64_t h200_kv_pages(const priced_model& m, int P, int64_t page_size, std::string* why) {
  const double wb = static_cast<double>(m.weight_bytes);
  const double L = static_cast<double>(m.num_layers), H = static_cast<double>(m.hidden);
  const double expert = 3.0 * H * static_cast<double>(m.intermediate) * wb;
  const double experts = L * (static_cast<double>(m.num_experts) / P + 1.0) * expert;
  const double attention = L *
                           (2.0 * static_cast<double>(m.num_q_heads * m.head_dim) * H +
                            2.0 * static_cast<double>(m.num_kv_heads * m.head_dim) * H) *
                           wb;
  const double embed = 2.0 * static_cast<double>(m.vocab) * H * wb;
  const double weights = experts + attention + embed;
  const double budget = 0.9 * 141e9 - weights;
  const double token =
      L * 2.0 * static_cast<double>(m.num_kv_heads * m.head_dim * m.kv_bytes) * m.context_scale;
  const int64_t pages = std::max<int64_t>(
      16, static_cast<int64_t>(budget / (token * static_cast<double>(page_size))));
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "%lld EP pages per rank: (0.9 x 141 GB - %.1f GB of weights per rank) / (%.1f KB "
                "of priced KV per run token x %lld tokens a page)",
                static_cast<long long>(pages), weights / 1e9, token / 1e3,
                static_cast<long long>(page_size));
  *why = buf;
  return pages;
}

std::string curves_summary(const step_curves& curves, bool verbose) {
  // Configurations grouped by where their curve comes from, measured ones first.
  std::vector<std::pair<std::string, std::string>> groups;  // (source, names)
  std::string measured, priced;
  for (const configuration& c : curves.configurations()) {
    std::string& to = curves.priced(c) ? priced : measured;
    to += (to.empty() ? "" : ", ") + name_of(c);
    auto g = std::find_if(groups.begin(), groups.end(),
                          [&](const auto& x) { return x.first == curves.source_of(c); });
    if (g == groups.end()) groups.emplace_back(curves.source_of(c), name_of(c));
    else g->second += ", " + name_of(c);
  }
  if (verbose) {
    std::string s = "step curves:";
    for (const auto& [source, names] : groups)
      s += " " + names + (curves.priced(parse_configuration(names.substr(0, names.find(','))))
                              ? " PRICED, not measured: "
                              : " measured: ") +
           source + ";";
    s.pop_back();
    return s;
  }
  std::string s = "step curves: " + measured + " measured (compute on one H200, collectives priced)";
  if (!priced.empty()) {
    const bool ratio = curves.has(k_tep_dcp2) && curves.priced(k_tep_dcp2) &&
                       curves.source_of(k_tep_dcp2).find(" as measured in ") != std::string::npos;
    s += "; " + priced + " PRICED, not measured (TP's curve at context/2 plus DCP's exchange; " +
         (ratio ? "TEP-DCP2 that times TEP-DCP2/TP-DCP2 as measured together (step_layouts_*.jsonl)"
                : "TEP-DCP2 with EP's expert term from the roofline") +
         ": step_curves.hpp)";
  }
  return s;
}

namespace {

// The H200 model of the priced deployment, its decode steps from measured curves when `o`
// names them or the deployment has committed ones.
demo_clock priced_clock(const options& o, const world& w, int P) {
  demo_clock out;
  out.priced = true;
  const priced_model m = priced_of(o, w.kv.num_kv_heads);
  out.model = std::make_unique<h200_step_model>(m, h200_params{}, P, kv_bytes_per_token(w.kv));
  std::ostringstream d;
  d << m;
  std::ostringstream link;
  link << h200_params{}.switch_link;
  char buf[1024];
  std::snprintf(
      buf, sizeof buf,
      "  clock: modelled H200 x%d (step_clock.hpp's roofline at DESIGN.md §6-7 rates), "
      "each step priced as %s (%s), switches by moebius::cost_model over the link fitted "
      "on 18 switches measured on 2x H200 (%s), steps beside a progressive switch's "
      "copies by the slowdown curve measured on one H200; the host's own time is in the "
      "CSV (measured_ms)\n",
      P, to_string(o.priced), d.str().c_str(), link.str().c_str());
  out.description = buf;
  // The priced deployment's name in bench_mini_engine_rank_share's files.
  const std::string bench_model =
      o.priced == priced_kind::qwen3_235b_a22b ? "qwen3_235b" : "qwen3_30b";
  std::optional<step_curves> curves;
  if (o.curves.empty())
    curves = step_curves::measured(bench_model, P);
  else if (o.curves != "roofline")
    curves = step_curves::from_file(o.curves);
  if (!curves) {
    if (o.curves.empty())
      out.description += "  decode steps from the roofline: no measured step curves of " +
                         bench_model + " at P=" + std::to_string(P) +
                         " under docs/results (step_curves_*.jsonl, "
                         "bench_mini_engine_rank_share)\n";
    out.clock = std::move(out.model);
    return out;
  }
  const std::string& from = o.curves.empty() ? curves->deployment() : o.curves;
  MOEBIUS_CHECK(curves->num_ranks() == P, moebius::errc::invalid_argument, "--curves ", from,
                ": measured for P=", curves->num_ranks(), ", the demo runs P=", P);
  MOEBIUS_CHECK(curves->num_layers() == m.num_layers, moebius::errc::invalid_argument, "--curves ",
                from, ": measured with ", curves->num_layers(), " layers, the clock prices ",
                to_string(o.priced), " (", m.num_layers,
                " layers): curves of another model, or of a shortened one");
  out.description += "  decode steps instead from " + curves->deployment() +
                     ": per-rank compute measured on one GPU, collectives priced by a link "
                     "model (bench_mini_engine_rank_share)\n";
  out.clock = std::make_unique<curves_step_clock>(std::move(*curves), *out.model);
  return out;
}

}  // namespace

demo_clock make_clock(const options& o, const world& w, int P) {
  if (o.runtime == runtime_kind::sim) return make_sim_clock(o);
  if (o.clock == clock_kind::model || (o.clock == clock_kind::automatic && !w.on_gpu))
    return priced_clock(o, w, P);
  // --clock measured with --curves is a usage error (options.cpp); here the automatic clock
  // measured because a GPU is there.
  MOEBIUS_CHECK(o.curves.empty(), moebius::errc::invalid_argument, "--curves ", o.curves,
                ": step curves price the modelled clock, and this run measures its steps on "
                "the GPU (--clock model uses them)");
  demo_clock out;
  out.clock = std::make_unique<measured_clock>();
  out.description =
      w.on_gpu ? "  clock: measured on the GPUs (each step's CUDA events, the longest rank; "
                 "switches and copies: their measured time)\n"
               : "  clock: measured (on the host all ranks run on one core: no GPU crossover)\n";
  return out;
}

demo_clock make_sim_clock(const options& o) {
  std::optional<step_curves> curves =
      o.curves.empty() ? step_curves::region("qwen3_235b", 8)
                       : std::optional<step_curves>(step_curves::from_file(o.curves));
  if (!curves)
    throw usage_error("--runtime sim: no step curves of qwen3_235b at P=8 over the operating "
                      "region (docs/results/step_region_*.jsonl); give --curves FILE");
  priced_model m = qwen3_235b_a22b_priced();
  // Every curve on the link model first (the fallback below adds DCP's exchange at its
  // latency), then the collectives as asked.
  curves = curves->with_collectives(collective_pricing::link, m);
  if (o.collective_us_tp >= 0)
    curves = curves->with_collective_latency(o.collective_us_tp, o.collective_us_ep);
  m.context_scale = 1;
  const sim_geometry g =
      make_sim_geometry(make_deployment(qwen3_235b_a22b(), deployment_kind::switching));
  demo_clock c;
  c.priced = true;
  c.model = std::make_unique<h200_step_model>(m, h200_params{}, 8, g.kv_bytes_per_token);
  // The configurations the runs serve in beyond TP and EP, priced from TP's curve until
  // measured ones land (DCP's exchange at the TP collectives' latency).
  {
    h200_params fallback_hw;
    if (o.collective_us_tp >= 0) fallback_hw.collective_us = o.collective_us_tp;
    const h200_step_model fallback(m, fallback_hw, 8, g.kv_bytes_per_token, nullptr);
    const configuration wanted[] = {k_tp_dcp2, k_tep_dcp2};
    curves = with_priced_layouts(*curves, fallback, wanted);
    // TEP-DCP2 again, from TP-DCP2 and the two measured together on another card when such a
    // run is committed: the roofline's expert term misses what TEP's whole experts save
    // (step_curves.hpp, with_measured_ratio).
    if (const std::optional<step_curves> ratios = step_curves::layout_ratios("qwen3_235b", 8))
      curves = with_measured_ratio(*curves, *ratios, k_tep_dcp2, k_tp_dcp2);
  }
  if (o.collectives == collective_pricing::cited)
    curves = curves->with_collectives(collective_pricing::cited, m);
  // The busiest EP rank's expert load, which one emulated rank misses (expert_load.hpp).
  curves = curves->with_expert_load(m, h200_params{}.hbm.bytes_per_s, routing_model{o.routing_skew});
  c.curves_summary = curves_summary(*curves, o.verbose);
  // The CUDA-graph buckets an engine would capture, applied to the rank batch (TP: the step's
  // sequences; EP: each rank's own), when asked: vLLM's defaults.
  curves_clock_options clock_options;
  if (o.vllm_graph_buckets) clock_options.graph_buckets = vllm_capture_sizes();
  c.clock = std::make_unique<curves_step_clock>(std::move(*curves), *c.model, clock_options);
  c.description = std::string("  clock (priced, not measured): ") + c.clock->name() + "\n";
  return c;
}

}  // namespace mini_engine::demo
