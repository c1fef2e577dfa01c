#pragma once

// Random small models for the host-runtime tests: shapes drawn from a few values each, redrawn
// until the model splits over P ranks (validate(c, P)).

#include <cstdint>
#include <initializer_list>
#include <moebius/error.hpp>
#include <random>

#include "model_config.hpp"

namespace mini_engine::testing {

inline int64_t pick(std::mt19937_64& rng, std::initializer_list<int64_t> v) {
  return *(v.begin() + std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng));
}

// fp8 experts use 4x4 blocks, so that the small intermediate sizes hold whole blocks per slice.
inline model_config random_config(std::mt19937_64& rng, int P, moebius::dtype experts,
                                  moebius::dtype kv) {
  for (;;) {
    model_config c;
    c.num_layers = pick(rng, {1, 2, 3});
    c.hidden = pick(rng, {16, 32, 48});
    c.num_q_heads = pick(rng, {4, 8});
    c.num_kv_heads = pick(rng, {1, 2, 4});
    c.head_dim = pick(rng, {4, 8, 16});
    c.num_experts = pick(rng, {4, 8});
    c.top_k = pick(rng, {1, 2, 3});
    c.intermediate = pick(rng, {16, 32});
    c.vocab = pick(rng, {50, 128});
    c.page_size = pick(rng, {1, 2, 4, 8});
    c.expert_dtype = experts;
    c.kv_dtype = kv;
    c.fp8_block = 4;
    try {
      validate(c, P);
      return c;
    } catch (const moebius::error&) {
    }
  }
}

}  // namespace mini_engine::testing
