#pragma once

// What the decode-step benchmarks (bench_step.cu, bench_hybrid_step.cu) feed the runtime: B
// sequences that each hold `context` tokens of KV and decode one more, with page tables for
// either mode, and the environment knobs they read.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <moebius/kv/page_table.hpp>
#include <vector>

#include <cuda_runtime.h>

#include "gpu_runtime.hpp"
#include "step.hpp"

namespace mini_engine::gpu::bench {

inline int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return (v == nullptr || *v == '\0') ? fallback : std::strtoll(v, nullptr, 10);
}

// A comma-separated list of numbers ("1,16,64"), or `fallback` when unset.
inline std::vector<double> env_list(const char* name, std::vector<double> fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  std::vector<double> out;
  std::stringstream ss(v);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::strtod(item.c_str(), nullptr));
  return out;
}

// The benchmarks' model: Qwen3-30B-A3B shapes, MOEBIUS_BENCH_LAYERS layers (default 48).
inline model_config bench_model() {
  model_config c = qwen3_30b_a3b();
  c.num_layers = env_int("MOEBIUS_BENCH_LAYERS", c.num_layers);
  return c;
}

// NCCL multicast off (it can take a shared host's GPUs out of service) and whether there is a
// GPU to measure (else the benchmark prints so and exits 0).
inline bool prepare_gpu_bench() {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: nothing to measure\n");
    return false;
  }
  return true;
}

// B sequences of `tokens` tokens (the decode token's slot included): in EP round-robin owners
// with EP pages, in TP every rank with its TP pages; pages handed out in order.
// Page tables under construction: per rank its sequences and its next free page.
struct table_builder {
  explicit table_builder(const moebius::kv_geometry& geometry)
      : g(geometry), per_rank(static_cast<size_t>(g.num_ranks)),
        next_page(static_cast<size_t>(g.num_ranks), 0) {}
  // Sequence `id` of `tokens` tokens on rank `owner` (every rank: owner < 0), on fresh pages.
  void add(int64_t id, int64_t tokens, int owner) {
    const int64_t pages = moebius::pages_for_tokens(tokens, g.page_size);
    for (int r = 0; r < g.num_ranks; ++r) {
      if (owner >= 0 && r != owner) continue;
      moebius::kv_sequence s;
      s.seq_id = id;
      s.num_tokens = tokens;
      s.last_page_len = tokens - (pages - 1) * g.page_size;
      for (int64_t p = 0; p < pages; ++p) s.pages.push_back(next_page[static_cast<size_t>(r)]++);
      per_rank[static_cast<size_t>(r)].push_back(std::move(s));
    }
  }
  moebius::kv_state build(moebius::parallel_mode m) {
    return moebius::make_kv_state(g, m, std::move(per_rank));
  }

  const moebius::kv_geometry& g;
  std::vector<std::vector<moebius::kv_sequence>> per_rank;
  std::vector<int64_t> next_page;
};

inline moebius::kv_state make_tables(const moebius::kv_geometry& g, moebius::parallel_mode m,
                                     int64_t B, int64_t tokens) {
  table_builder t(g);
  for (int64_t b = 0; b < B; ++b)
    t.add(b, tokens, m == moebius::parallel_mode::ep ? static_cast<int>(b % g.num_ranks) : -1);
  return t.build(m);
}

// One decode token per sequence 0..B-1 at position `context`; `tokens` holds them and must
// outlive the items.
inline std::vector<step_item> decode_items(int64_t B, int64_t context, int64_t vocab,
                                           std::vector<int32_t>& tokens) {
  tokens.assign(static_cast<size_t>(B), 0);
  std::vector<step_item> items(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    tokens[static_cast<size_t>(b)] = static_cast<int32_t>((b * 7919) % vocab);
    items[static_cast<size_t>(b)] = {b, {&tokens[static_cast<size_t>(b)], 1}, context, true};
  }
  return items;
}

// The runtime the decode benchmarks measure: `P` ranks, bf16 dense weights, the environment's
// knobs (options_from_env), CUDA graphs for exactly `buckets`, and a KV pool per rank that holds
// the largest bucket's sequences of `context` + 1 tokens in either mode (EP: max / P sequences a
// rank; TP: every sequence on every rank, min(H_kv, P) TP pages per EP page).
inline gpu_runtime_options decode_options(const model_config& c, int P,
                                          std::vector<int64_t> buckets, int64_t context) {
  gpu_runtime_options o = options_from_env();
  std::sort(buckets.begin(), buckets.end());
  const int64_t max_batch = buckets.back();
  o.num_ranks = P;
  o.dense_dtype = moebius::dtype::bf16;
  o.max_tokens = max_batch;
  o.buckets = std::move(buckets);
  const int64_t pages_per_seq = moebius::pages_for_tokens(context + 1, c.page_size);
  o.max_pages_per_seq = pages_per_seq;
  const int64_t split = std::min<int64_t>(c.num_kv_heads, P);
  o.num_ep_pages = std::max((max_batch + P - 1) / P * pages_per_seq,
                            (max_batch * pages_per_seq + split - 1) / split);
  return o;
}

}  // namespace mini_engine::gpu::bench
