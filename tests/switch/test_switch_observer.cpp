// The switch observer: every switch that ends is reported exactly once, with the report the
// call returned (whole switches, progressive ones finished, aborted or not opened, refusals,
// rollbacks), numbered in order; none while one is in flight; a throwing observer never
// fails a switch; replacing and removing the observer.
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "moebius/switch/switch_observer.hpp"
#include "moebius/switch/switcher.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"
#include "support/random.hpp"
#include "switch_world.hpp"

using namespace moebius;
using moebius::testing::make_world;
using moebius::testing::world;

namespace {

struct seen {
  std::string report;  // operator<< of the report: every field that prints
  switch_outcome outcome;
  switch_style style;
  int64_t sequence;
};

std::string printed(const switch_report& r) {
  std::ostringstream os;
  os << r;
  return os.str();
}

// Installs a recording observer for the test's lifetime; puts back what was there.
struct recorder {
  std::vector<seen> events;
  switch_observer previous;
  recorder() {
    previous = set_switch_observer([this](const switch_event& e) {
      events.push_back({printed(e.report), e.report.outcome, e.style, e.sequence});
    });
  }
  ~recorder() { set_switch_observer(std::move(previous)); }
};

// The last event is `rep` in `style`, one after the event before it.
void check_last(const recorder& rec, size_t expected_count, const switch_report& rep,
                switch_style style) {
  REQUIRE(rec.events.size() == expected_count);
  const seen& e = rec.events.back();
  CHECK(e.report == printed(rep));
  CHECK(e.outcome == rep.outcome);
  CHECK(e.style == style);
  if (expected_count > 1) CHECK(e.sequence == rec.events[expected_count - 2].sequence + 1);
}

}  // namespace

TEST_CASE("every switch that ends is reported once with its final report", "[switch][observer]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  INFO("seed " << seed);
  world w = make_world(rng, 2, 0.3, /*same_layers=*/true);
  host_transport t(w.memory);
  switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
  recorder rec;
  size_t n = 0;

  // Stop the world: committed, then already there.
  switch_report rep = sw.switch_to(parallel_mode::tp);
  REQUIRE(rep.outcome == switch_outcome::committed);
  check_last(rec, ++n, rep, switch_style::whole);
  CHECK(rec.events.back().report == printed(sw.last_report()));
  rep = sw.switch_to(parallel_mode::tp);
  REQUIRE(rep.outcome == switch_outcome::already_there);
  check_last(rec, ++n, rep, switch_style::whole);

  // A fault: rolled back, reported once.
  sw.inject_fault(switch_fault{switch_fault::stage::weights, fault_point{0, 0}});
  rep = sw.switch_to(parallel_mode::ep);
  REQUIRE(rep.outcome == switch_outcome::rolled_back);
  check_last(rec, ++n, rep, switch_style::whole);

  // Progressive: nothing while open or advancing; one event at finish.
  {
    progressive_switch p = sw.begin(parallel_mode::ep);
    REQUIRE(p.open());
    CHECK(rec.events.size() == n);
    p.advance(1);
    CHECK(rec.events.size() == n);
    rep = p.finish();
    REQUIRE(rep.outcome == switch_outcome::committed);
    check_last(rec, ++n, rep, switch_style::progressive);
  }
  CHECK(rec.events.size() == n);  // the closed session's destructor reports nothing more

  // Progressive, aborted; then one that never opens (already there).
  {
    progressive_switch p = sw.begin(parallel_mode::tp);
    p.advance(1);
    rep = p.abort();
    REQUIRE(rep.outcome == switch_outcome::rolled_back);
    check_last(rec, ++n, rep, switch_style::progressive);
  }
  {
    progressive_switch p = sw.begin(parallel_mode::ep);
    REQUIRE_FALSE(p.open());
    check_last(rec, ++n, p.report(), switch_style::progressive);
    CHECK(p.report().outcome == switch_outcome::already_there);
  }
  // A session dropped while open is aborted by its destructor, and reported by it.
  {
    progressive_switch p = sw.begin(parallel_mode::tp);
    REQUIRE(p.open());
  }
  REQUIRE(rec.events.size() == ++n);
  CHECK(rec.events.back().outcome == switch_outcome::rolled_back);
  CHECK(rec.events.back().report == printed(sw.last_report()));
}

TEST_CASE("a refused switch is reported", "[switch][observer]") {
  std::mt19937_64 rng(testing::test_seed());
  world w;
  do {  // H_kv=1 on P=2: TP holds half of what EP holds, so 95% occupancy cannot go to TP
    w = make_world(rng, 2, 0.95);
  } while (w.kv.num_kv_heads != 1);
  host_transport t(w.memory);
  switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
  recorder rec;
  const switch_report rep = sw.switch_to(parallel_mode::tp);
  REQUIRE(rep.outcome == switch_outcome::refused_capacity);
  check_last(rec, 1, rep, switch_style::whole);
}

TEST_CASE("a throwing observer never fails a switch; replace and remove", "[switch][observer]") {
  std::mt19937_64 rng(testing::test_seed());
  world w = make_world(rng, 2, 0.3);
  host_transport t(w.memory);
  switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
  int thrown = 0;
  switch_observer before = set_switch_observer([&](const switch_event&) {
    ++thrown;
    throw std::runtime_error("exporter is down");
  });
  const switch_report rep = sw.switch_to(parallel_mode::tp);
  CHECK(thrown == 1);
  CHECK(rep.outcome == switch_outcome::committed);
  CHECK(sw.mode() == parallel_mode::tp);

  // Replacing returns the one installed; an empty observer removes it.
  int second = 0;
  switch_observer replaced = set_switch_observer([&](const switch_event&) { ++second; });
  REQUIRE(replaced);
  CHECK_THROWS_AS(replaced(switch_event{rep, switch_style::whole, 0}), std::runtime_error);
  CHECK(thrown == 2);  // it was the throwing one
  sw.switch_to(parallel_mode::ep);
  CHECK(second == 1);
  CHECK(thrown == 2);
  set_switch_observer({});
  sw.switch_to(parallel_mode::tp);
  CHECK(second == 1);
  set_switch_observer(std::move(before));
}
