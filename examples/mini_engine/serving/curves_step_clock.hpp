#pragma once

// The priced clock with measured curves: a step priced from the per-rank step curves of its
// configuration (step_curves.hpp), with what it prices beyond them as options: CUDA-graph
// buckets, measured prefill chunks (prefill_table.hpp), measured mixed steps
// (mixed_step_table.hpp). Switches, the link and the overlap slowdown from h200_step_model.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "configuration.hpp"
#include "graph_buckets.hpp"
#include "mixed_step_table.hpp"
#include "prefill_table.hpp"
#include "step_clock.hpp"
#include "step_curves.hpp"

namespace mini_engine {

// What curves_step_clock prices beyond the decode curves themselves. The defaults price as the
// clock always did (every decode step at its own batch, a prefill chunk as the curve's extra
// rows), so no caller's numbers move unless it asks.
struct curves_clock_options {
  // The CUDA-graph buckets the runtime pads a decode step's batch to (graph_buckets.hpp:
  // ascending strictly, each >= 1). Given, a decode step is priced at the curve at the smallest
  // bucket >= its batch (a rank's batch: under TP attention the step's sequences, under
  // data-parallel attention each rank's own), as the replayed graph runs the padded rows;
  // beyond the largest bucket the step runs eagerly: the curve at its batch x eager_penalty.
  // Steps that prefill run eagerly at their own batch (no graph pads them). Empty: every decode
  // step at its own batch, interpolated between the measured points.
  std::vector<int64_t> graph_buckets;
  // An eager decode step against a graph replay of the same batch (beyond the largest bucket
  // only): finite, > 0. 1 (the default) prices it as a replay. A measured ratio belongs here
  // (the runtime's step with MINI_ENGINE_NO_GRAPHS=1 against the same step replayed, at the
  // batches beyond the buckets); none is measured yet.
  double eager_penalty = 1;
  // Decode steps measured as the runtime replays them: at every graph bucket and at the first
  // batch past each (a step past a bucket replays the next bucket's graph, its dense GEMMs over
  // the padded rows while attention and the experts skip them, so its cost jumps there and is
  // nearly flat up to the bucket; mini_engine_fidelity measures them so). Given, a decode step
  // is priced at its own batch on these (between their points, as the curves are) for the
  // configurations they have; the curves keep pricing every step that prefills (run eagerly: no
  // padding), whose extra rows the padded plateaus would misprice. A second way to price the
  // padding: not with graph_buckets. Each configuration must have a curve. nullopt: none.
  std::optional<step_curves> replayed_decode;
  // Measured prefill-chunk steps (prefill_table.hpp). For a configuration with points, a step
  // that prefills takes its prefill increment from them instead of from the decode curve's
  // extra rows (below); configurations without points keep the extra rows. Empty: none.
  prefill_table prefill;
  // Measured mixed steps (mixed_step_table.hpp): for a configuration with a grid, a step that
  // prefills is priced by it as a whole (below), before `prefill` and the extra rows. Empty:
  // none.
  mixed_step_table mixed;
};

// The priced clock with measured curves. A step from the curve of its configuration
// (step_cost::config(): TP, EP, TEP-DCP2, ...; a configuration without a curve is an error
// naming it): its sequences at their mean context (scaled by the priced model's
// context_scale; a decode step at its CUDA-graph bucket when options.graph_buckets are given, or
// on options.replayed_decode when that is),
// plus, when it prefills (more new tokens than sequences), the prefill increment at the
// smallest measured context ctx0, never below 0:
//   without prefill points: curve(rows, ctx0) - curve(sequences, ctx0)  (the chunk's GEMM
//     rows; its attention runs over its own tokens, not a KV read per row; rows beyond the
//     largest measured batch follow the last segment's slope, as step_ms says);
//   with options.prefill's points of the configuration: prefill(rows) - curve(sequences, ctx0)
//     (the measured eager step of a chunk of that many tokens, less the decode step it stands
//     beside: the step's own sequences at ctx0 are priced by the decode term already).
// With options.mixed's grid of the configuration the step is priced whole instead:
//   mixed(b, t) + max(0, curve(sequences, context) - curve(sequences, ctxm))
//     + max(0, curve(b, ctx0) - curve(bmax, ctx0)) when b > bmax,
// b = sequences - 1 and t = rows - b (a step_cost does not say how many of its items prefill:
// one chunk is assumed, the rest decoding; with k chunks b is over by k - 1 and t under by as
// many tokens), ctxm the grid's decode context (mixed_step_table::decode_context) and bmax its
// largest decode batch: the grid clamps there, so the decode curve adds what more decodes cost.
// The context term carries what the grid's decode sequences at ctxm do not: longer contexts,
// and a later chunk's attention over its sequence's earlier tokens (the grid's chunks are first
// chunks), as the terms above do.
// An EP step that says how its items split over the ranks (step_cost::ranks) is priced by its
// busiest rank, each rank at P times its own sequences and rows in the curves (whose batch is
// the deployment's: the experts' share of that rank is then priced as if every rank were as
// busy), its own rows in the prefill points (keyed by the busiest rank's tokens) and its own
// sequences against the graph buckets; one that does not is priced as the deployment's batch
// (with graph buckets: as if its items split evenly, ceil(B / P) a rank). Switches, the link
// and the overlap slowdown from `model` (h200_step_model, which says so in its own name). The
// clock's name says all of it.
class curves_step_clock final : public step_clock {
 public:
  // Throws errc::invalid_argument for graph buckets that do not ascend strictly from >= 1
  // (naming the bucket) or an eager penalty that is not finite and > 0.
  curves_step_clock(step_curves curves, const h200_step_model& model,
                    curves_clock_options options = {});

  double step_s(const step_cost& cost, double measured_s) const override;
  double switch_s(const moebius::switch_report& report) const override;
  const char* name() const override { return name_.c_str(); }
  bool needs_measurement() const override { return false; }
  int64_t layer_bytes(const moebius::layer_bytes& run, int64_t run_layers) const override;
  const step_curves& curves() const { return curves_; }
  const curves_clock_options& options() const { return options_; }
  moebius::link_rate link() const override;
  double copies_s(const switch_copies& copies) const override;
  double predicted_switch_s(const moebius::layer_bytes& run, int64_t run_layers) const override;
  double predicted_kv_switch_s(const moebius::layer_bytes& run,
                               int64_t run_layers) const override;
  overlap_slowdown slowdown() const override;

 private:
  // ms of one rank's work in configuration `m` (under TP attention: the step's, as every rank
  // runs every sequence): `sequences` items with `rows` new tokens (>= sequences) at `context`
  // tokens each; `ranks` of them make the curves' batch (the deployment's: P for a
  // data-parallel rank, else 1). `graphs`: the step replays a graph (no item prefills).
  double rank_ms(const configuration& m, double ranks, int64_t sequences, int64_t rows,
                 double context, bool graphs) const;
  // The same for a rank that prefills (rows > sequences), from options_.mixed's grid of `m`.
  double mixed_ms(const configuration& m, double ranks, int64_t sequences, int64_t rows,
                  double context) const;

  step_curves curves_;
  const h200_step_model& model_;
  curves_clock_options options_;
  std::string name_;
};

}  // namespace mini_engine
