#include "reshard_stage.hpp"

#include <algorithm>
#include <cstdio>
#include <moebius/switch/checksum.hpp>
#include <moebius/switch/switcher.hpp>
#include <span>
#include <string>

namespace mini_engine::demo {

bool verified_reshard(world& w, bool verbose) {
  using moebius::parallel_mode;
  const std::unique_ptr<moebius::transport> t = w.make_transport();
  moebius::switcher_options so;
  so.verify = [&](moebius::arena_cursor c, const moebius::kv_state&) {
    const std::vector<std::vector<std::byte>> bytes = arena_bytes(w);
    std::vector<std::span<const std::byte>> arenas;
    for (const auto& b : bytes) arenas.emplace_back(b.data(), b.size());
    uint64_t sum = 0;
    for (int64_t l = 0; l < w.arena.shape.num_layers; ++l) {
      sum = sum * 1000003 + moebius::weight_checksum(w.arena, c, l, arenas);
    }
    return sum;
  };
  moebius::kv_state empty;
  empty.mode = parallel_mode::ep;
  empty.ranks.resize(static_cast<size_t>(w.kv.num_ranks));
  for (auto& r : empty.ranks) {
    for (int64_t p = 0; p < w.kv.num_ep_pages; ++p) r.free_pages.push_back(p);
  }
  moebius::switcher sw(w.arena, w.kv, *t, empty, moebius::arena_cursor{0}, so);
  bool ok = true;
  int64_t layers = 0;
  std::string errors;
  for (const parallel_mode target : {parallel_mode::tp, parallel_mode::ep}) {
    const moebius::switch_report r = sw.switch_to(target);
    int64_t sent = 0;
    for (int64_t b : r.weight_bytes_sent) sent = std::max(sent, b);
    const bool good = r.outcome == moebius::switch_outcome::committed && r.verified;
    layers = r.weight_phases;
    if (!good) errors += (errors.empty() ? "" : "; ") + r.error;
    ok = ok && good;
    if (!verbose) continue;
    std::printf(
        "  %s -> %s: %lld layers, %.2f MiB leaving each rank, %.1f ms on this host; "
        "checksums of every layer %s\n",
        moebius::to_string(r.from), moebius::to_string(r.to),
        static_cast<long long>(r.weight_phases), static_cast<double>(sent) / 1048576.0, r.total_ms,
        good ? "equal" : ("DIFFER: " + r.error).c_str());
  }
  if (!verbose)
    std::printf("  verified reshard of the model's experts, EP -> TP -> EP through the switcher: "
                "%lld layers, checksums of every layer %s\n",
                static_cast<long long>(layers), ok ? "equal" : ("DIFFER: " + errors).c_str());
  return ok;
}

}  // namespace mini_engine::demo
