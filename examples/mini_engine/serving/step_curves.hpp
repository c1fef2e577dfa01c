#pragma once

// Per-rank decode-step curves of a deployment, as bench_mini_engine_rank_share measures them on
// one GPU (gpu/bench_rank_share.cu: one rank's share at full size, compute measured, collectives
// priced by a link model), and a priced clock that prices decode steps from them.
//
// The file: JSON lines, one per (mode, context, batch), with at least
//   {"model": "qwen3_235b", "P": 8, "mode": "TP", "context": 2048, "batch": 128,
//    "layers": 94, "skew": 1.0, "compute_ms": 9.81, "comm_priced_ms": 2.77, "step_ms": 12.58}
// (the bench writes more fields; they are ignored; mode "TP" / "EP", lower case accepted). One
// deployment per file: every line names the same model, P, layers and skew (skew may be absent:
// 1). step_ms is the curve: compute measured plus collectives priced, both kept in the file.
//
// Between the points: linear in log2(batch) within a context's row (beyond the largest batch, the
// last segment's slope in the batch itself; below the smallest, the smallest), then linear in
// the context between the two measured contexts that bracket it (outside them, the nearest).

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <moebius/layout/parallel_mode.hpp>

#include "step_clock.hpp"

namespace mini_engine {

// A curves file's text and where it came from ("docs/results/step_curves_....jsonl").
struct embedded_curves {
  const char* source = nullptr;
  const char* text = nullptr;
};

struct step_curve_point {
  moebius::parallel_mode mode = moebius::parallel_mode::ep;
  int64_t context = 0;  // tokens per sequence the step attends
  int64_t batch = 0;    // sequences of the deployment (not of the rank)
  double step_ms = 0;
};

class step_curves {
 public:
  // Every mode needs a point; each point a positive batch, context and step_ms, and no
  // (mode, context, batch) twice. Throws errc::invalid_argument naming the offending point.
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

  // The step of `batch` sequences at `context` tokens each, in ms (see the top).
  double step_ms(moebius::parallel_mode m, double batch, double context) const;
  // The smallest context measured in mode `m`.
  double smallest_context(moebius::parallel_mode m) const;
  // "qwen3_235b P=8 L=94 skew 1 (<source>)".
  const std::string& deployment() const { return deployment_; }
  int num_ranks() const { return num_ranks_; }
  // The bench's model name ("" when built from points, not from a file).
  const std::string& model() const { return model_; }
  // The layers the curves were measured with (0: built from points, not from a file).
  int64_t num_layers() const { return num_layers_; }

  // The latency per collective the bench priced (h200_params::collective_us, 10 us: assumed).
  static constexpr double priced_collective_us = 10;
  // These curves with each collective's latency priced at `tp_us` (TP's all-reduces) and
  // `ep_us` (EP's dispatch and combine) instead: every step has two collectives a layer in
  // either mode, so each point moves by 2 x layers x (its mode's latency -
  // priced_collective_us). Measured
  // small-message latencies on NVLink are well above the assumed 10 us (DeepEP's low-latency
  // dispatch and combine of 128 tokens at EP 8: 77 and 114 us, H800, RDMA; its README), and
  // the paper's quiet TPOT gap (TP 37, EP 52 ms) is larger than the compute alone: the results'
  // sensitivity to it is shown by serving the same trace at several latencies (demo
  // --collective-us). Throws errc::invalid_argument when a latency is not in [0, 10^4] or
  // the curves do not know their layers (built from points); a step that would fall to 0 or
  // below is refused by name.
  step_curves with_collective_latency(double tp_us, double ep_us) const;

 private:
  // The points of one mode and context, ascending in batch.
  struct row {
    int64_t context = 0;
    std::vector<step_curve_point> points;
  };
  static double row_ms(const row& r, double batch);

  std::vector<row> rows_[2];  // per mode (index: tp 1, ep 0), ascending in context
  std::string deployment_, model_;
  int num_ranks_ = 0;
  int64_t num_layers_ = 0;
};

// The priced clock with measured curves. A step from `curves`: its sequences at their mean
// context (scaled by the priced model's context_scale), plus, when it prefills (more new tokens
// than sequences), the prefill increment: curve(rows) - curve(sequences) at the smallest
// measured context (the chunk's GEMM rows; its attention runs over its own tokens, not a KV read
// per row), never below the decode step; rows beyond the largest measured batch follow the
// last segment's slope (extrapolated, as step_ms says). An EP step that says how its items
// split over the ranks (step_cost::ranks) is priced by its busiest rank, each rank at P times
// its own sequences and rows (the curves' batch is the deployment's): the experts' share of
// that rank is then priced as if every rank were as busy. Switches, the link and the overlap
// slowdown from `model` (h200_step_model, which says so in its own name). The clock's name
// says both.
class curves_step_clock final : public step_clock {
 public:
  curves_step_clock(step_curves curves, const h200_step_model& model);

  double step_s(const step_cost& cost, double measured_s) const override;
  double switch_s(const moebius::switch_report& report) const override;
  const char* name() const override { return name_.c_str(); }
  bool needs_measurement() const override { return false; }
  int64_t layer_bytes(const moebius::layer_bytes& run, int64_t run_layers) const override;
  const step_curves& curves() const { return curves_; }
  moebius::link_rate link() const override;
  double copies_s(const switch_copies& copies) const override;
  double predicted_switch_s(const moebius::layer_bytes& run, int64_t run_layers) const override;
  overlap_slowdown slowdown() const override;

 private:
  // ms of a step of `sequences` at `context` with `rows` new tokens (>= sequences).
  double rows_ms(moebius::parallel_mode m, double sequences, double rows, double context) const;

  step_curves curves_;
  const h200_step_model& model_;
  std::string name_;
};

}  // namespace mini_engine
