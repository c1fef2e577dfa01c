#include "step_clock.hpp"

#include <algorithm>
#include <cmath>
#include <ostream>

#include <moebius/error.hpp>
#include <moebius/policy/cost_model.hpp>

#include "step_collectives.hpp"

namespace mini_engine {

using moebius::errc;
using moebius::parallel_mode;

h200_step_model::h200_step_model(priced_model m, h200_params hw, int num_ranks,
                                 int64_t run_kv_bytes_per_token,
                                 const overlap_slowdown_curve* slowdown)
    : m_(m),
      hw_(hw),
      num_ranks_(num_ranks),
      run_kv_bytes_per_token_(run_kv_bytes_per_token),
      slowdown_(slowdown),
      name_(slowdown != nullptr
                ? std::string("modelled H200; steps beside a progressive switch's copies by the "
                              "measured slowdown curve (") +
                      overlap_slowdown_curve::h200_source() + ")"
                : std::string("modelled H200")) {
  MOEBIUS_CHECK(num_ranks >= 1 && m.num_experts % num_ranks == 0 && m.top_k >= 1 &&
                    m.top_k <= m.num_experts && m.num_kv_heads >= 1 && m.context_scale > 0 &&
                    hw.hbm.bytes_per_s > 0 && hw.nvlink.bytes_per_s > 0 &&
                    run_kv_bytes_per_token > 0,
                errc::invalid_argument,
                "h200_step_model: need P | E, 1 <= top_k <= E, H_kv >= 1, positive rates and "
                "scales (P=", num_ranks, ", E=", m.num_experts, ", top_k=", m.top_k, ")");
  MOEBIUS_CHECK(hw.num_nodes >= 1 && num_ranks % hw.num_nodes == 0, errc::invalid_argument,
                "h200_step_model: num_nodes must be >= 1 and divide P (num_nodes=", hw.num_nodes,
                ", P=", num_ranks, ")");
  MOEBIUS_CHECK(hw.num_nodes == 1 || (std::isfinite(hw.internode.bytes_per_s) &&
                                      hw.internode.bytes_per_s > 0 &&
                                      std::isfinite(hw.internode_collective_us) &&
                                      hw.internode_collective_us >= 0),
                errc::invalid_argument,
                "h200_step_model: over ", hw.num_nodes, " nodes the internode rate must be > 0 "
                "and internode_collective_us >= 0 (internode=", hw.internode.gb_per_s(),
                " GB/s, internode_collective_us=", hw.internode_collective_us, ")");
  moebius::validate(hw.switch_link);
}

double h200_step_model::remote_nodes_per_token() const {
  const int n = hw_.num_nodes;
  if (n == 1) return 0;
  // The chance that none of a token's k distinct experts lies on a given other node: the
  // E - E/n experts elsewhere hold all k.
  const double E = static_cast<double>(m_.num_experts), per_node = E / n;
  double none = 1;
  for (int64_t i = 0; i < m_.top_k; ++i)
    none *= std::max(0.0, (E - per_node - static_cast<double>(i)) / (E - static_cast<double>(i)));
  return (n - 1) * (1 - none);
}

double h200_step_model::ep_exchange_s(double rank_tokens) const {
  const double P = num_ranks_, n = hw_.num_nodes, k = static_cast<double>(m_.top_k);
  const double row = static_cast<double>(m_.hidden * m_.weight_bytes);
  const double within = rank_tokens * k * n * (P / n - 1) / P * row / hw_.nvlink.bytes_per_s;
  if (hw_.num_nodes == 1) return hw_.collective_us * 1e-6 + within;
  const double across = rank_tokens * remote_nodes_per_token() * row / hw_.internode.bytes_per_s;
  return hw_.internode_collective_us * 1e-6 + std::max(within, across);
}

double h200_step_model::collectives_s(const configuration& config, double tokens,
                                      double own_share) const {
  const double L = static_cast<double>(m_.num_layers);
  const bool tp_attention = config.layout.attention == parallel_mode::tp;
  if (hw_.collectives == collective_pricing::cited) {
    decode_step_shape s;
    s.tp_attention = tp_attention;
    s.dcp = config.dcp;
    s.batch = static_cast<int64_t>(std::ceil(tokens));
    s.rank_pairs = tp_attention ? 0 : static_cast<int64_t>(std::ceil(tokens * own_share)) * m_.top_k;
    s.num_ranks = num_ranks_;
    s.layers = m_.num_layers;
    s.hidden = m_.hidden;
    s.q_heads = m_.num_q_heads;
    s.head_dim = m_.head_dim;
    return decode_step_collectives_s(s, collective_pricing::cited);
  }
  if (!tp_attention) return L * 2 * ep_exchange_s(tokens * own_share);
  const double P = num_ranks_, H = static_cast<double>(m_.hidden);
  const double wb = static_cast<double>(m_.weight_bytes);
  // TEP's experts combine in the all-reduce TP already does: no dispatch.
  return L * 2 * (2 * (P - 1) / P * tokens * H * wb / hw_.nvlink.bytes_per_s +
                  hw_.collective_us * 1e-6) +
         L * dcp_exchange_s(tokens, config.dcp);
}

double h200_step_model::experts_s(parallel_mode experts, double tokens) const {
  const double P = num_ranks_, L = static_cast<double>(m_.num_layers);
  const double H = static_cast<double>(m_.hidden), I = static_cast<double>(m_.intermediate);
  const double E = static_cast<double>(m_.num_experts), k = static_cast<double>(m_.top_k);
  const double expert_bytes = 3 * H * I * static_cast<double>(m_.weight_bytes);
  const double untouched = std::pow(1 - k / E, tokens);
  if (experts == parallel_mode::tp) return L * E * (1 - untouched) * expert_bytes / P / hw_.hbm.bytes_per_s;
  const double mean = E / P * (1 - untouched);
  return L * std::min(E / P, mean + std::sqrt(mean)) * expert_bytes / hw_.hbm.bytes_per_s;
}

double h200_step_model::dcp_exchange_s(double tokens, int64_t dcp) const {
  if (dcp <= 1) return 0;
  decode_step_shape s;
  s.dcp = dcp;
  s.batch = static_cast<int64_t>(std::ceil(tokens));
  s.num_ranks = static_cast<int>(num_ranks_);
  s.layers = m_.num_layers;
  s.hidden = m_.hidden;
  s.q_heads = m_.num_q_heads;
  s.head_dim = m_.head_dim;
  link_model link;
  link.latency_s = hw_.collective_us * 1e-6;
  link.allreduce_bytes_per_s = hw_.nvlink.bytes_per_s;
  return dcp_exchange_layer_s(s, collective_pricing::link, link);
}

double h200_step_model::time_s(const configuration& config, double sequences, double tokens,
                               double context_tokens) const {
  MOEBIUS_CHECK(is_named(config), errc::invalid_argument, "h200_step_model: no price for ",
                name_of(config), " (TP or TEP with a dcp, or EP)");
  MOEBIUS_CHECK(hw_.num_nodes == 1 || config.layout.attention == parallel_mode::ep,
                errc::invalid_argument, "h200_step_model: ", name_of(config), " over ",
                hw_.num_nodes, " nodes: TP attention stays within a node (price each replica "
                "on a one-node model of its ranks)");
  const double P = num_ranks_, L = static_cast<double>(m_.num_layers);
  const double H = static_cast<double>(m_.hidden), D = static_cast<double>(m_.head_dim);
  const double Hq = static_cast<double>(m_.num_q_heads), Hkv = static_cast<double>(m_.num_kv_heads);
  const double E = static_cast<double>(m_.num_experts), k = static_cast<double>(m_.top_k);
  const double I = static_cast<double>(m_.intermediate), V = static_cast<double>(m_.vocab);
  const double wb = static_cast<double>(m_.weight_bytes), kvb = static_cast<double>(m_.kv_bytes);
  const double expert_bytes = 3 * H * I * wb;
  const double ctx = context_tokens * m_.context_scale;
  const double hbm = hw_.hbm.bytes_per_s;
  const double untouched = std::pow(1 - k / E, tokens);
  double bytes = 0, collectives = 0;
  if (config.layout.attention == parallel_mode::tp) {
    const double heads = std::max(Hkv / P, 1.0);  // KV heads per rank; replicated when H_kv < P
    bytes += L * (2 * Hq * D * H / P + 2 * heads * D * H) * wb;
    if (config.layout.experts == parallel_mode::tp) {
      bytes += L * E * (1 - untouched) * expert_bytes / P;
    } else {  // TEP: every token on every rank, its E/P whole experts (the busiest rank's)
      const double mean = E / P * (1 - untouched);
      bytes += L * std::min(E / P, mean + std::sqrt(mean)) * expert_bytes;
    }
    // dcp: each rank reads its 1/dcp of every sequence's tokens of its head.
    bytes += ctx * L * 2 * heads * D * kvb / static_cast<double>(config.dcp);
    bytes += V * H * wb / P;
    collectives = collectives_s(config, tokens, 1);
  } else {
    const double own_seqs = std::ceil(sequences / P);
    const double own_share = sequences > 0 ? own_seqs / sequences : 0;
    const double mean = E / P * (1 - untouched);
    bytes += L * (2 * Hq * D * H + 2 * Hkv * D * H) * wb;
    bytes += L * std::min(E / P, mean + std::sqrt(mean)) * expert_bytes;
    bytes += ctx * own_share * L * 2 * Hkv * D * kvb;
    bytes += V * H * wb;
    collectives = collectives_s(config, tokens, own_share);
  }
  return bytes / hbm + collectives + hw_.step_overhead_us * 1e-6;
}

std::vector<rank_work> ep_rank_work(const moebius::kv_state& ep_tables,
                                    std::span<const step_item> items) {
  MOEBIUS_CHECK(ep_tables.mode == parallel_mode::ep, errc::invalid_argument,
                "ep_rank_work: the tables are not EP");
  std::vector<rank_work> out(ep_tables.ranks.size());
  // Items by sequence id, then one merge per rank against its tables (sorted by seq_id).
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return items[a].seq_id < items[b].seq_id; });
  std::vector<char> owned(items.size(), 0);
  for (size_t r = 0; r < ep_tables.ranks.size(); ++r) {
    const std::vector<moebius::kv_sequence>& seqs = ep_tables.ranks[r].sequences;
    size_t s = 0;
    for (const size_t i : order) {
      while (s < seqs.size() && seqs[s].seq_id < items[i].seq_id) ++s;
      if (s == seqs.size()) break;
      if (seqs[s].seq_id != items[i].seq_id) continue;
      const int64_t n = static_cast<int64_t>(items[i].tokens.size());
      out[r].sequences += 1;
      out[r].new_tokens += n;
      out[r].context_tokens += items[i].start_position + n;
      owned[i] = 1;
    }
  }
  for (size_t i = 0; i < items.size(); ++i) {
    MOEBIUS_CHECK(owned[i], errc::invalid_argument, "ep_rank_work: no rank holds sequence ",
                  items[i].seq_id);
  }
  return out;
}

double h200_step_model::step_s(const step_cost& c, double) const {
  return time_s(c.config(), static_cast<double>(c.num_sequences),
                static_cast<double>(c.new_tokens), static_cast<double>(c.context_tokens));
}

double h200_step_model::copies_s(const switch_copies& copies) const {
  return static_cast<double>(copies.bytes) / hw_.nvlink.bytes_per_s;
}

overlap_slowdown h200_step_model::slowdown() const {
  if (slowdown_ == nullptr) return {};
  return overlap_slowdown{[](const void* c, double step_s, int64_t bytes) {
                            return static_cast<const overlap_slowdown_curve*>(c)->at(step_s, bytes);
                          },
                          slowdown_};
}

double h200_step_model::decode_step_s(const configuration& config, int64_t batch,
                                      double context) const {
  const double b = static_cast<double>(batch);
  return time_s(config, b, b, b * context);
}

double h200_step_model::priced_switch_s(int64_t kv_sent, int64_t kv_rounds,
                                        bool experts_move) const {
  const moebius::cost_model cost(hw_.switch_link);
  moebius::switch_workload w;
  w.num_ranks = num_ranks_;
  const double P = num_ranks_;
  // Expert bytes of the priced model leaving each rank: (P-1)/P of its share, every layer.
  const double layer_bytes = static_cast<double>(m_.num_experts) * 3.0 *
                             static_cast<double>(m_.hidden * m_.intermediate * m_.weight_bytes) / P;
  w.weight_bytes_per_rank =
      experts_move
          ? static_cast<int64_t>(static_cast<double>(m_.num_layers) * layer_bytes * (P - 1) / P)
          : 0;
  w.weight_phases = experts_move ? m_.num_layers : 0;
  const double priced_kv_per_token = static_cast<double>(m_.num_layers * 2 * m_.num_kv_heads *
                                                         m_.head_dim * m_.kv_bytes);
  w.kv_bytes_per_rank = static_cast<int64_t>(static_cast<double>(kv_sent) * m_.context_scale *
                                             priced_kv_per_token /
                                             static_cast<double>(run_kv_bytes_per_token_));
  w.kv_rounds = kv_rounds;
  return cost.predict(w).total_ms() * 1e-3;
}

double h200_step_model::switch_s(const moebius::switch_report& r) const {
  // Nothing moved: the refusal is the host's planning, not the device's time (charging its
  // measured host time made a priced run depend on the host's speed).
  if (r.outcome == moebius::switch_outcome::refused_capacity ||
      r.outcome == moebius::switch_outcome::already_there)
    return 0;
  if (r.outcome != moebius::switch_outcome::committed) return r.total_ms * 1e-3;
  int64_t kv_sent = 0;
  for (int64_t b : r.kv_bytes_sent) kv_sent = std::max(kv_sent, b);
  // A change of the dcp alone (the layout stays) moves no expert byte; every other switch is
  // priced with the priced model's experts (a report built by hand names no layout).
  const bool dcp_alone = r.from == r.to && r.from_dcp != r.to_dcp;
  return priced_switch_s(kv_sent, r.kv_rounds, !dcp_alone);
}

double h200_step_model::predicted_s(const moebius::layer_bytes& run, int64_t run_layers,
                                    bool experts_move) const {
  MOEBIUS_CHECK(run_layers >= 1, errc::invalid_argument,
                "predicted_switch_s: run_layers must be >= 1");
  // The busiest rank's KV over all layers (each layer moves the same pages), one round per
  // layer: what the switch report of the same switch would say.
  int64_t kv = 0;
  for (int64_t b : run.kv_bytes_sent) kv = std::max(kv, b);
  return priced_switch_s(kv * run_layers, kv > 0 ? run_layers : 0, experts_move);
}

double h200_step_model::predicted_switch_s(const moebius::layer_bytes& run,
                                           int64_t run_layers) const {
  return predicted_s(run, run_layers, true);
}

double h200_step_model::predicted_kv_switch_s(const moebius::layer_bytes& run,
                                              int64_t run_layers) const {
  return predicted_s(run, run_layers, false);
}

int64_t h200_step_model::layer_bytes(const moebius::layer_bytes& run, int64_t run_layers) const {
  MOEBIUS_CHECK(run_layers >= 1, errc::invalid_argument, "layer_bytes: run_layers must be >= 1");
  // The priced switch's busiest-rank bytes (as switch_s() prices a whole switch: experts
  // (P-1)/P of the rank's share, every priced layer; the run's KV scaled to the priced
  // model), spread over the run's layers: one layer of the run stands for L_priced / L_run
  // priced layers.
  const double P = num_ranks_;
  const double experts = static_cast<double>(m_.num_layers * m_.num_experts) * 3.0 *
                         static_cast<double>(m_.hidden * m_.intermediate * m_.weight_bytes) / P *
                         (P - 1) / P;
  int64_t kv = 0;
  for (int64_t b : run.kv_bytes_sent) kv = std::max(kv, b);
  const double priced_kv_per_token = static_cast<double>(m_.num_layers * 2 * m_.num_kv_heads *
                                                         m_.head_dim * m_.kv_bytes);
  const double kv_priced = static_cast<double>(kv * run_layers) * m_.context_scale *
                           priced_kv_per_token / static_cast<double>(run_kv_bytes_per_token_);
  return static_cast<int64_t>((experts + kv_priced) / static_cast<double>(run_layers));
}

std::ostream& operator<<(std::ostream& os, const priced_model& m) {
  return os << "L=" << m.num_layers << " H=" << m.hidden << " Hq=" << m.num_q_heads
            << " Hkv=" << m.num_kv_heads << " D=" << m.head_dim << " E=" << m.num_experts
            << " top-" << m.top_k << " I=" << m.intermediate << " V=" << m.vocab
            << ", context x" << m.context_scale;
}

}  // namespace mini_engine
