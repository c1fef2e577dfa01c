#pragma once

// The serving clock: how long a step and a switch take. On GPUs it is the measured time; on
// the host runtime, where all P virtual ranks run one after another on one CPU core, the
// measured time says nothing about where TP and EP cross on real hardware, so the host demo
// prices each step with a documented model of an H200 deployment instead (h200_step_model),
// and records the measured host time beside it.

#include <algorithm>
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <moebius/kv/kv_geometry.hpp>
#include <moebius/layout/parallel_mode.hpp>
#include <moebius/policy/cost_model.hpp>
#include <moebius/switch/pacing.hpp>
#include <moebius/switch/switcher.hpp>
#include <moebius/transport/link_rate.hpp>

#include "configuration.hpp"
#include "overlap_curve.hpp"
#include "step.hpp"
#include "step_collectives.hpp"

namespace mini_engine {

// One rank's share of an EP step: the items whose sequences it owns (data-parallel attention).
struct rank_work {
  int64_t sequences = 0, new_tokens = 0, context_tokens = 0;
  friend bool operator==(const rank_work&, const rank_work&) = default;
};

// What a step did, in the units a step-time model needs.
struct step_cost {
  // The attention's layout: how the items split over the ranks (EP: each on its owner).
  moebius::parallel_mode mode = moebius::parallel_mode::ep;
  // The experts' layout where it differs from the attention's (TEP: TP attention, EP experts);
  // unset: the same as `mode` (the paper's two layouts).
  std::optional<moebius::parallel_mode> experts;
  int64_t dcp = 1;  // TP attention's decode context parallel degree (kv_geometry::dcp)
  int num_ranks = 1;
  int64_t num_sequences = 0;   // items of the step
  int64_t new_tokens = 0;      // decode tokens + prefill chunk tokens
  int64_t context_tokens = 0;  // sum over items of the tokens attended (start + new)
  // EP: per rank, the items it owns (ep_rank_work); empty in TP, where every rank runs every
  // item, and where the caller did not split the step.
  std::vector<rank_work> ranks;

  // The configuration the step ran in: {mode, experts or mode} with dcp under TP attention.
  configuration config() const {
    return configuration_of({mode, experts.value_or(mode)}, dcp);
  }
  // Sets mode, experts and dcp from `c`.
  void set(const configuration& c) {
    mode = c.layout.attention;
    experts = c.layout.experts;
    dcp = c.dcp;
  }
};

// The EP split of a step's items: per rank of `ep_tables` (EP page tables), the items whose
// sequence it holds. Throws errc::invalid_argument for an item no rank holds.
std::vector<rank_work> ep_rank_work(const moebius::kv_state& ep_tables,
                                    std::span<const step_item> items);

// The copies of one progressive-switch advance, as the serving loop ran them: enqueued beside a
// step (step_beside.hpp), waited for once the step was done.
struct switch_copies {
  // Host seconds the loop waited for them after the step: on a runtime that overlaps them
  // (the GPU), only the part that outlasted the step; on one that does not (the host), all.
  double measured_s = 0;
  int64_t bytes = 0;      // the busiest rank's bytes as the clock prices them (layer_bytes x layers)
};

// A slowdown curve a clock provides: slowdown(step_s, bytes) >= 1 is the factor a step of
// step_s seconds takes longer with `bytes` copied beside it on the same GPUs. A plain function
// pointer and context (the clock), so the pacing asks it without allocating.
struct overlap_slowdown {
  double (*fn)(const void* context, double step_s, int64_t bytes) = nullptr;
  const void* context = nullptr;

  bool known() const { return fn != nullptr; }
  double at(double step_s, int64_t bytes) const { return fn ? fn(context, step_s, bytes) : 1.0; }
};

class step_clock {
 public:
  virtual ~step_clock() = default;
  // Seconds the step counts for on the serving clock, given the measured host/GPU seconds.
  virtual double step_s(const step_cost& cost, double measured_s) const = 0;
  // Seconds a switch counts for, given its report (report.total_ms is the measured time).
  virtual double switch_s(const moebius::switch_report& report) const = 0;
  // "measured" or "modelled H200 (...)": printed with every figure on this clock.
  virtual const char* name() const = 0;
  // Whether calibration must run steps on the runtime (a measured clock), or can evaluate
  // the clock at a batch size directly (a model).
  virtual bool needs_measurement() const = 0;

  // Progressive switch (engine.hpp, moebius/switch/pacing.hpp): the busiest rank's bytes per
  // layer the clock prices, given the run's own (`run`: weights and KV of one layer, from
  // moebius::switch_layer_bytes), and the link rate per GPU the copies run at. A measured
  // clock prices the run's bytes at an H200's copy-engine ceiling (389 GB/s).
  // `run_layers`: the run model's layer count.
  virtual int64_t layer_bytes(const moebius::layer_bytes& run, int64_t /*run_layers*/) const {
    return run.busiest();
  }
  virtual moebius::link_rate link() const { return moebius::link_rate::gb_per_s(389); }

  // A step during a progressive switch with its advance's copies beside it:
  // beside_copies_s(the step alone). Never more overlap than ran: a measuring clock adds the
  // wait for copies that outlasted the step to the step (its device time, waits included).
  virtual double switch_step_s(const step_cost& cost, double measured_step_s,
                               const switch_copies& copies) const {
    return beside_copies_s(step_s(cost, measured_step_s), copies);
  }
  // A step that takes `step_s` alone, with `copies` beside it. With a slowdown curve (a priced
  // clock that holds the measured one, and says so in name()): the step slowed by the copies'
  // bytes, and never shorter than the copies; without: step and copies one after the other.
  double beside_copies_s(double step_s, const switch_copies& copies) const {
    const double copy = copies_s(copies);
    const overlap_slowdown slow = slowdown();
    if (!slow.known()) return copy + step_s;
    return std::max(step_s * slow.at(step_s, copies.bytes), copy);
  }
  // The copies alone (a step with nothing to run): by default the measured wait.
  virtual double copies_s(const switch_copies& copies) const { return copies.measured_s; }
  // The cost gate (engine.hpp): the predicted seconds of a switch that would move `run` per
  // layer (moebius::switch_layer_bytes of the live tables) over the run's `run_layers` layers,
  // before it runs. Default: layer_bytes(run, run_layers) x run_layers at link().
  virtual double predicted_switch_s(const moebius::layer_bytes& run, int64_t run_layers) const {
    return static_cast<double>(layer_bytes(run, run_layers)) * static_cast<double>(run_layers) /
           link().bytes_per_s;
  }
  // The same for a switch that moves the KV alone (a change of the TP view's dcp: no expert
  // moves). Default: predicted_switch_s (a clock whose bytes are the run's own).
  virtual double predicted_kv_switch_s(const moebius::layer_bytes& run,
                                       int64_t run_layers) const {
    return predicted_switch_s(run, run_layers);
  }

  // Progressive pacing hook: how much longer a step of `step_s` seconds takes with `bytes`
  // copied beside it (the measured slowdown curve, DESIGN.md §7 "What overlap costs"). Empty
  // (the default, and every clock today): no curve, pacing by the link share alone.
  virtual overlap_slowdown slowdown() const { return {}; }
};

// The measured time itself (GPU runtimes; the host when its time is what you want).
class measured_clock final : public step_clock {
 public:
  double step_s(const step_cost&, double measured_s) const override { return measured_s; }
  double switch_s(const moebius::switch_report& r) const override { return r.total_ms * 1e-3; }
  const char* name() const override { return "measured"; }
  bool needs_measurement() const override { return true; }
};

// The model a step is priced as: Qwen3-30B-A3B's sizes by default (bf16 weights and KV).
struct priced_model {
  int64_t num_layers = 48, hidden = 2048, num_q_heads = 32, num_kv_heads = 4, head_dim = 128;
  int64_t num_experts = 128, top_k = 8, intermediate = 768, vocab = 151936;
  int64_t weight_bytes = 2, kv_bytes = 2;
  // Each context token of the run is priced as this many: the host demo's prompts of tens to
  // hundreds of tokens stand for prompts of a few thousand.
  double context_scale = 8;
};

// Qwen3-235B-A22B's sizes (bf16): the paper's model, whose TP/EP crossover on 8x H200 lies at
// 128-256 concurrent requests (DESIGN.md §7: 13.4 GB of attention weights per rank in EP
// against 1.7 GB in TP at P=8; H_kv = 4 < P: TP replicates KV heads).
inline priced_model qwen3_235b_a22b_priced() {
  priced_model m;
  m.num_layers = 94;
  m.hidden = 4096;
  m.num_q_heads = 64;
  m.num_kv_heads = 4;
  m.head_dim = 128;
  m.num_experts = 128;
  m.top_k = 8;
  m.intermediate = 1536;
  m.vocab = 151936;
  return m;
}

// The hardware, from DESIGN.md §6-7 (2x H200, NV18).
struct h200_params {
  // HBM read rate a decode step's GEMMs and attention reach.
  moebius::link_rate hbm = moebius::link_rate::gb_per_s(4000);
  // Per GPU per direction (copy-engine ceiling, §7).
  moebius::link_rate nvlink = moebius::link_rate::gb_per_s(389);
  double collective_us = 10;     // latency of one all-reduce or all-to-all
  double step_overhead_us = 50;  // graph launch, sampling, scheduling per step
  // Whole switches: moebius::cost_model with the link fitted on the 18 switches bench_switch
  // measured on 2x H200 (NV18, 2026-11-29; docs/BENCHMARKS.md, "Whole switch": weights and KV
  // through the switcher, 25-90% KV occupancy): 395 GB/s per GPU and 3.9 ms per switch, the
  // barrier and launch costs at cost_model's defaults. Scaled to a deployment by its bytes;
  // the per-GPU rate of an 8-GPU all-to-all over NVSwitch is assumed equal (not measured here).
  // The paper's 8x H200 figure is ~330 GB/s (152 ms for 50 GB).
  moebius::link_params switch_link = fitted_h200x2_switch_link();

  // What prices the roofline's collectives: the link model (collective_us, nvlink, and across
  // nodes the two fields below) or the cited measurements (collective_table.hpp, as
  // step_collectives.hpp runs them a step).
  collective_pricing collectives = collective_pricing::link;

  // A deployment over several nodes of GPUs (a what-if: nothing here was measured on two
  // nodes). The P ranks span num_nodes nodes, P / num_nodes a node; 1: one node, as above.
  int num_nodes = 1;
  // Per GPU per direction between nodes: one ConnectX-7 NIC a GPU, InfiniBand NDR 400 Gb/s,
  // ~50 GB/s (deepseek-ai/DeepEP docs/legacy.md: "CX7 InfiniBand 400 Gb/s RDMA network card
  // (~50 GB/s maximum bandwidth)"; NVIDIA/nccl-tests issue #290: 46-48 GB/s a NIC reached).
  moebius::link_rate internode = moebius::link_rate::gb_per_s(50);
  // One collective (or barrier) across nodes: an 8-byte NCCL all-reduce between two nodes over
  // InfiniBand, 19.90 us (nccl-tests all_reduce_perf, NVIDIA/nccl-tests issue #150).
  double internode_collective_us = 19.9;

  // switch_link with the internode rate and a barrier across nodes at internode_collective_us:
  // the link a switch whose copies cross nodes is priced over (moebius::cost_model).
  moebius::link_params switch_link_across_nodes() const {
    moebius::link_params l = switch_link;
    l.internode = internode;
    l.internode_barrier_us = internode_collective_us;
    return l;
  }

  static moebius::link_params fitted_h200x2_switch_link() {
    moebius::link_params l;
    l.bandwidth = moebius::link_rate::gb_per_s(395);
    l.fixed_ms = 3.9;
    return l;
  }
};

// A roofline-style decode/prefill step on P H200s, per rank (the busiest), in seconds:
//
//   time = bytes read / hbm + layers * 2 * collective + overhead, where
//   TP: attention weights / P (q, o sliced; k, v: the rank's KV head slice, one head when
//       H_kv < P: replicated), touched experts' slices / P, KV of EVERY sequence for the
//       rank's heads (replicated heads read on each of their ranks), LM head / P; two
//       all-reduces of tokens x H per layer (ring: 2(P-1)/P of the bytes over NVLink).
//   EP: whole attention weights (data-parallel attention), the busiest rank's touched whole
//       experts (mean m = E/P (1-(1-k/E)^T), busiest m + sqrt(m), at most E/P), the KV of its
//       own ceil(B/P) sequences with all heads, the whole LM head; dispatch and combine
//       all-to-alls of its tokens x k x (P-1)/P rows of H (ep_exchange_s: over n > 1 nodes,
//       NVLink within and the NIC across, side by side).
//   TEP (TP attention, EP experts): TP's attention, KV, LM head and all-reduces (the experts'
//       combine is the all-reduce TP already does), EP's expert term (experts_s) over every
//       token of the step;
//   dcp d (TP attention): the KV read divided by d, plus dcp_exchange_s a layer.
//   touched experts of T tokens: E (1 - (1 - k/E)^T).
// With hardware().collectives cited, the collectives are step_collectives.hpp's instead
// (decode_step_collectives_s: TP's all-reduces and DCP's exchange, EP's dispatch and combine of
// the rank's tokens x k rows, at P = 16 DeepEP's across two nodes). Over several nodes
// (num_nodes > 1) only EP prices: TP attention stays within a node (price each TP replica on a
// one-node model of its P / num_nodes ranks).
// So TP wins at small batch (it streams 1/P of every weight), and EP at large batch and long
// contexts when H_kv < P (TP reads and stores replicated KV heads): DESIGN.md §7's regime.
// A switch is priced with moebius::cost_model over switch_link: the priced model's expert bytes
// leaving each rank, plus the report's KV bytes scaled by priced/run KV bytes per token; a
// switch refused for capacity (nothing moved) as 0, a failed one at its measured time.
// A step during a progressive switch, with `slowdown` (by default the measured H200 curve,
// overlap_curve.hpp): max(step x slowdown(step, bytes), the copies at the link rate), the
// copies beside the step as a GPU runs them; without a curve: the copies, then the step.
// KV bytes a token takes on its EP rank in the pool `g` (every layer, K and V, all KV heads):
// the run_kv_bytes_per_token h200_step_model scales a switch's KV bytes by.
inline int64_t kv_bytes_per_token(const moebius::kv_geometry& g) {
  return g.num_tensors() * g.heads_per_ep_page() * g.head_bytes();
}

class h200_step_model final : public step_clock {
 public:
  // `run_kv_bytes_per_token`: KV bytes per token of the model actually run (all layers, K and
  // V, all heads), to scale a switch's KV bytes; `num_ranks` the P being priced; `slowdown`:
  // the overlap curve (nullptr: none, copies and steps priced one after the other).
  h200_step_model(priced_model m, h200_params hw, int num_ranks, int64_t run_kv_bytes_per_token,
                  const overlap_slowdown_curve* slowdown = &overlap_slowdown_curve::h200());

  double step_s(const step_cost& cost, double measured_s) const override;
  double switch_s(const moebius::switch_report& report) const override;
  // "modelled H200", and with a curve where it comes from.
  const char* name() const override { return name_.c_str(); }
  bool needs_measurement() const override { return false; }
  // Bytes per layer of the run: the priced switch (expert bytes leaving the busiest rank,
  // (P-1)/P of its share, every priced layer: Qwen3-30B-A3B bf16, P=2: 48 x 301,989,888 B;
  // plus the run's KV scaled as in switch_s()) divided by the run's layers, so a run of 4
  // layers advances in 4 moves of 12 priced layers each; the link at nvlink.
  int64_t layer_bytes(const moebius::layer_bytes& run, int64_t run_layers) const override;
  moebius::link_rate link() const override { return hw_.nvlink; }
  // The copies at the link rate.
  double copies_s(const switch_copies& copies) const override;
  // The curve (pacing), when there is one.
  overlap_slowdown slowdown() const override;
  // As switch_s() would price the switch that moves `run`: the priced experts and the run's KV
  // scaled to the priced model, through moebius::cost_model over switch_link.
  double predicted_switch_s(const moebius::layer_bytes& run, int64_t run_layers) const override;
  // The run's KV alone, scaled as above (no priced expert moves).
  double predicted_kv_switch_s(const moebius::layer_bytes& run,
                               int64_t run_layers) const override;

  // The model alone: a step of `batch` sequences decoding one token each at `context` tokens.
  double decode_step_s(const configuration& config, int64_t batch, double context) const;
  // The experts' term of a step of `tokens` tokens, in seconds: the expert weights the busiest
  // rank reads over the HBM rate (TP: every touched expert's I/P slice; EP and TEP: its E/P
  // whole experts, touched ones at the busiest rank, mean m + sqrt(m), at most E/P).
  double experts_s(moebius::parallel_mode experts, double tokens) const;
  // One layer's decode context parallel exchange for `tokens` tokens at degree `dcp` (0 when
  // dcp is 1), within each set of dcp ranks, bf16 activations, fp32 log-sum-exps, hq = Hq/P:
  // a q all-gather ((d-1) T hq D 2 B) and vLLM's two merge collectives (an LSE all-gather,
  // (d-1) T d hq 4 B, and a reduce-scatter of the outputs, (d-1) T hq D 2 B): three latencies
  // (collective_us) plus the bytes at the NVLink rate (nvlink), as bench_rank_share prices them.
  //   Qwen3-235B, P 8, dcp 2, T 64: 3 x 10 us + 266,240 B / 389 GB/s = 30.68 us.
  double dcp_exchange_s(double tokens, int64_t dcp) const;
  // One layer's dispatch (or combine) of `rank_tokens` tokens a rank, on the link model, each
  // token's k rows of H (weight_bytes each):
  //   one node:  collective_us + rank_tokens x k x (P-1)/P x H x B / nvlink
  //   n nodes:   internode_collective_us + max(within / nvlink, across / internode), with
  //              within = rank_tokens x k x n (P/n - 1)/P rows (to the node's other ranks, and
  //              those the NIC brought in forwarded to them), across = rank_tokens x r rows,
  //              r = (n - 1)(1 - C(E - E/n, k) / C(E, k)) the other nodes a token's experts
  //              touch (one copy a node, forwarded there over NVLink: DeepEP's normal kernels)
  //   Qwen3-235B, P 16, 2 nodes, 32 tokens: r = 0.996904; within 32 x 8 x 14/16 x 8,192 B =
  //   1,835,008 B (4.717 us), across 32 x 0.996904 x 8,192 B = 261,332 B (5.227 us): 25.127 us.
  double ep_exchange_s(double rank_tokens) const;
  // The other nodes one token's k of E experts touch, over num_nodes nodes (0 on one node).
  double remote_nodes_per_token() const;
  const priced_model& model() const { return m_; }
  const h200_params& hardware() const { return hw_; }
  int num_ranks() const { return num_ranks_; }

 private:
  double time_s(const configuration& config, double sequences, double tokens,
                double context_tokens) const;
  // The step's collectives (per hardware().collectives), `own_share` the EP rank's share of
  // its tokens.
  double collectives_s(const configuration& config, double tokens, double own_share) const;
  // `experts_move`: false for a switch of the KV alone (the priced experts stay).
  double priced_switch_s(int64_t run_kv_bytes, int64_t kv_rounds, bool experts_move) const;
  // predicted_switch_s and predicted_kv_switch_s: the run's per-layer bytes, priced.
  double predicted_s(const moebius::layer_bytes& run, int64_t run_layers, bool experts_move) const;

  priced_model m_;
  h200_params hw_;
  int num_ranks_;
  int64_t run_kv_bytes_per_token_;
  const overlap_slowdown_curve* slowdown_;
  std::string name_;
};

std::ostream& operator<<(std::ostream& os, const priced_model& m);

}  // namespace mini_engine
