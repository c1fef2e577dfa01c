#pragma once

// What the fault tests share (test_serving_faults.cpp, test_serving_faults_recovery.cpp): the
// host runtime on its own weights with a host transport over its memory, and counting a run's
// switches.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include <moebius/switch/checksum.hpp>
#include <moebius/switch/switcher.hpp>
#include <moebius/transport/host_transport.hpp>

#include "engine.hpp"
#include "host_runtime.hpp"
#include "model_config.hpp"
#include "weights.hpp"

namespace mini_engine::testing {

struct host_world {
  model_config c;
  model_weights weights;  // the host copy recovery reloads the experts from
  std::unique_ptr<host_runtime> rt;
  std::unique_ptr<moebius::host_transport> transport;
};

// `kv_preset`: how the runtime lays out its KV pool (host_runtime_options::kv_preset).
inline host_world make_host_world(const model_config& c, int P, int64_t ep_pages, uint64_t seed,
                                  moebius::kv_preset kv_preset = moebius::kv_preset::present) {
  host_world w;
  w.c = c;
  validate(w.c, P);
  host_runtime_options o;
  o.num_ranks = P;
  o.num_ep_pages = ep_pages;
  o.kv_preset = kv_preset;
  w.weights = make_weights(w.c, seed);
  w.rt = std::make_unique<host_runtime>(w.weights, o);
  w.transport = std::make_unique<moebius::host_transport>(w.rt->memory());
  return w;
}

inline model_config with_layers(int64_t layers) {
  model_config c = tiny();
  c.num_layers = layers;
  return c;
}

inline int64_t count(const run_result& r, moebius::switch_outcome o) {
  int64_t n = 0;
  for (const switch_record& s : r.switches) n += s.outcome == o;
  return n;
}

// The verify hook a user writes on the host runtime (switcher_options::verify): every layer's
// experts where the cursor puts them, and every live K/V element the tables name, read where the
// runtime's pool layout puts it (switch/checksum.hpp).
inline std::function<uint64_t(moebius::arena_cursor, const moebius::kv_state&)> checksum_hook(
    host_runtime& rt) {
  return [&rt](moebius::arena_cursor c, const moebius::kv_state& tables) {
    std::vector<std::span<const std::byte>> arenas, pools;
    for (const moebius::rank_memory& m : rt.memory()) {
      const moebius::memory_span& a = m.space(moebius::memory_space::arena);
      const moebius::memory_span& k = m.space(moebius::memory_space::kv_pool);
      arenas.emplace_back(a.data(), static_cast<size_t>(a.bytes));
      pools.emplace_back(k.data(), static_cast<size_t>(k.bytes));
    }
    uint64_t sum = moebius::kv_checksum(rt.kv(), rt.kv_layout(), tables, pools);
    for (int64_t l = 0; l < rt.arena().shape.num_layers; ++l)
      sum = sum * 1000003 + moebius::weight_checksum(rt.arena(), c, l, arenas);
    return sum;
  };
}

inline std::vector<int64_t> every_other_step(int64_t from, int64_t to, int64_t every) {
  std::vector<int64_t> s;
  for (int64_t i = from; i < to; i += every) s.push_back(i);
  return s;
}

}  // namespace mini_engine::testing
