#pragma once

// Per-rank decode-step curves of a deployment, as bench_mini_engine_rank_share measures them on
// one GPU (gpu/bench_rank_share.cu: one rank's share at full size, compute measured, collectives
// priced by a link model), and a priced clock that prices decode steps from them.
//
// The file: JSON lines, one per (configuration, context, batch), with at least
//   {"model": "qwen3_235b", "P": 8, "mode": "TP", "context": 2048, "batch": 128,
//    "layers": 94, "skew": 1.0, "compute_ms": 9.81, "comm_priced_ms": 2.77, "step_ms": 12.58}
// (the bench writes more fields; they are ignored). "mode" names the configuration the point was
// measured in (configuration.hpp, any case: "TP", "EP", "TP-DCP2", "TEP-DCP2", "TEP"; the bench
// writes "TP-dcp2"); the field keeps its name. One deployment per file: every line names the
// same model, P, layers and skew (skew may be absent: 1). step_ms is the curve: compute
// measured plus collectives priced, both kept in the file.
//
// A line may say how its collectives were priced: "collectives": "link" (the default when absent:
// the files measured before the cited table) or "cited" (step_collectives.hpp); one pricing per
// configuration. with_collectives() reprices every curve by one of them (the simulated runtime:
// cited, by default).
//
// Configurations not measured can be priced from TP's measured curve (with_priced_layouts), and
// again from another layout's curve and the two's ratio measured together on another card
// (with_measured_ratio): named fallbacks, never presented as measured (priced(), source_of()).
//
// Between the points: linear in log2(batch) within a context's row (beyond the largest batch, the
// last segment's slope in the batch itself; below the smallest, the smallest), then linear in
// the context between the two measured contexts that bracket it (outside them, the nearest).

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <moebius/layout/parallel_mode.hpp>

#include "configuration.hpp"
#include "expert_load.hpp"
#include "step_collectives.hpp"
#include "step_clock.hpp"

namespace mini_engine {

// A curves file's text and where it came from ("docs/results/step_curves_....jsonl").
struct embedded_curves {
  const char* source = nullptr;
  const char* text = nullptr;
};

struct step_curve_point {
  configuration mode = moebius::parallel_mode::ep;  // the configuration (the file's "mode")
  int64_t context = 0;  // tokens per sequence the step attends
  int64_t batch = 0;    // sequences of the deployment (not of the rank)
  double step_ms = 0;
};

class step_curves {
 public:
  // TP and EP need a point each (other configurations are optional); each point a positive
  // batch, context and step_ms, a named configuration (is_named), and no (configuration,
  // context, batch) twice. Throws errc::invalid_argument naming the offending point.
  step_curves(std::vector<step_curve_point> points, std::string deployment);
  // The bench's JSON lines; `source` names the file in errors ("line 3 of <source>: ...") and
  // in deployment(). All lines must name one model and one P.
  static step_curves from_jsonl(std::istream& in, const std::string& source);
  static step_curves from_file(const std::string& path);
  // The curves of `model` (the bench's name: "qwen3_235b", "qwen3_30b") at P ranks among
  // `files`, or nullopt; a file that does not parse is an error naming it.
  static std::optional<step_curves> find(std::span<const embedded_curves> files,
                                         const std::string& model, int P);
  // The same among the curves measured and committed under docs/results/step_curves_*.jsonl,
  // compiled in at build time (so that a priced clock has them on any machine).
  static std::optional<step_curves> measured(const std::string& model, int P);
  static std::span<const embedded_curves> measured_files();
  // The curves over the operating region of `model` at P ranks (docs/results/step_region_*.jsonl:
  // one file per mode, merged), or nullopt when none was measured.
  static std::optional<step_curves> region(const std::string& model, int P);
  static std::span<const embedded_curves> region_files();
  // Every file among `files` of `model` at P (by its first line), merged into one set of
  // curves (a file per mode): nullopt when none is; errc::invalid_argument naming the files
  // when they lack a mode or disagree on the deployment.
  static std::optional<step_curves> merge(std::span<const embedded_curves> files,
                                          const std::string& model, int P);
  // The curves of several layouts measured together in one run, on another card or at fewer
  // layers than the deployment (docs/results/step_layouts_*.jsonl, compiled in): of these only
  // the ratios between layouts are used (with_measured_ratio), never a step itself. nullopt
  // when none of `model` at P was measured.
  static std::optional<step_curves> layout_ratios(const std::string& model, int P);
  static std::span<const embedded_curves> layout_ratio_files();

  // The step of `batch` sequences at `context` tokens each in configuration `c`, in ms (see the
  // top). Throws errc::invalid_argument naming `c` when it has no curve.
  double step_ms(const configuration& c, double batch, double context) const;
  // The same within the measured points: the batch held to each row's smallest and largest
  // measured batch (no slope beyond them), the context to the rows' (as step_ms does).
  double step_ms_within(const configuration& c, double batch, double context) const;
  // The smallest context of `c`'s curve (same error).
  double smallest_context(const configuration& c) const;
  bool has(const configuration& c) const { return find_curve(c) != nullptr; }
  // The configurations with a curve, in the order first seen (sorted: TP, EP, then the rest).
  std::vector<configuration> configurations() const;
  // Whether `c`'s curve was priced (with_priced_layouts) rather than read from measured points,
  // and where it comes from: the file(s) for measured ones, what was priced for priced ones.
  bool priced(const configuration& c) const;
  const std::string& source_of(const configuration& c) const;
  // "qwen3_235b P=8 L=94 skew 1 (<source>)".
  const std::string& deployment() const { return deployment_; }
  int num_ranks() const { return num_ranks_; }
  // The bench's model name ("" when built from points, not from a file).
  const std::string& model() const { return model_; }
  // The layers the curves were measured with (0: built from points, not from a file).
  int64_t num_layers() const { return num_layers_; }

  // How `c`'s collectives are priced in its step_ms (same error as step_ms).
  collective_pricing collectives_of(const configuration& c) const;
  // These curves with every point's collectives priced by `to` (step_collectives.hpp) instead of
  // its curve's pricing: each point moves by collectives_shift_ms of its configuration and
  // batch, the data-parallel ranks sending ceil(B/P) x model.top_k pairs; model gives the
  // hidden size and heads. Curves already priced by `to` are returned as they are. The curves must know their layers (from a file) and equal the
  // model's. A step that would fall to 0 or below is refused by name (errc::invalid_argument).
  step_curves with_collectives(collective_pricing to, const priced_model& model) const;

  // These curves with every measured curve whose experts are EP (EP, TEP, TEP-DCPd) moved by
  // the busiest EP rank's expert load the one-rank emulation misses (expert_load.hpp:
  // expert_load_shift_ms at each point's batch, the weights at `hbm_bytes_per_s`), and so is a
  // curve priced from measured ones by with_measured_ratio. Curves priced with the roofline's
  // expert term (with_priced_layouts' TEP ones: the busiest rank's already) and curves moved so
  // before are left as they are. Needs the curves' layers (from a file).
  step_curves with_expert_load(const priced_model& model, double hbm_bytes_per_s,
                               const routing_model& routing) const;
  // Whether `c`'s curve carries the busiest rank's expert load (with_expert_load).
  bool expert_load_priced(const configuration& c) const;

  // The latency per collective the link model priced (link_model::latency_s, 10 us: assumed).
  static constexpr double priced_collective_us = 10;
  // These curves with each collective's latency priced at `tp_us` (TP attention's all-reduces,
  // and DCP's exchange) and `ep_us` (EP's dispatch and combine) instead: every step has two
  // collectives a layer in either attention layout, and TP attention with dcp > 1 three more
  // (DCP's q all-gather and two merge collectives), so each point moves by (2 or 5) x layers x
  // (its attention's latency - priced_collective_us). Measured
  // small-message latencies on NVLink are well above the assumed 10 us (DeepEP's low-latency
  // dispatch and combine of 128 tokens at EP 8: 77 and 114 us, H800, RDMA; its README), and
  // the paper's quiet TPOT gap (TP 37, EP 52 ms) is larger than the compute alone: the results'
  // sensitivity to it is shown by serving the same trace at several latencies (demo
  // --collective-us). Throws errc::invalid_argument when a latency is not in [0, 10^4] or
  // the curves do not know their layers (built from points) or a curve's collectives are not
  // priced by the link model (with_collectives(link) first); a step that would fall to 0 or
  // below is refused by name.
  step_curves with_collective_latency(double tp_us, double ep_us) const;
  // These curves with each point's step_ms moved by shift_ms(its configuration, its batch)
  // (with_collectives: the collectives repriced); `what` is appended to deployment(). A step that would fall to 0 or below is
  // refused by name (errc::invalid_argument).
  step_curves with_step_shift(
      const std::function<double(const configuration&, int64_t batch)>& shift_ms,
      const std::string& what) const;

 private:
  // The points of one configuration and context, ascending in batch.
  struct row {
    int64_t context = 0;
    std::vector<step_curve_point> points;
  };
  struct curve {
    configuration config;
    std::vector<row> rows;  // ascending in context
    bool priced = false;
    std::string source;
    collective_pricing collectives = collective_pricing::link;
    bool expert_load = false;  // moved by with_expert_load
    // Priced with the roofline's expert term of EP (with_priced_layouts): the busiest rank's
    // load is in it already, so with_expert_load leaves it.
    bool roofline_experts = false;
  };
  static double row_ms(const row& r, double batch);
  // The step on x at (batch, context); `within`: the batch held to each row's measured range.
  static double curve_ms(const curve& x, double batch, double context, bool within);
  const curve* find_curve(const configuration& c) const;
  const curve& curve_of(const configuration& c) const;  // throws naming c
  // Adds the points (one configuration's, validated) as a curve.
  static void add_curves(std::vector<curve>& out, std::vector<step_curve_point> points,
                         const std::string& deployment, bool priced, const std::string& source);
  friend step_curves with_priced_layouts(const step_curves& measured, const h200_step_model& model,
                                         std::span<const configuration> wanted);
  friend step_curves with_measured_ratio(const step_curves& curves, const step_curves& ratios,
                                         const configuration& c, const configuration& ref);

  std::vector<curve> curves_;  // TP, EP, then the others in the order first seen
  std::string deployment_, model_;
  int num_ranks_ = 0;
  int64_t num_layers_ = 0;
};

// The priced fallback for configurations with TP attention that `measured` has no curve of:
// each derived from the measured TP curve, point by point (and so interpolated as TP's is),
//
//   TP-DCPd   at (batch B, context c) = TP at (B, c/d) + L x model.dcp_exchange_s(B, d)
//             (each rank attends over 1/d of every sequence's tokens of its head: TP's step at
//             a d-th of the context; plus DCP's exchange a layer, priced as bench_rank_share
//             prices it: a q all-gather and two merge collectives, 10 us each by default)
//   TEP-DCPd  = TP-DCPd + model.experts_s(ep, B) - model.experts_s(tp, B): the experts' term of
//             EP instead of TP's, both from the roofline (the busiest rank's E/P whole experts
//             against every touched expert's I/P slice, at the HBM rate); TP's all-reduces kept
//             (TEP's combine is the all-reduce TP does; no dispatch)
//   TEP       = TP + the same expert term (d = 1)
//
// Not priced: the q heads the DCP set gathers (each rank attends 2 x Hq/P heads over its half:
// the same KV bytes, twice the attention FLOPs), the busiest DCP index's extra page, and what
// the roofline's expert term leaves out (the narrow TP slices' GEMM efficiency, the router,
// permute and combine over every pair, which a stage profile shows EP's experts avoid): the
// TEP fallback is pessimistic where TP's per-pair stages dominate (large batch). Each priced
// curve says so in source_of(); measured ones are never replaced. `wanted`: the configurations
// to price when missing; one with data-parallel attention is an error (nothing to derive it
// from), as are curves without TP or whose layers differ from the model's.
step_curves with_priced_layouts(const step_curves& measured, const h200_step_model& model,
                                std::span<const configuration> wanted);

// `c`'s curve priced again from `ref`'s in `curves` and the two layouts' ratio as `ratios`
// measured them together (layout_ratios: another card, or fewer layers), point by point on
// ref's grid:
//
//   c at (B, ctx) = ref at (B, ctx) x ratios.step_ms_within(c, B, ctx)
//                                    / ratios.step_ms_within(ref, B, ctx)
//
// The ratio of whole steps (compute measured, collectives priced by the link model, on both
// layouts alike), held at the edge of the points `ratios` measured. Where c's measured
// advantage comes from kernels a roofline does not see (TEP's whole experts against TP's narrow
// slices, the permute and combine over B pairs instead of 8B), this prices it where the
// fallback's roofline term cannot; what it assumes is that the ratio carries over to the
// deployment's card and layer count. The result is priced (source_of says from what) and,
// like a measured curve, carries no busiest-rank expert load until with_expert_load. A
// measured curve of c is kept. Throws errc::invalid_argument when c equals ref, ref has no
// curve in `curves`, or either has none in `ratios`.
step_curves with_measured_ratio(const step_curves& curves, const step_curves& ratios,
                                const configuration& c, const configuration& ref);

}  // namespace mini_engine
