#pragma once

// A deterministic stand-in for a model runtime, for developing and testing the serving loop
// without a model: its "next token" is a hash of what it reads back from the KV pool through
// the page tables, so tokens stay equal across switches only if the switcher moved every
// live K byte it wrote to where the tables say. Per new token it writes, on every rank that
// holds the token's head slice (EP: the owner, TP: each rank its slice), one float per
// (layer, KV head) into dim 0 of K: a fingerprint of (token id, position, layer, head). To
// sample, it reads every fingerprint of the sequence back (TP: from the LAST replica of each
// head, so replicas are exercised) and hashes them with the position.
//
// KV dtype must be fp32. The arena is allocated (for the switcher) but never read.

#include <cstddef>
#include <cstdint>
#include <vector>

#include <moebius/kv/kv_geometry.hpp>
#include <moebius/layout/arena_geometry.hpp>
#include <moebius/memory/rank_memory.hpp>

#include "step.hpp"

namespace mini_engine {

class fake_runtime final : public synchronous_runtime {
 public:
  // Throws errc::invalid_argument unless kv.type is fp32, the rank counts agree and the
  // layer counts agree.
  fake_runtime(const moebius::arena_geometry& arena, const moebius::kv_geometry& kv,
               int32_t vocab);

  int64_t vocab_size() const override { return vocab_; }

  std::vector<moebius::rank_memory> memory();
  const moebius::arena_geometry& arena() const { return arena_; }
  const moebius::kv_geometry& kv() const { return kv_; }

 protected:
  std::vector<int32_t> compute(const step_layout& layout, std::span<const step_item> items,
                               std::vector<std::vector<float>>* logits) override;

 private:
  float* k_at(int rank, moebius::parallel_mode m, int64_t layer, int64_t page, int64_t head_in_page,
              int64_t token_in_page);

  moebius::arena_geometry arena_;
  moebius::kv_geometry kv_;
  int32_t vocab_;
  std::vector<std::vector<std::byte>> arenas_, pools_;
};

}  // namespace mini_engine
