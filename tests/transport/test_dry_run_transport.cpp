// dry_run_transport: accepts and refuses exactly the plans host_transport accepts and refuses
// (same error code and message), fails at an injected fault where host_transport fails (same
// completed phases, code and message), keeps the transport lifecycle, and counts every byte
// that the phases it "ran" would have moved, checked against a sum over the ops written here.
#include <cstdint>
#include <functional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "moebius/error.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/transport/dry_run_transport.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"
#include "support/random.hpp"
#include "support/random_plan.hpp"
#include "support/reference.hpp"

namespace {

using namespace moebius;
using namespace moebius::testing;

// What a call threw: its code and message, or {ok, ""}.
struct outcome {
  bool threw = false;
  errc code = errc::internal;
  std::string message;
  friend bool operator==(const outcome&, const outcome&) = default;
};

outcome outcome_of(const std::function<void()>& f) {
  try {
    f();
    return {};
  } catch (const moebius::error& e) {
    // The message without where it was thrown (" (file:line)"): the two transports throw
    // the same words from their own files.
    std::string m = e.what();
    const size_t at = m.rfind(" (");
    return {true, e.code(), at == std::string::npos ? m : m.substr(0, at)};
  }
}

std::ostream& operator<<(std::ostream& os, const outcome& o) {
  return os << (o.threw ? "threw " + std::to_string(static_cast<int>(o.code)) + ": " + o.message
                        : std::string("ok"));
}

// Host memory for P ranks of the given sizes (the host transport's twin).
struct host_ranks {
  std::vector<std::vector<std::byte>> arenas, pools;
  std::vector<rank_memory> memory;
  host_ranks(int P, int64_t arena, int64_t pool) {
    arenas.assign(static_cast<size_t>(P), std::vector<std::byte>(static_cast<size_t>(arena)));
    pools.assign(static_cast<size_t>(P), std::vector<std::byte>(static_cast<size_t>(pool)));
    for (int r = 0; r < P; ++r)
      memory.push_back(rank_memory::host(arenas[static_cast<size_t>(r)], pools[static_cast<size_t>(r)]));
  }
};

// Bytes the first `phases` phases of `p` move: [0] sent, [1] received, [2] local, per rank.
std::vector<std::vector<int64_t>> bytes_of(const plan& p, int64_t phases) {
  std::vector<std::vector<int64_t>> b(3, std::vector<int64_t>(static_cast<size_t>(p.num_ranks)));
  for (int64_t k = 0; k < phases; ++k) {
    for (const copy_op& op : p.phases[static_cast<size_t>(k)].ops) {
      const int64_t n = op.rows * op.row_bytes;
      if (op.src_rank == op.dst_rank) {
        b[2][static_cast<size_t>(op.src_rank)] += n;
      } else {
        b[0][static_cast<size_t>(op.src_rank)] += n;
        b[1][static_cast<size_t>(op.dst_rank)] += n;
      }
    }
  }
  return b;
}

void add(std::vector<std::vector<int64_t>>& total, const std::vector<std::vector<int64_t>>& b) {
  for (size_t i = 0; i < total.size(); ++i)
    for (size_t r = 0; r < total[i].size(); ++r) total[i][r] += b[i][r];
}

void check_traffic(const dry_run_transport& t, const std::vector<std::vector<int64_t>>& want) {
  CHECK(t.traffic().bytes_sent == want[0]);
  CHECK(t.traffic().bytes_received == want[1]);
  CHECK(t.traffic().bytes_local == want[2]);
}

random_plan_options random_options(std::mt19937_64& rng) {
  random_plan_options o;
  o.space_bytes[0] = int64_t{1} << uniform(rng, 10, 18);
  o.space_bytes[1] = int64_t{1} << uniform(rng, 10, 18);
  o.min_phases = 1;
  o.max_phases = 5;
  o.max_ops_per_phase = static_cast<int>(uniform(rng, 1, 60));
  o.max_op_bytes = std::max(o.space_bytes[0], o.space_bytes[1]) / 4;
  return o;
}

}  // namespace

TEST_CASE("dry_run_transport runs, refuses and fails as host_transport does",
          "[dry_run_transport]") {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed);
  for (int round = 0; round < 40; ++round) {
    const int P = static_cast<int>(uniform(rng, 1, 8));
    const random_plan_options o = random_options(rng);
    INFO("seed " << seed << " round " << round << " P " << P << " arena " << o.space_bytes[0]
                 << " pool " << o.space_bytes[1]);
    host_ranks mem(P, o.space_bytes[0], o.space_bytes[1]);
    host_transport host(mem.memory);
    dry_run_transport dry(P, {o.space_bytes[0], o.space_bytes[1]});
    CHECK(dry.num_ranks() == P);
    CHECK(dry.local_ranks() == host.local_ranks());
    std::vector<std::vector<int64_t>> moved(3, std::vector<int64_t>(static_cast<size_t>(P)));

    // A good plan runs whole.
    const plan p = random_hazard_free_plan(rng, P, o);
    const int64_t phases = static_cast<int64_t>(p.phases.size());
    CHECK(outcome_of([&] { dry.execute(p); }) == outcome{});
    CHECK(dry.completed_phases() == phases);
    add(moved, bytes_of(p, phases));
    check_traffic(dry, moved);

    // One corrupted op: the same refusal from both, nothing counted.
    plan bad = p;
    std::vector<copy_op*> ops;
    for (plan_phase& ph : bad.phases)
      for (copy_op& op : ph.ops) ops.push_back(&op);
    if (!ops.empty()) {
      copy_op& victim = *ops[static_cast<size_t>(uniform(rng, 0, static_cast<int64_t>(ops.size()) - 1))];
      switch (uniform(rng, 0, 6)) {
        case 0: victim.dst_offset = o.space_bytes[static_cast<int>(victim.dst_space)]; break;
        case 1: victim.src_offset = -1; break;
        case 2: victim.dst_rank = P; break;
        case 3: victim.src_rank = -1; break;
        case 4: victim.rows = 0; break;
        case 5: victim.row_bytes = 0; break;
        default: victim.src_space = static_cast<memory_space>(7); break;
      }
    } else {
      bad.num_ranks = P + 1;
    }
    const outcome refused = outcome_of([&] { host.enqueue(bad); });
    REQUIRE(refused.threw);
    CHECK(outcome_of([&] { dry.validate(bad); }) == refused);
    CHECK(outcome_of([&] { dry.enqueue(bad); }) == refused);
    CHECK(dry.poll());
    dry.wait();  // nothing outstanding
    check_traffic(dry, moved);
    plan more = p;
    more.num_ranks = P + 1;
    CHECK(outcome_of([&] { dry.validate(more); }) == outcome_of([&] { host.validate(more); }));

    // A fault anywhere (or past the plan): the same completed phases, code and message.
    const int64_t k = uniform(rng, 0, phases);
    const int64_t op = uniform(rng, 0, 4);
    const errc code = uniform(rng, 0, 1) ? errc::timeout : errc::injected_fault;
    host.inject_fault(fault_point{k, op, code});
    dry.inject_fault(fault_point{k, op, code});
    host.enqueue(p);
    dry.enqueue(p);
    CHECK(dry.poll());
    const outcome h = outcome_of([&] { host.wait(); });
    CHECK(outcome_of([&] { dry.wait(); }) == h);
    CHECK(dry.completed_phases() == host.completed_phases());
    add(moved, bytes_of(p, dry.completed_phases()));
    check_traffic(dry, moved);
    CHECK(dry.plans_run() == 2);
    CHECK(host.plans_run() == 1);  // the plan it refused does not count

    // Lifecycle: one plan outstanding at a time; no streams or events to give.
    dry.enqueue(p);
    CHECK(outcome_of([&] { dry.enqueue(p); }).code == errc::invalid_argument);
    dry.wait();
    add(moved, bytes_of(p, phases));
    check_traffic(dry, moved);
    const std::vector<stream_handle> wrong(static_cast<size_t>(P) + 1, nullptr);
    CHECK(outcome_of([&] { dry.enqueue(p, wrong); }).code == errc::invalid_argument);
    int device_stream = 0;
    const std::vector<stream_handle> real(static_cast<size_t>(P), &device_stream);
    CHECK(outcome_of([&] { dry.enqueue(p, real); }).code == errc::invalid_argument);
    const int64_t marks[] = {0, phases - 1 > 0 ? phases - 1 : 1};
    dry.mark_phases(marks);
    dry.execute(p);
    CHECK(dry.phase_event(0, 0) == nullptr);
    CHECK(outcome_of([&] { (void)dry.phase_event(0, static_cast<size_t>(P)); }).code ==
          errc::out_of_range);
    const int64_t unsorted[] = {2, 1};
    CHECK(outcome_of([&] { dry.mark_phases(unsorted); }).code == errc::invalid_argument);
    transport::phase_wait w;
    w.phase = 0;
    w.events.assign(static_cast<size_t>(P), &device_stream);
    CHECK(outcome_of([&] { dry.wait_before_phases(std::span(&w, 1)); }).code ==
          errc::invalid_argument);
  }
}

TEST_CASE("dry_run_transport refuses a bad configuration", "[dry_run_transport]") {
  CHECK_THROWS_WITH(dry_run_transport(0, {1, 1}), Catch::Matchers::Contains("0 ranks"));
  CHECK_THROWS_WITH(dry_run_transport(2, {-1, 1}), Catch::Matchers::Contains("negative space"));
  CHECK_THROWS_WITH(dry_run_transport(2, {1, -5}), Catch::Matchers::Contains("negative space"));
}
