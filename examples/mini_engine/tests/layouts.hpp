#pragma once

// The static layouts a host runtime serves (step.hpp): attention in the mode of the tables, the
// experts by the resting cursor, any combination, and TP attention over each KV-parallel degree
// the model allows (kv_geometry::dcp). The tests run the same prompts in each and compare.

#include <cstdint>
#include <moebius/layout/parallel_mode.hpp>
#include <ostream>
#include <vector>

#include "host_runtime.hpp"
#include "model_config.hpp"

namespace mini_engine::testing {

struct layout_case {
  moebius::parallel_mode attention = moebius::parallel_mode::ep;  // the tables' mode
  int64_t cursor = 0;  // experts: layers below it TP, the rest EP
  int64_t dcp = 1;     // TP tables' KV-parallel degree

  // The runtime's options for this layout over P ranks.
  host_runtime_options options(int P, int64_t num_ep_pages) const {
    host_runtime_options o;
    o.num_ranks = P;
    o.num_ep_pages = num_ep_pages;
    o.cursor = moebius::arena_cursor{cursor};
    o.dcp = dcp;
    return o;
  }
  friend std::ostream& operator<<(std::ostream& os, const layout_case& l) {
    os << "attention " << moebius::to_string(l.attention);
    if (l.dcp > 1) os << "(dcp " << l.dcp << ")";
    return os << ", experts cursor " << l.cursor;
  }
};

// EP/EP, TP/TP, TP attention with EP experts, EP attention with TP experts; then, for every
// dcp > 1 dividing P/Hkv (Hkv < P), TP(dcp) attention with TP and with EP experts.
//   Hkv 1, P 4, L 2: the four, then TP(dcp 2) at cursors 2 and 0, TP(dcp 4) at 2 and 0.
inline std::vector<layout_case> every_layout(const model_config& c, int P) {
  using moebius::parallel_mode;
  const int64_t L = c.num_layers;
  std::vector<layout_case> out = {{parallel_mode::ep, 0, 1},
                                  {parallel_mode::tp, L, 1},
                                  {parallel_mode::tp, 0, 1},
                                  {parallel_mode::ep, L, 1}};
  if (c.num_kv_heads < P) {
    const int64_t replicas = P / c.num_kv_heads;
    for (int64_t dcp = 2; dcp <= replicas; ++dcp)
      if (replicas % dcp == 0) {
        out.push_back({parallel_mode::tp, L, dcp});
        out.push_back({parallel_mode::tp, 0, dcp});
      }
  }
  return out;
}

}  // namespace mini_engine::testing
