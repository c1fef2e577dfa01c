#pragma once

// A deployment as the paper ran it (Moebius §9.1; DESIGN.md §8): a model on P GPUs of a given
// memory, a memory fraction for weights + KV, and what each layout holds per rank: its weights,
// the KV pool left beside them, and that pool in tokens and in sequences of a given length.
//
//   static EP   E/P whole experts, the whole attention (data-parallel attention) and the dense
//               weights; KV of a rank's own sequences, all H_kv heads: the deployment holds P
//               pools of distinct tokens
//   static TP   every expert's I/P slice, the attention's head slice (q/o by P; k/v by P, or
//               one replicated KV head per rank when H_kv < P) and the dense weights; KV of
//               every sequence for its heads: the deployment holds one pool of tokens
//   switching   Moebius: EP's footprint (the whole attention, which EP needs) plus the arena's
//               spare slot; one KV pool read in either layout (EP: a rank's own sequences;
//               TP: every sequence, its heads)
//
// Weights per rank come from moebius::make_memory_budget (the library's own accounting). Not
// counted: activations, CUDA graphs, the allocator's fragmentation (the memory fraction leaves
// them their room, as SGLang's mem_fraction_static does).

#include <cstdint>
#include <iosfwd>
#include <moebius/layout/parallel_mode.hpp>

#include "model_config.hpp"

namespace mini_engine {

enum class deployment_kind : uint8_t { static_tp, static_ep, switching };
const char* to_string(deployment_kind k);

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
  // Tokens the deployment holds: P x the rank's pool in EP (distinct sequences per rank),
  // one rank's pool in TP (every rank holds every sequence).
  int64_t tokens = 0;
  // Sequences of `context` tokens the deployment holds, at most max_running (EP: per rank
  // floor(pool / sequence), times P).
  int64_t sequences(int64_t context) const;

  moebius::parallel_mode mode = moebius::parallel_mode::ep;
  int num_ranks = 1;
  int64_t max_running = 0;
};

struct deployment {
  deployment_kind kind = deployment_kind::switching;
  model_config model;
  deployment_options options;
  layout_capacity ep, tp;  // a static deployment serves in one of them only

  const layout_capacity& in(moebius::parallel_mode m) const {
    return m == moebius::parallel_mode::ep ? ep : tp;
  }
};

// Throws moebius::error(errc::invalid_argument) naming the constraint unless the model splits
// over P (validate), the memory fraction is in (0, 1] and the device bytes are > 0.
deployment make_deployment(const model_config& model, deployment_kind kind,
                           const deployment_options& options = {});

// "static EP: 72.7 GB of weights and 55.4 GB of KV a rank, 288k tokens a rank (2.30M in
// all), 140 sequences of 16k; ..." one line per layout it serves in.
std::ostream& operator<<(std::ostream& os, const deployment& d);

}  // namespace mini_engine
