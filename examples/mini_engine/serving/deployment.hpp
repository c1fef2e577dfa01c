#pragma once

// A deployment as the paper ran it (Moebius §9.1; DESIGN.md §8): a model on P GPUs of a given
// memory, a memory fraction for weights + KV, and what each layout it serves in holds per rank:
// its weights, the KV pool left beside them, and that pool in tokens and in sequences of a given
// length. Eight deployments, four static configurations and four switching designs
// (configuration.hpp names the layouts; dcp 2 is what Qwen3-235B allows at P = 8):
//
//   static TP        every expert's I/P slice, the attention's head slice (q/o by P; k/v by P,
//                    or one replicated KV head per rank when H_kv < P) and the dense weights
//                    vocab-parallel (1/P); KV of every sequence for its heads: the deployment
//                    holds one pool of tokens
//   static TP-DCP2   TP's weights; the ranks sharing a KV head split its tokens (dcp 2), so the
//                    same pool holds twice TP's tokens
//   static EP        E/P whole experts, the whole attention (data-parallel attention) and the
//                    dense weights; KV of a rank's own sequences, all H_kv heads: P pools of
//                    distinct tokens
//   static TEP-DCP2  TP attention (dcp 2) with EP experts: TP's weights (E/P whole experts are
//                    the bytes of every expert's I/P slice), TP-DCP2's KV
//   switching        (the paper's design: EP <-> TP) EP's footprint (the whole attention, which
//                    EP needs) plus the arena's spare slot; one KV pool read in either layout
//                    (EP: a rank's own sequences; TP: every sequence, its heads)
//   switching DCP2   EP <-> TP-DCP2: the same footprint as `switching`, its TP view with dcp 2
//                    (the same pool holds as many tokens in either layout when H_kv / P = 1/2)
//   experts only     TP-DCP2 attention always, experts EP <-> TP: TP's attention slice and
//                    vocab-parallel dense weights plus the arena with its spare slot; the KV
//                    never moves, a switch moves expert weights alone
//   dcp only         TP attention and experts always, the KV's dcp 2 <-> 1: static TP's
//                    footprint and pool (no spare slot: no expert moves); at dcp 2 it holds
//                    static TP-DCP2's tokens, at dcp 1 static TP's; a switch to dcp 2 moves no
//                    byte, back to dcp 1 copies each live page once (kv/dcp_change.hpp)
//
// Each layout is held under the switch policy's mode that selects it (the policy proposes EP for
// a large load, TP for a small one): `ep` the large-batch layout (EP, TEP-DCP2), `tp` the
// small-batch one (TP, TP-DCP2; dcp only: TP-DCP2 and TP). A static deployment fills the one it
// serves in.
//
// Weights per rank come from moebius::make_memory_budget (the library's own accounting). Not
// counted: activations, CUDA graphs, the allocator's fragmentation (the memory fraction leaves
// them their room, as SGLang's mem_fraction_static does), DCP's exchange buffers.

#include <cstdint>
#include <iosfwd>
#include <vector>

#include <moebius/layout/parallel_mode.hpp>

#include "configuration.hpp"
#include "model_config.hpp"

namespace mini_engine {

enum class deployment_kind : uint8_t {
  static_tp,
  static_ep,
  switching,  // the paper's design: EP <-> TP
  static_tp_dcp2,
  static_tep_dcp2,
  switching_dcp2,  // EP <-> TP-DCP2
  experts_only,    // TEP-DCP2 <-> TP-DCP2
  dcp_only,        // TP-DCP2 <-> TP on static TP's footprint
};
// "static TP", "static EP", "switching", "static TP-DCP2", "static TEP-DCP2", "switching DCP2",
// "experts only", "dcp only".
const char* to_string(deployment_kind k);
// The KV's decode context parallel degree of the deployment as it starts (its large-batch
// layout's): 2 for the DCP2 kinds and dcp only, else 1.
int64_t dcp_of(deployment_kind k);

struct deployment_options {
  int num_ranks = 8;                         // P
  double device_bytes = 143771.0 * 1048576;  // an H200 as it reports itself: 143,771 MiB
  double memory_fraction = 0.85;             // weights + KV (the paper's SGLang setting)
  int64_t max_running = 2048;                // the paper's limit on running requests
};

// One layout's share of a rank, and its KV pool in tokens.
struct layout_capacity {
  int64_t weight_bytes = 0;        // per rank
  int64_t kv_pool_bytes = 0;       // per rank: fraction x device - weights (0 when negative)
  int64_t kv_bytes_per_token = 0;  // per rank, all layers, K and V, the heads it holds
  // Tokens the deployment holds: P x the rank's pool in EP (distinct sequences per rank), dcp x
  // one rank's pool in TP (every sequence on every replica set of dcp ranks, each rank holding
  // 1/dcp of its tokens), times the TP replicas.
  int64_t tokens = 0;
  // Sequences of `context` tokens the deployment holds, at most max_running (EP: per rank
  // floor(pool / sequence), times P; TP: floor(dcp x pool / sequence) a replica, times the
  // replicas).
  int64_t sequences(int64_t context) const;

  configuration config;  // the layout and dcp
  moebius::parallel_mode attention() const { return config.layout.attention; }
  int num_ranks = 1;  // P (TP: of one replica)
  int64_t max_running = 0;
  // TP: copies of the layout side by side, each on its own P ranks serving its own sequences
  // (one a node past one node: node_deployment.hpp); 1 everywhere else.
  int64_t replicas = 1;
};

struct deployment {
  deployment_kind kind = deployment_kind::switching;
  model_config model;
  deployment_options options;
  // The layout each of the policy's modes selects, and what it holds there; a static deployment
  // fills the one it serves in (the other's kv_bytes_per_token is 0).
  layout_capacity ep, tp;

  const layout_capacity& in(moebius::parallel_mode m) const {
    return m == moebius::parallel_mode::ep ? ep : tp;
  }
  bool serves(moebius::parallel_mode m) const { return in(m).kv_bytes_per_token > 0; }
  // The layouts it serves in, the large-batch one first: one (static) or two (switching).
  std::vector<layout_capacity> layouts() const;
  // The layout each policy mode runs in (an unserved mode keeps its uniform layout).
  mode_layouts modes() const;
  // A static deployment's one mode; a switching one's: EP.
  moebius::parallel_mode start_mode() const;
};

// Throws moebius::error(errc::invalid_argument) naming the constraint unless the model splits
// over P (validate), the memory fraction is in (0, 1] and the device bytes are > 0.
deployment make_deployment(const model_config& model, deployment_kind kind,
                           const deployment_options& options = {});

// "static EP (P=8, 85% of 150.8 GB): EP 72.8 GB of weights and 55.4 GB of KV a rank, 192.5 KB
// a token: 2.30M tokens in all, ..."; each layout it serves in by its configuration's name.
std::ostream& operator<<(std::ostream& os, const deployment& d);

}  // namespace mini_engine
