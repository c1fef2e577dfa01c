// kv_pages: growing and releasing sequences keeps the tables valid; a refusal changes
// nothing. Checked against a simple model of the pages each rank holds.

#include <cstdint>
#include <map>
#include <moebius/error.hpp>
#include <moebius/kv/page_table.hpp>
#include <random>

#include "catch.hpp"
#include "kv_pages.hpp"

using namespace mini_engine;
using moebius::errc;
using moebius::parallel_mode;

TEST_CASE("kv_pages: the worked example", "[kv_pages]") {
  const auto g = moebius::make_kv_geometry(1, 2, 4, 4, 8, 2, moebius::dtype::fp32);
  auto s = make_empty_kv_state(g, parallel_mode::ep);
  reserve_tokens(g, s, 7, 6, 1);
  REQUIRE(owner_of(s, 7) == 1);
  const auto* seq = find_sequence(s, 1, 7);
  REQUIRE(seq);
  CHECK(seq->pages == std::vector<int64_t>{7, 6});
  CHECK(seq->last_page_len == 2);
  reserve_tokens(g, s, 7, 9, 0);  // stays on rank 1
  CHECK(owner_of(s, 7) == 1);
  CHECK(find_sequence(s, 1, 7)->pages == std::vector<int64_t>{7, 6, 5});
  CHECK(find_sequence(s, 1, 7)->last_page_len == 1);
  CHECK(free_pages(s, 0) == 8);
  CHECK(free_pages(s, 1) == 5);
  release_sequence(s, 7);
  CHECK(free_pages(s, 1) == 8);
  CHECK(owner_of(s, 7) == -1);
  moebius::validate(g, s);
  CHECK(pages_needed(g, parallel_mode::ep, 9) == 3);
  CHECK(pages_needed(g, parallel_mode::tp, 9) == 3);
}

TEST_CASE("kv_pages: random grow/release keeps the state valid; refusals change nothing",
          "[kv_pages]") {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    const int P = 1 << (rng() % 3);
    const int64_t kv_heads = (rng() & 1) ? 1 : 4;
    const int64_t page_size = 1 + static_cast<int64_t>(rng() % 5);
    const int64_t pages = 1 + static_cast<int64_t>(rng() % 12);
    auto g = moebius::make_kv_geometry(2, kv_heads, 8, page_size, pages, P);
    // A random allowed KV-parallel degree (a divisor of tp_replicas()): TP ranks then hold a
    // share of each sequence's pages.
    std::vector<int64_t> allowed;
    for (int64_t d = 1; d <= g.tp_replicas(); ++d)
      if (g.tp_replicas() % d == 0) allowed.push_back(d);
    g = moebius::with_dcp(g, allowed[rng() % allowed.size()]);
    const parallel_mode mode = (rng() & 1) ? parallel_mode::tp : parallel_mode::ep;
    auto s = make_empty_kv_state(g, mode);
    std::map<int64_t, int64_t> tokens;  // seq -> tokens
    int refusals = 0;
    for (int op = 0; op < 200; ++op) {
      const int64_t seq = static_cast<int64_t>(rng() % 10);
      if (rng() % 4 == 0) {
        release_sequence(s, seq);
        tokens.erase(seq);
      } else {
        const int64_t want = tokens[seq] + 1 + static_cast<int64_t>(rng() % (2 * page_size));
        const int owner = static_cast<int>(rng() % static_cast<uint64_t>(P));
        const auto before = s;
        try {
          reserve_tokens(g, s, seq, want, owner);
          tokens[seq] = want;
        } catch (const moebius::error& e) {
          REQUIRE(e.code() == errc::capacity);
          REQUIRE(s == before);  // nothing changed
          ++refusals;
          if (tokens[seq] == 0) tokens.erase(seq);
        }
      }
      moebius::validate(g, s);
      // Every tracked sequence holds its tokens, on one owner (EP) or every rank (TP; with
      // dcp > 1 rank r lists the logical pages k, k + dcp, .. of k = r % dcp, counted here
      // independently of the geometry's helpers).
      for (const auto& [id, n] : tokens) {
        int holders = 0;
        for (int r = 0; r < P; ++r)
          if (const auto* q = find_sequence(s, r, id)) {
            ++holders;
            REQUIRE(q->num_tokens == n);
            const int64_t logical = (n + page_size - 1) / page_size;
            int64_t share = 0;
            for (int64_t i = 0; i < logical; ++i)
              share += mode == parallel_mode::ep || i % g.dcp == r % g.dcp;
            REQUIRE(q->num_pages() == share);
            REQUIRE(q->last_page_len == n - (logical - 1) * page_size);
          }
        REQUIRE(holders == (mode == parallel_mode::ep ? 1 : P));
        REQUIRE((owner_of(s, id) >= 0) == (mode == parallel_mode::ep));
      }
      // Pages in use over all ranks: each logical page once per holder (EP: its owner; TP:
      // the P / dcp ranks of its DCP index). DCP index 0 uses the most: pages_needed.
      int64_t used = 0, used_rank0 = 0;
      for (const auto& [id, n] : tokens) {
        const int64_t logical = (n + page_size - 1) / page_size;
        used += logical * (mode == parallel_mode::tp ? P / g.dcp : 1);
        used_rank0 += pages_needed(g, mode, n);
      }
      int64_t free_total = 0;
      for (int r = 0; r < P; ++r) free_total += free_pages(s, r);
      REQUIRE(free_total + used == g.num_pages(mode) * P);
      if (mode == parallel_mode::tp) REQUIRE(g.num_pages(mode) - free_pages(s, 0) == used_rank0);
    }
    CHECK(refusals > 0);
  }
}

TEST_CASE("kv_pages: bad arguments throw and change nothing", "[kv_pages]") {
  const auto g = moebius::make_kv_geometry(1, 2, 4, 4, 8, 2, moebius::dtype::fp32);
  auto s = make_empty_kv_state(g, parallel_mode::ep);
  reserve_tokens(g, s, 1, 5, 0);
  const auto before = s;
  auto code_of = [&](auto&& f) {
    try {
      f();
    } catch (const moebius::error& e) {
      return e.code();
    }
    return errc::internal;
  };
  CHECK(code_of([&] { reserve_tokens(g, s, 1, 3, 0); }) == errc::invalid_argument);  // shrink
  CHECK(code_of([&] { reserve_tokens(g, s, 2, 0, 0); }) == errc::invalid_argument);
  CHECK(code_of([&] { reserve_tokens(g, s, 2, 4, 5); }) == errc::invalid_argument);  // owner
  CHECK(code_of([&] { reserve_tokens(g, s, 2, 33, 1); }) == errc::capacity);
  CHECK(s == before);
  release_sequence(s, 99);  // absent: no-op
  CHECK(s == before);
}

TEST_CASE("kv_pages: written_prefix keeps the written tokens and frees the rest", "[kv_pages]") {
  for (const parallel_mode mode : {parallel_mode::ep, parallel_mode::tp}) {
    const auto g = moebius::make_kv_geometry(1, 2, 4, 4, 8, 2, moebius::dtype::fp32);
    auto s = make_empty_kv_state(g, mode);
    reserve_tokens(g, s, 7, 9, 1);   // pages {0, 1, 2}: 9 tokens
    reserve_tokens(g, s, 8, 4, 1);   // one page
    reserve_tokens(g, s, 9, 3, 0);   // not listed: dropped
    const std::vector<std::pair<int64_t, int64_t>> written = {{7, 5}, {8, 4}};
    const moebius::kv_state t = written_prefix(g, s, written);
    moebius::validate(g, t);
    const int r = mode == parallel_mode::ep ? 1 : 0;
    const moebius::kv_sequence* a = find_sequence(t, r, 7);
    REQUIRE(a != nullptr);
    CHECK(a->num_tokens == 5);
    CHECK(a->last_page_len == 1);
    CHECK(a->pages == std::vector<int64_t>(find_sequence(s, r, 7)->pages.begin(),
                                           find_sequence(s, r, 7)->pages.begin() + 2));
    REQUIRE(find_sequence(t, r, 8) != nullptr);
    CHECK(*find_sequence(t, r, 8) == *find_sequence(s, r, 8));  // whole: all written
    for (int q = 0; q < 2; ++q) CHECK(find_sequence(t, q, 9) == nullptr);
    int64_t used = 0;
    for (int q = 0; q < 2; ++q) used += moebius::used_pages(g, t, q);
    CHECK(used == (mode == parallel_mode::ep ? 3 : 6));
  }
}
