// A run's own steps priced again (own_steps.hpp): the kinds on hand examples; the sums per kind
// and per mode over random records against sums kept independently, with the cost each record is
// rebuilt into checked field by field; what is skipped; and the rescaled clock against its base,
// with bad factors refused by name.
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <moebius/error.hpp>

#include "catch.hpp"
#include "own_steps.hpp"
#include "test_seed.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

// A clock that prices a step at 1 ms + 0.01 ms a new token + 0.001 ms a context token, keeps
// the last cost it was given, and answers every other question with a value of its own.
class probe_clock final : public step_clock {
 public:
  double step_s(const step_cost& cost, double measured_s) const override {
    last = cost;
    last_measured_s = measured_s;
    return 1e-3 + 1e-5 * static_cast<double>(cost.new_tokens) +
           1e-6 * static_cast<double>(cost.context_tokens);
  }
  double switch_s(const moebius::switch_report& r) const override { return r.total_ms * 2e-3; }
  const char* name() const override { return "probe"; }
  bool needs_measurement() const override { return true; }
  moebius::link_rate link() const override { return moebius::link_rate::gb_per_s(123); }
  double predicted_switch_s(const moebius::layer_bytes&, int64_t layers) const override {
    return 0.5 * static_cast<double>(layers);
  }
  double predicted_kv_switch_s(const moebius::layer_bytes&, int64_t layers) const override {
    return 0.25 * static_cast<double>(layers);
  }
  mutable step_cost last;
  mutable double last_measured_s = -1;
};

double probe_ms(int64_t new_tokens, int64_t context) {
  return (1e-3 + 1e-5 * static_cast<double>(new_tokens) + 1e-6 * static_cast<double>(context)) *
         1e3;
}

step_record record(parallel_mode m, int64_t decodes, int64_t prefill_items, int64_t prefill_tokens,
                   int64_t context, double measured_ms) {
  step_record s;
  s.config = configuration_of({m, m}, 1);
  s.mode = m;
  s.sequences = decodes + prefill_items;
  s.decode_tokens = decodes;
  s.prefill_tokens = prefill_tokens;
  s.context_tokens = context;
  s.measured_ms = measured_ms;
  return s;
}

}  // namespace

TEST_CASE("own steps: the kind of a step by its prefill tokens and the budget", "[own_steps]") {
  CHECK(kind_of(record(parallel_mode::tp, 7, 0, 0, 100, 1), 512) == own_step_kind::decode);
  CHECK(kind_of(record(parallel_mode::tp, 7, 1, 505, 900, 1), 512) ==
        own_step_kind::prefill_full);
  CHECK(kind_of(record(parallel_mode::tp, 7, 1, 504, 900, 1), 512) ==
        own_step_kind::prefill_small);
  CHECK(kind_of(record(parallel_mode::ep, 0, 2, 600, 600, 1), 512) ==
        own_step_kind::prefill_full);
  CHECK(kind_of(record(parallel_mode::ep, 0, 1, 1, 1, 1), 512) == own_step_kind::prefill_small);
}

TEST_CASE("own steps: random records summed per kind and mode as priced, every cost rebuilt",
          "[own_steps]") {
  std::mt19937_64 rng(testing::test_seed());
  for (int trial = 0; trial < 50; ++trial) {
    const int P = static_cast<int>(1 + rng() % 4);
    const int64_t budget = 16 + static_cast<int64_t>(rng() % 500);
    run_result r;
    double want[2][3][2] = {};  // [EP, TP][kind][measured, priced]
    int64_t want_steps[2][3] = {}, want_skipped = 0;
    const int n = static_cast<int>(1 + rng() % 60);
    for (int i = 0; i < n; ++i) {
      const parallel_mode m = rng() % 2 ? parallel_mode::ep : parallel_mode::tp;
      const int64_t decodes = static_cast<int64_t>(rng() % 40);
      const int64_t items = rng() % 3 == 0 ? 0 : static_cast<int64_t>(1 + rng() % 3);
      const int64_t tokens = items == 0 ? 0 : items + static_cast<int64_t>(rng() % (budget + 1));
      const int64_t context = decodes * 100 + tokens + static_cast<int64_t>(rng() % 1000);
      const double measured = 0.5 + static_cast<double>(rng() % 10000) / 100.0;
      step_record s = record(m, decodes, items, tokens, context, measured);
      const int what = static_cast<int>(rng() % 10);
      if (what == 0) s.in_switch = true;  // never priced
      if (decodes + items == 0 || what == 0) {
        r.steps.push_back(s);
        continue;
      }
      // EP at P > 1: a split over the ranks, or (what == 1) none, which is skipped.
      if (m == parallel_mode::ep && P > 1) {
        if (what == 1) {
          ++want_skipped;
          r.steps.push_back(s);
          continue;
        }
        for (int k = 0; k < P; ++k)
          s.ranks.push_back(rank_work{static_cast<int64_t>(k), static_cast<int64_t>(rng() % 9),
                                      static_cast<int64_t>(rng() % 99)});
      }
      const int kind = tokens == 0 ? 0 : decodes + tokens >= budget ? 1 : 2;
      const int mi = m == parallel_mode::ep ? 0 : 1;
      ++want_steps[mi][kind];
      want[mi][kind][0] += measured;
      want[mi][kind][1] += probe_ms(decodes + tokens, context);
      r.steps.push_back(s);

      // The cost this record is rebuilt into, as the clock receives it.
      run_result one;
      one.steps.push_back(s);
      const probe_clock look;
      price_own_steps(one, look, P, budget);
      CHECK(look.last.mode == m);
      CHECK(look.last.num_ranks == P);
      CHECK(look.last.num_sequences == decodes + items);
      CHECK(look.last.new_tokens == decodes + tokens);
      CHECK(look.last.context_tokens == context);
      CHECK(look.last_measured_s == Approx(measured * 1e-3));
      if (m == parallel_mode::tp) {
        CHECK(look.last.ranks.empty());
      } else if (P > 1) {
        CHECK(look.last.ranks == s.ranks);
      } else {
        REQUIRE(look.last.ranks.size() == 1);
        CHECK(look.last.ranks[0] == rank_work{decodes + items, decodes + tokens, context});
      }
    }
    const probe_clock clock;
    const own_step_prices got = price_own_steps(r, clock, P, budget);
    CHECK(got.skipped == want_skipped);
    for (int kind = 0; kind < 3; ++kind) {
      own_step_sums total;
      for (int mi = 0; mi < 2; ++mi) {
        const own_step_sums& x = got.by_mode[mi][kind];
        CHECK(x.steps == want_steps[mi][kind]);
        CHECK(x.measured_ms == Approx(want[mi][kind][0]).margin(1e-9));
        CHECK(x.priced_ms == Approx(want[mi][kind][1]).margin(1e-9));
        total += x;
      }
      CHECK(got.by_kind[kind].steps == total.steps);
      CHECK(got.by_kind[kind].measured_ms == Approx(total.measured_ms).margin(1e-9));
      CHECK(got.by_kind[kind].priced_ms == Approx(total.priced_ms).margin(1e-9));
      const double m = total.measured_ms;
      CHECK(got.by_kind[kind].ratio() == Approx(m > 0 ? total.priced_ms / m : 0.0));
    }
    const own_step_sums& d = got.by_kind[0];
    CHECK(got.decode_factor() == Approx(d.priced_ms > 0 ? d.measured_ms / d.priced_ms : 1.0));
    const double pm = got.by_kind[1].measured_ms + got.by_kind[2].measured_ms;
    const double pp = got.by_kind[1].priced_ms + got.by_kind[2].priced_ms;
    CHECK(got.prefill_factor() == Approx(pp > 0 ? pm / pp : 1.0));
  }
}

TEST_CASE("own steps: bad arguments refused by name", "[own_steps]") {
  const probe_clock clock;
  const run_result r;
  CHECK_THROWS_WITH(price_own_steps(r, clock, 0, 512), Catch::Contains("P and step_tokens"));
  CHECK_THROWS_WITH(price_own_steps(r, clock, 2, 0), Catch::Contains("P and step_tokens"));
  for (const double bad : {0.0, -1.0, std::nan(""), static_cast<double>(INFINITY)}) {
    CHECK_THROWS_WITH(rescaled_clock(clock, bad, 1.0), Catch::Contains("rescaled_clock: factors"));
    CHECK_THROWS_WITH(rescaled_clock(clock, 1.0, bad), Catch::Contains("rescaled_clock: factors"));
  }
}

TEST_CASE("own steps: the rescaled clock is its base times each kind's factor, the rest its base's",
          "[own_steps]") {
  std::mt19937_64 rng(testing::test_seed());
  const probe_clock base;
  const double fd = 0.5 + static_cast<double>(rng() % 1000) / 1000.0;
  const double fp = 0.5 + static_cast<double>(rng() % 1000) / 1000.0;
  const rescaled_clock clock(base, fd, fp);
  for (int i = 0; i < 200; ++i) {
    step_cost c;
    c.mode = rng() % 2 ? parallel_mode::ep : parallel_mode::tp;
    c.num_sequences = static_cast<int64_t>(1 + rng() % 64);
    const bool prefills = rng() % 2 == 0;
    c.new_tokens = c.num_sequences + (prefills ? static_cast<int64_t>(1 + rng() % 512) : 0);
    c.context_tokens = static_cast<int64_t>(rng() % 100000);
    const double want = probe_ms(c.new_tokens, c.context_tokens) * 1e-3 * (prefills ? fp : fd);
    CHECK(clock.step_s(c, 0.25) == Approx(want).epsilon(1e-12));
    CHECK(base.last_measured_s == 0.25);  // the measured time passed through
  }
  moebius::switch_report rep;
  rep.total_ms = 7;
  CHECK(clock.switch_s(rep) == Approx(0.014));
  CHECK(clock.needs_measurement());
  CHECK(clock.link().bytes_per_s == Approx(123e9));
  const moebius::layer_bytes bytes{};
  CHECK(clock.predicted_switch_s(bytes, 10) == Approx(5.0));
  CHECK(clock.predicted_kv_switch_s(bytes, 10) == Approx(2.5));
  CHECK(std::string(clock.name()) == "rescaled per kind of step");
}
