#include "serving_stage.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <span>
#include <vector>

#include "moebius/kv/page_table.hpp"
#include "moebius/policy/switch_policy.hpp"
#include "moebius/switch/checksum.hpp"
#include "moebius/switch/switcher.hpp"

namespace moebius::demo {
namespace {

// --- the engine's side of the KV tables: admit, grow, retire ------------------------------
// An engine owns its page tables; Moebius only needs them valid when it switches. These are
// the few operations a continuous-batching scheduler performs on them.

kv_sequence* find(kv_rank_state& rs, int64_t id) {
  auto it = std::lower_bound(rs.sequences.begin(), rs.sequences.end(), id,
                             [](const kv_sequence& s, int64_t v) { return s.seq_id < v; });
  return it != rs.sequences.end() && it->seq_id == id ? &*it : nullptr;
}

// Ranks holding sequence `id`: its owner in EP, every rank in TP.
std::vector<int> holders(kv_state& s, int64_t id) {
  std::vector<int> out;
  for (int r = 0; r < static_cast<int>(s.ranks.size()); ++r) {
    if (find(s.ranks[static_cast<size_t>(r)], id) != nullptr) out.push_back(r);
  }
  return out;
}

int64_t take_page(kv_rank_state& rs) {
  const int64_t p = rs.free_pages.front();  // the smallest: free lists stay ascending
  rs.free_pages.erase(rs.free_pages.begin());
  return p;
}

// A new sequence with `tokens` prompt tokens: one owner in EP (the rank with the most free
// pages), every rank in TP. False when it does not fit (the request waits).
bool admit(kv_state& s, const kv_geometry& g, int64_t id, int64_t tokens) {
  const int64_t pages = pages_for_tokens(tokens, g.page_size);
  std::vector<int> ranks;
  if (s.mode == parallel_mode::ep) {
    int best = -1;
    for (int r = 0; r < g.num_ranks; ++r) {
      const auto free = static_cast<int64_t>(s.ranks[static_cast<size_t>(r)].free_pages.size());
      if (free >= pages &&
          (best < 0 || free > static_cast<int64_t>(s.ranks[static_cast<size_t>(best)].free_pages.size()))) {
        best = r;
      }
    }
    if (best < 0) return false;
    ranks.push_back(best);
  } else {
    for (int r = 0; r < g.num_ranks; ++r) {
      if (static_cast<int64_t>(s.ranks[static_cast<size_t>(r)].free_pages.size()) < pages) return false;
      ranks.push_back(r);
    }
  }
  for (int r : ranks) {
    kv_sequence q;
    q.seq_id = id;  // ids only grow, so appending keeps the tables sorted
    q.num_tokens = tokens;
    q.last_page_len = (tokens - 1) % g.page_size + 1;
    q.prefill_cursor = tokens;
    for (int64_t i = 0; i < pages; ++i) q.pages.push_back(take_page(s.ranks[static_cast<size_t>(r)]));
    s.ranks[static_cast<size_t>(r)].sequences.push_back(std::move(q));
  }
  return true;
}

// One decoded token; false when the sequence needs a page that is not free.
bool append_token(kv_state& s, const kv_geometry& g, int64_t id) {
  const std::vector<int> hs = holders(s, id);
  const bool new_page = find(s.ranks[static_cast<size_t>(hs.front())], id)->last_page_len == g.page_size;
  for (int r : hs) {
    if (new_page && s.ranks[static_cast<size_t>(r)].free_pages.empty()) return false;
  }
  for (int r : hs) {
    kv_rank_state& rs = s.ranks[static_cast<size_t>(r)];
    kv_sequence* q = find(rs, id);
    if (new_page) {
      q->pages.push_back(take_page(rs));
      q->last_page_len = 0;
    }
    ++q->last_page_len;
    ++q->num_tokens;
    q->prefill_cursor = q->num_tokens;
  }
  return true;
}

void retire(kv_state& s, int64_t id) {
  for (kv_rank_state& rs : s.ranks) {
    kv_sequence* q = find(rs, id);
    if (q == nullptr) continue;
    rs.free_pages.insert(rs.free_pages.end(), q->pages.begin(), q->pages.end());
    std::sort(rs.free_pages.begin(), rs.free_pages.end());
    rs.sequences.erase(rs.sequences.begin() + (q - rs.sequences.data()));
  }
}

// Arrivals per step: quiet, a burst, quiet again, then a rollout-like decay with none.
double arrival_rate(int64_t step, int64_t steps) {
  const double f = static_cast<double>(step) / static_cast<double>(steps);
  if (f < 0.15) return 0.2;
  if (f < 0.40) return 1.6;
  if (f < 0.65) return 0.2;
  if (f < 0.75) return 1.6;
  return 0.0;
}

struct active_request {
  int64_t id;
  int64_t steps_left;
};

}  // namespace

bool run_serving_stage(backend& b, rank_mirror& mirror, const arena_geometry& weights,
                       const kv_geometry& kv, const serving_options& opt) {
  const int P = weights.num_ranks;
  std::mt19937_64 rng(opt.seed);
  kv_state empty;
  empty.mode = parallel_mode::ep;
  empty.ranks.resize(static_cast<size_t>(P));
  for (kv_rank_state& rs : empty.ranks) {
    for (int64_t p = 0; p < kv.num_ep_pages; ++p) rs.free_pages.push_back(p);
  }

  // Verification: the KV of every live sequence and two expert layers, read back from the
  // ranks, summed independently of the layout. Equal before and after, or the switch undoes.
  switcher_options sw_opt;
  sw_opt.verify = [&](arena_cursor cursor, const kv_state& tables) {
    b.download(mirror);
    const std::vector<std::span<const std::byte>> arenas(mirror.arenas.begin(), mirror.arenas.end());
    const std::vector<std::span<const std::byte>> pools(mirror.pools.begin(), mirror.pools.end());
    return kv_checksum(kv, tables, pools) + 3 * weight_checksum(weights, cursor, 0, arenas) +
           7 * weight_checksum(weights, cursor, weights.shape.num_layers - 1, arenas);
  };
  switcher sw(weights, kv, b.get(), empty, arena_cursor{0}, sw_opt);

  switch_policy_config pc = interactive_config(opt.t_high);
  pc.down_window = 8;
  pc.cooldown_steps = 20;
  pc.cooldown_s = 0;
  switch_policy policy(pc, capacity_check{[](void* c, parallel_mode target) {
                                            return static_cast<switcher*>(c)->check(target).fits;
                                          },
                                          &sw});

  std::printf("\nstage 2: serving with live switches (T_h=%lld, T_l=%lld, W=%lld, cooldown %lld "
              "steps; KV %lld heads x %lld, page %lld, %lld EP pages per rank)\n",
              static_cast<long long>(pc.t_high), static_cast<long long>(pc.t_low),
              static_cast<long long>(pc.down_window), static_cast<long long>(pc.cooldown_steps),
              static_cast<long long>(kv.num_kv_heads), static_cast<long long>(kv.head_dim),
              static_cast<long long>(kv.page_size), static_cast<long long>(kv.num_ep_pages));
  std::printf("  %5s %6s %5s %5s  %s\n", "step", "active", "mode", "KV%", "event");

  std::vector<active_request> active;
  int64_t next_id = 1, waited = 0, switches = 0;
  bool ok = true;
  for (int64_t step = 0; step < opt.steps; ++step) {
    kv_state& tables = sw.mutable_kv_tables();
    std::poisson_distribution<int> arrivals(arrival_rate(step, opt.steps));
    for (int a = arrivals(rng); a > 0; --a) {
      const int64_t prompt = std::uniform_int_distribution<int64_t>(16, 400)(rng);
      if (admit(tables, kv, next_id, prompt)) {
        active.push_back({next_id, std::uniform_int_distribution<int64_t>(30, 90)(rng)});
      } else {
        ++waited;
      }
      ++next_id;
    }
    for (active_request& r : active) {
      if (--r.steps_left <= 0 || !append_token(tables, kv, r.id)) r.steps_left = 0;
    }
    for (const active_request& r : active) {
      if (r.steps_left <= 0) retire(tables, r.id);
    }
    std::erase_if(active, [](const active_request& r) { return r.steps_left <= 0; });

    int64_t used = 0;
    for (int r = 0; r < P; ++r) used += used_pages(kv, tables, r);
    const double occupancy = 100.0 * static_cast<double>(used) /
                             static_cast<double>(P * kv.num_pages(tables.mode));
    const auto load = static_cast<int64_t>(active.size());
    const switch_decision d = policy.step(load, sw.mode(), static_cast<double>(step));
    if (d.do_switch) {
      const switch_report rep = sw.switch_to(d.target);
      ++switches;
      const bool good = rep.outcome == switch_outcome::committed && rep.verified;
      ok = ok && good;
      int64_t kv_sent = 0;
      for (int64_t x : rep.kv_bytes_sent) kv_sent = std::max(kv_sent, x);
      std::printf("  %5lld %6lld %5s %4.0f%%  %s: %s->%s, %lld layers + %lld KV rounds "
                  "(%.1f KiB KV per rank), move %.2f ms, %s\n",
                  static_cast<long long>(step), static_cast<long long>(load), to_string(rep.from),
                  occupancy, to_string(d.reason), to_string(rep.from), to_string(rep.to),
                  static_cast<long long>(rep.weight_phases), static_cast<long long>(rep.kv_rounds),
                  static_cast<double>(kv_sent) / 1024.0, rep.weights_ms + rep.kv_ms,
                  good ? "committed, checksums equal" : rep.error.c_str());
    } else if (step % 50 == 0) {
      std::printf("  %5lld %6lld %5s %4.0f%%  %s\n", static_cast<long long>(step),
                  static_cast<long long>(load), to_string(sw.mode()), occupancy,
                  d.blocked() ? "switch blocked" : "");
    }
  }
  std::printf("  %lld switches, %lld requests served, %lld had to wait for KV space\n",
              static_cast<long long>(switches), static_cast<long long>(next_id - 1),
              static_cast<long long>(waited));
  return ok && switches > 0;
}

}  // namespace moebius::demo
