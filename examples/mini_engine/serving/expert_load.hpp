#pragma once

// The expert load of the busiest EP rank: what the one-rank emulation of the step curves
// (gpu/bench_rank_share.cu) cannot see, priced onto its curves.
//
// A decode step of B tokens routes each to top_k of E experts; E/P whole experts live on each
// rank (expert e on rank e / (E/P)), and an EP step waits for the rank that reads the most
// distinct experts' weights (at small batch the step's cost is those reads). The bench's rank
// routes only its own tokens over its own E/P experts:
//   data-parallel attention (EP)  its ceil(B/P) tokens, top-k' of its E/P (k' = k: 8 of 16),
//                                 so at batch 1 it reads 8 experts where the busiest real rank
//                                 holds about 2.5 of the token's 8 (pessimistic), and from 8 to
//                                 64 it misses the imbalance (optimistic);
//   TP attention (TEP)            all B tokens, top-k'' of its E/P (k'' = k/P: 1 of 16): at
//                                 batch 1 one expert where the busiest rank reads about 2.5.
// The busiest rank's distinct experts under a routing model, by Monte Carlo (fixed seed, so
// every run prices alike):
//   uniform (skew 0)  every expert equally likely: the busiest rank reads 2.53x the mean
//                     distinct experts at 1 token, 1.44x at 8, 1.25x at 16, 1.12x at 32,
//                     1.02x at 64 (Qwen3-235B: E 128, top-8, P 8);
//   skew s > 0        expert popularity proportional to (its rank in a fixed random order)^-s
//                     (Zipf), top_k drawn without replacement in proportion. Real routers are
//                     more skewed than uniform, which concentrates the pairs (compute) but
//                     reads fewer distinct experts in all: for the weight reads priced here
//                     uniform is the heavier case from a few tokens on. No checkpoint's router
//                     statistics are used (the default is uniform; the skew is a parameter).
// The price: each expert read more (or fewer) than the emulated rank read costs its weights at
// the HBM rate in every layer (expert_load_shift_ms). Compute of the pairs is not repriced
// (at small batch the weight reads dominate; from 64 tokens every expert is read on every
// rank and the shift is 0 under uniform routing).

#include <cstdint>

namespace mini_engine {

struct routing_model {
  double skew = 0;  // 0: uniform; > 0: Zipf popularity exponent (see above)
};

// Expected distinct experts read by the busiest of P ranks in a step of `tokens` tokens, each
// routed to top_k of `experts` experts (experts / ranks on each), under `routing`; Monte Carlo
// over `samples` steps, memoised per argument set. Throws errc::invalid_argument naming a
// non-positive count, top_k > experts, experts not a multiple of ranks, or a skew < 0 or not
// finite.
double busiest_rank_experts(int64_t tokens, int64_t experts, int ranks, int64_t top_k,
                            const routing_model& routing = {}, int samples = 4000);

// Expected distinct experts of the mean rank under uniform routing:
// experts / ranks x (1 - (1 - top_k / experts)^tokens).
double mean_rank_experts(int64_t tokens, int64_t experts, int ranks, int64_t top_k);

// Expected distinct experts the bench's emulated rank reads at deployment batch B (see the top):
// tp_attention false: (E/P)(1 - (1 - k'/(E/P))^ceil(B/P)), k' = min(E/P, k);
// true (TEP):         (E/P)(1 - (1 - k''/(E/P))^B), k'' = min(E/P, max(1, round(k/P))).
double emulated_rank_experts(bool tp_attention, int64_t batch, int64_t experts, int ranks,
                             int64_t top_k);

// ms to add to an EP-experts step curve at batch B: (busiest - emulated) x layers x
// expert_bytes / hbm_bytes_per_s (negative where the emulation read more).
double expert_load_shift_ms(bool tp_attention, int64_t batch, int64_t experts, int ranks,
                            int64_t top_k, int64_t layers, double expert_bytes,
                            double hbm_bytes_per_s, const routing_model& routing = {});

}  // namespace mini_engine
