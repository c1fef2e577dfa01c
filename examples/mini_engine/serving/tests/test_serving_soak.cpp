// The serving soak on the host runtime (issue 22; soak.hpp says what a round does and checks):
// random models (L, H_kv against P, page size), tight KV pools, random traces with bad requests
// among the good ones, random switch schedules in both styles, random faults at every stage and
// phase (exact, barrier timeouts, failed undos), progressive aborts. Thousands of switches; every
// good request gets the static run's greedy tokens.
//
// Rounds: MOEBIUS_SOAK_ROUNDS (default 200; a quarter under AddressSanitizer, which CI also runs),
// seed MOEBIUS_TEST_SEED (printed) or random.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>

#include <moebius/transport/host_transport.hpp>

#include "catch.hpp"
#include "engine.hpp"
#include "host_runtime.hpp"
#include "model_config.hpp"
#include "soak.hpp"
#include "weights.hpp"

using namespace mini_engine;

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr int64_t default_rounds = 50;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr int64_t default_rounds = 50;
#else
constexpr int64_t default_rounds = 200;
#endif
#else
constexpr int64_t default_rounds = 200;
#endif

int64_t soak_rounds() {
  const char* env = std::getenv("MOEBIUS_SOAK_ROUNDS");
  return env != nullptr && *env != '\0' ? std::strtoll(env, nullptr, 10) : default_rounds;
}

}  // namespace

TEST_CASE("soak: faults, tight pools and bad requests never change a good request's tokens",
          "[cpu][soak]") {
  const uint64_t seed = testing::soak_seed();
  std::mt19937_64 rng(seed);
  testing::soak_counts n;
  const int64_t rounds = soak_rounds();
  for (int64_t round = 0; round < rounds; ++round) {
    auto pick = [&](std::initializer_list<int64_t> v) {
      return *(v.begin() + std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng));
    };
    model_config c = tiny();
    c.num_layers = pick({2, 3, 4});
    c.num_kv_heads = pick({1, 2, 4});
    c.page_size = pick({1, 2, 4});
    const int P = static_cast<int>(pick({2, 4}));
    // 24-64 tokens a rank: a few sequences fill it, H_kv < P halves (or quarters) TP's room.
    const int64_t tokens = std::uniform_int_distribution<int64_t>(24, 64)(rng);
    const int64_t per_step = pick({1, 2});
    INFO("seed " << seed << " round " << round << " P=" << P << " L=" << c.num_layers << " H_kv="
                 << c.num_kv_heads << " page " << c.page_size << " tokens/rank " << tokens);
    validate(c, P);
    const model_weights weights = make_weights(c, rng());
    host_runtime_options ho;
    ho.num_ranks = P;
    ho.num_ep_pages = (tokens + c.page_size - 1) / c.page_size;
    host_runtime rt(weights, ho);
    moebius::host_transport transport(rt.memory());
    const testing::paced_clock clock(per_step);
    engine e(rt, transport, rt.arena(), rt.kv(), clock, moebius::arena_cursor{0});
    testing::soak_round(
        e, rt.kv(), c.num_layers, static_cast<int32_t>(c.vocab), per_step,
        [&](moebius::arena_cursor at) { rt.place_experts(weights, at); }, rng, n);
  }
  std::printf("soak: %lld rounds, %lld requests (%lld bad), %lld switches: %lld committed, %lld "
              "rolled back, %lld refused, %lld recovered (%lld sequences lost, %lld resumed)\n",
              static_cast<long long>(n.rounds), static_cast<long long>(n.requests),
              static_cast<long long>(n.bad_requests), static_cast<long long>(n.switches),
              static_cast<long long>(n.committed), static_cast<long long>(n.rolled_back),
              static_cast<long long>(n.refused), static_cast<long long>(n.recovered),
              static_cast<long long>(n.lost_sequences), static_cast<long long>(n.resumes));
  if (rounds >= default_rounds) {  // enough rounds that every outcome shows up
    CHECK(n.switches >= 10 * rounds);
    CHECK(n.committed >= 5 * rounds);
    CHECK(n.rolled_back >= rounds);
    CHECK(n.refused >= 1);
    CHECK(n.recovered >= rounds);
    CHECK(n.resumes >= 1);
  }
  CHECK(n.resumes + n.capacity_failures == n.lost_sequences);  // each lost one resumed, or failed for room
}
