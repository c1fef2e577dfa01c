#pragma once

// An independent float64 forward of the mini-engine's model from its logical weights: no
// arena, no KV pool, no ranks. It recomputes each sequence from all its tokens, in the
// textbook order, to check the runtimes against.

#include <cstdint>
#include <span>
#include <vector>

#include "weights.hpp"

namespace mini_engine {

// Logits [T][V] of every position of one sequence of T tokens (position t sees tokens
// 0..t). K and V are rounded to the config's kv_dtype as the cache would store them; the
// experts are used as `w` holds them (already rounded to their dtype). Everything else is
// double.
std::vector<std::vector<double>> reference_logits(const model_weights& w,
                                                  std::span<const int32_t> tokens);

// The greedy continuation: `steps` tokens, each the argmax (lowest index on ties) of the
// logits at the end of `prompt` + what was generated so far.
std::vector<int32_t> reference_generate(const model_weights& w, std::span<const int32_t> prompt,
                                        int64_t steps);

}  // namespace mini_engine
