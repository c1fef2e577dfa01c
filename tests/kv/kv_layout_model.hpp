#pragma once

// An independent model of engine KV layouts for tests: a cache is a row-major array whose
// dimensions (L = layer, K = K|V, P = page, T = token in page, H = head, D = dim) come in some
// order, outer to inner, with optional padding on the dimensions outside the page (the gap
// between two engine buffers). The TP view is the same array with P x split pages of H / split
// heads (what an engine running TP over the same bytes allocates). Offsets are computed here
// from sizes and order alone, sharing nothing with kv_pool_layout but the geometry's fields.
//
//   vLLM FlashInfer, NHD: order "LPKTHD" (per layer (num_blocks, 2, block_size, H, D)).

#include <cstdint>
#include <random>
#include <string>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/kv_pool_layout.hpp"

namespace moebius::testing {

struct layout_model {
  std::string order = "LKPHTD";         // outer -> inner; no 'K' for latent
  int64_t pad[6] = {0, 0, 0, 0, 0, 0};  // extra bytes on the stride of order[i] (outside P only)
  int64_t base = 0;

  int64_t size_of(const kv_geometry& g, parallel_mode m, char c) const {
    int64_t split = 1;
    if (g.num_kv_heads > 0) split = g.num_kv_heads < g.num_ranks ? g.num_kv_heads : g.num_ranks;
    const int64_t H = g.num_kv_heads == 0 ? 1 : g.num_kv_heads;
    switch (c) {
      case 'L':
        return g.num_layers;
      case 'K':
        return 2;
      case 'P':
        return m == parallel_mode::ep ? g.num_ep_pages : g.num_ep_pages * split;
      case 'T':
        return g.page_size;
      case 'H':
        return m == parallel_mode::ep ? H : H / split;
      case 'D':
        return g.head_dim;
    }
    return 0;
  }
  // Stride in bytes of dimension c in view m.
  int64_t stride(const kv_geometry& g, parallel_mode m, char c) const {
    int64_t s = dtype_bytes(g.type);
    for (int i = static_cast<int>(order.size()) - 1; i >= 0; --i) {
      if (order[static_cast<size_t>(i)] == c) return s + pad[i];
      s = (s + pad[i]) * size_of(g, m, order[static_cast<size_t>(i)]);
    }
    return 0;  // 'K' of a latent layout
  }
  int64_t bytes(const kv_geometry& g) const {  // one past the last byte of the array
    const char c = order[0];
    return base + stride(g, parallel_mode::ep, c) * size_of(g, parallel_mode::ep, c);
  }
  int64_t offset(const kv_geometry& g, parallel_mode m, int64_t layer, int64_t kv, int64_t page,
                 int64_t head, int64_t token, int64_t dim) const {
    return base + layer * stride(g, m, 'L') + kv * stride(g, m, 'K') + page * stride(g, m, 'P') +
           token * stride(g, m, 'T') + head * stride(g, m, 'H') + dim * stride(g, m, 'D');
  }
  // The library descriptor of this array (its EP strides; the library derives TP).
  kv_pool_layout layout(const kv_geometry& g) const {
    kv_strides s;
    s.base = base;
    s.layer = stride(g, parallel_mode::ep, 'L');
    s.kv = stride(g, parallel_mode::ep, 'K');
    s.page = stride(g, parallel_mode::ep, 'P');
    s.token = stride(g, parallel_mode::ep, 'T');
    s.head = stride(g, parallel_mode::ep, 'H');
    s.dim = stride(g, parallel_mode::ep, 'D');
    return make_kv_pool_layout(g, s, bytes(g));
  }
};

// The preset's array, written from the engines' shapes (docs/kv_layouts.md).
inline layout_model preset_model(kv_preset p, const kv_geometry& g) {
  layout_model m;
  const bool hnd = g.layout == kv_layout::hnd;
  const std::string inner = hnd ? "HTD" : "THD";
  switch (p) {
    case kv_preset::present:
    case kv_preset::vllm_flash_attn:  // per layer (2, num_blocks, block_size, H, D)
    case kv_preset::sglang_mha:       // per layer K and V buffers [slots, H, D]
      m.order = "LKP" + inner;
      break;
    case kv_preset::vllm_flashinfer:  // per layer (num_blocks, 2, block_size, H, D)
      m.order = "LPK" + inner;
      break;
    case kv_preset::custom:
      break;
  }
  if (g.num_kv_heads == 0) m.order.erase(m.order.find('K'), 1);
  return m;
}

// A random engine-like array: a random order of L, K, P (outside the page), the inner order of
// g.layout, random padding on the dimensions outside P, a random base.
inline layout_model random_layout_model(std::mt19937_64& rng, const kv_geometry& g) {
  layout_model m;
  std::string outer = g.num_kv_heads == 0 ? "LP" : "LKP";
  std::shuffle(outer.begin(), outer.end(), rng);
  m.order = outer + (g.layout == kv_layout::hnd ? "HTD" : "THD");
  const int64_t e = dtype_bytes(g.type);
  std::uniform_int_distribution<int64_t> pad(0, 3);
  for (size_t i = 0; i < m.order.size() && m.order[i] != 'P'; ++i)
    m.pad[i] = pad(rng) * e * std::uniform_int_distribution<int64_t>(1, 40)(rng);
  m.base = pad(rng) * e * 8;
  return m;
}

}  // namespace moebius::testing
