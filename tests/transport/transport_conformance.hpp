#pragma once

// The transport conformance suite: what transport.hpp promises, checked the same way for every
// transport. A test file describes its transport through a transport_fixture (how to allocate
// and read its kind of memory, how to build the transport, whether it can hold caller streams)
// and instantiates the suite with MOEBIUS_TRANSPORT_CONFORMANCE:
//
//   MOEBIUS_TRANSPORT_CONFORMANCE("host_transport", "[host_transport]", host_fixtures)
//
// defines one Catch2 test case per property below, each running every fixture host_fixtures()
// returns in a section of its own (named by the fixture, so `-c "<fixture name>"` replays one).
//
// The properties (each draws fresh random shapes and bytes from test_seed() and checks every
// byte of every rank and memory space):
//   reshard     a weight switch (plan_weight_switch: EP->TP, back, between random cursors)
//               leaves the arena equal to the independent static-load reference of the target
//               layout (support/reference.hpp), padding included; the KV pool is untouched.
//   random      random hazard-free multi-phase plans (strided ops, both spaces, idle ranks)
//               leave the same bytes as host_transport from the same start.
//   streams     enqueue() on caller streams returns before the plan ran where the transport can
//               show it (poll() false while the test holds the streams), refuses a second plan
//               while one is outstanding, and work the caller enqueues after the plan runs after
//               it.
//   faults      inject_fault(k, i): wait() throws errc::injected_fault, completed_phases() == k,
//               phases before k are complete and nothing else moved (phase k's destinations hold
//               their old or their new bytes), rollback_plan() run on the same transport restores
//               every live byte, and the transport works afterwards; a disarmed or unreachable
//               fault does not fire.
//   validation  bad ranks, offsets, spaces, row counts, rank counts and stream counts throw
//               errc::invalid_argument / errc::out_of_range before anything moves.
//   prepare     prepare() then enqueue, a plan run again (cache hit), and a plan that differs
//               from a cached one by one offset give host_transport's bytes.
//   events      phase marks and phase waits (transport.hpp): bad arguments are refused; a plan
//               with marks and waits gives host_transport's bytes; where streams can be held, a
//               plan that waits before phase 0 for events on held streams has not run (its
//               marks have not fired) until they are released, and every mark fires after.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "moebius/error.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/memory/rank_memory.hpp"
#include "moebius/plan/rollback.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "moebius/transport/host_transport.hpp"
#include "moebius/transport/transport.hpp"
#include "support/catch.hpp"
#include "support/plan_checks.hpp"
#include "support/random.hpp"
#include "support/random_plan.hpp"
#include "support/reference.hpp"

namespace moebius::testing {

// Bytes per rank of each memory space, indexed by memory_space; 0: the space is absent.
using space_sizes = std::array<int64_t, num_memory_spaces>;

// Memory of every rank of one transport, of the fixture's kind (host vectors, device buffers).
class fixture_memory {
 public:
  virtual ~fixture_memory() = default;
  // What the transport is built over: one entry per rank.
  virtual std::vector<rank_memory> ranks() const = 0;
  // Writes `bytes` (the whole space) to rank `rank`'s space `s`; complete on return, also for
  // a transport's streams.
  virtual void upload(int rank, memory_space s, const std::vector<std::byte>& bytes) = 0;
  // The whole space as it is now (call after wait() returned or threw).
  virtual std::vector<std::byte> download(int rank, memory_space s) const = 0;
};

// Caller streams, one per local rank, that the test holds closed: work enqueued on them waits
// until release(). GPU fixtures block each stream with a kernel that spins on a flag.
class held_streams {
 public:
  virtual ~held_streams() = default;
  virtual std::vector<stream_handle> streams() const = 0;  // indexed like local_ranks()
  // Enqueues, on each held stream, a copy of its rank's whole space `s` into a probe buffer.
  virtual void enqueue_probe(memory_space s) = 0;
  virtual void release() = 0;
  // After release(): waits for everything enqueued on the streams.
  virtual void synchronize() = 0;
  // True when a stream's block ended by its own timeout rather than release(): something
  // (enqueue() itself, say) waited for the held stream.
  virtual bool expired() const = 0;
  // The probe of local rank `local_idx` (after synchronize()).
  virtual std::vector<std::byte> probe(int local_idx) const = 0;
  // Records an event on each held stream (behind its block and what was enqueued so far), one
  // per local rank; the events live as long as this object.
  virtual std::vector<event_handle> record_events() = 0;
  // Whether `e` (one of record_events(), or a transport's phase_event()) has fired.
  virtual bool fired(event_handle e) const = 0;
};

// One transport configuration the suite runs against.
class transport_fixture {
 public:
  virtual ~transport_fixture() = default;
  virtual std::string name() const = 0;  // unique per fixture: the section's name
  virtual int num_ranks() const = 0;
  // Rounds of each randomised property (a device fixture runs fewer: each round allocates).
  virtual int rounds() const { return 3; }
  virtual std::unique_ptr<fixture_memory> allocate(const space_sizes& bytes) = 0;
  // A transport over `memory` (which outlives it) that can run each of `plans` (NCCL sizes its
  // staging workspace from them; the others ignore them).
  virtual std::unique_ptr<transport> make(const fixture_memory& memory,
                                          std::span<const plan> plans) = 0;
  // Streams held closed for the local ranks of `memory`, or nullptr when the transport runs a
  // plan inside enqueue() (host memory) and cannot show a plan still in flight.
  virtual std::unique_ptr<held_streams> hold_streams(const fixture_memory& memory) {
    (void)memory;
    return nullptr;
  }
};

using fixture_list = std::vector<std::unique_ptr<transport_fixture>>;

// ---------------------------------------------------------------------------------------------
// Host-memory fixture_memory (the host transport's, and the host twin's storage).

class host_memory final : public fixture_memory {
 public:
  host_memory(int num_ranks, const space_sizes& bytes) {
    for (int s = 0; s < num_memory_spaces; ++s) {
      images_[s].assign(static_cast<size_t>(num_ranks),
                        std::vector<std::byte>(static_cast<size_t>(bytes[static_cast<size_t>(s)]),
                                               poison_byte));
    }
  }
  std::vector<rank_memory> ranks() const override {
    std::vector<rank_memory> m(images_[0].size());
    for (size_t r = 0; r < m.size(); ++r) {
      for (int s = 0; s < num_memory_spaces; ++s) {
        std::vector<std::byte>& img = images_[s][r];
        if (!img.empty()) m[r].spaces[s] = memory_span(img.data(), static_cast<int64_t>(img.size()));
      }
    }
    return m;
  }
  void upload(int rank, memory_space s, const std::vector<std::byte>& bytes) override {
    std::vector<std::byte>& img = images_[static_cast<int>(s)][static_cast<size_t>(rank)];
    REQUIRE(bytes.size() == img.size());
    std::copy(bytes.begin(), bytes.end(), img.begin());  // in place: spans stay valid
  }
  std::vector<std::byte> download(int rank, memory_space s) const override {
    return images_[static_cast<int>(s)][static_cast<size_t>(rank)];
  }

 private:
  mutable rank_images images_[num_memory_spaces];  // ranks() hands out writable spans
};

// ---------------------------------------------------------------------------------------------
// Helpers of the properties.

namespace conformance {

// Every rank's bytes of every space: bytes[s][r].
struct memory_state {
  rank_images bytes[num_memory_spaces];
  friend bool operator==(const memory_state&, const memory_state&) = default;
};

inline memory_state download_all(const fixture_memory& m, int num_ranks) {
  memory_state st;
  for (int s = 0; s < num_memory_spaces; ++s) {
    for (int r = 0; r < num_ranks; ++r) {
      st.bytes[s].push_back(m.download(r, static_cast<memory_space>(s)));
    }
  }
  return st;
}

inline void upload_all(fixture_memory& m, const memory_state& st) {
  for (int s = 0; s < num_memory_spaces; ++s) {
    for (size_t r = 0; r < st.bytes[s].size(); ++r) {
      m.upload(static_cast<int>(r), static_cast<memory_space>(s), st.bytes[s][r]);
    }
  }
}

inline memory_state random_state(std::mt19937_64& rng, int num_ranks, const space_sizes& bytes) {
  memory_state st;
  for (int s = 0; s < num_memory_spaces; ++s) {
    for (int r = 0; r < num_ranks; ++r) {
      st.bytes[s].push_back(random_bytes(rng, static_cast<size_t>(bytes[static_cast<size_t>(s)])));
    }
  }
  return st;
}

// "" when `got` equals one of `want` byte by byte (for each byte: either candidate), else the
// first difference: space, rank, byte, expected value(s), value found.
inline std::string diff(const memory_state& got, const memory_state& want,
                        const memory_state* or_want = nullptr) {
  for (int s = 0; s < num_memory_spaces; ++s) {
    if (got.bytes[s].size() != want.bytes[s].size()) return "rank counts differ";
    for (size_t r = 0; r < want.bytes[s].size(); ++r) {
      const std::vector<std::byte>& g = got.bytes[s][r];
      const std::vector<std::byte>& w = want.bytes[s][r];
      if (g.size() != w.size()) return "space sizes differ";
      for (size_t i = 0; i < w.size(); ++i) {
        if (g[i] == w[i] || (or_want != nullptr && g[i] == or_want->bytes[s][r][i])) continue;
        std::ostringstream os;
        os << to_string(static_cast<memory_space>(s)) << " of rank " << r << ", byte " << i
           << ": want " << static_cast<int>(w[i]);
        if (or_want != nullptr) os << " or " << static_cast<int>(or_want->bytes[s][r][i]);
        os << ", got " << static_cast<int>(g[i]);
        return os.str();
      }
    }
  }
  return "";
}

// host_transport over a copy of a state: what the transport under test must produce.
class host_twin {
 public:
  host_twin(int num_ranks, const memory_state& start) {
    space_sizes sizes{};
    for (int s = 0; s < num_memory_spaces; ++s) {
      sizes[static_cast<size_t>(s)] =
          start.bytes[s].empty() ? 0 : static_cast<int64_t>(start.bytes[s][0].size());
    }
    memory_ = std::make_unique<host_memory>(num_ranks, sizes);
    upload_all(*memory_, start);
    transport_ = std::make_unique<host_transport>(memory_->ranks());
    num_ranks_ = num_ranks;
  }
  void execute(const plan& p) { transport_->execute(p); }
  memory_state state() const { return download_all(*memory_, num_ranks_); }

 private:
  int num_ranks_ = 0;
  std::unique_ptr<host_memory> memory_;
  std::unique_ptr<host_transport> transport_;
};

// The first `n` phases of `p`.
inline plan first_phases(const plan& p, int64_t n) {
  plan q;
  q.num_ranks = p.num_ranks;
  q.phases.assign(p.phases.begin(), p.phases.begin() + n);
  return q;
}

// Phase `k` of `p` alone.
inline plan only_phase(const plan& p, int64_t k) {
  plan q;
  q.num_ranks = p.num_ranks;
  q.phases.push_back(p.phases[static_cast<size_t>(k)]);
  return q;
}

inline random_plan_options random_options(std::mt19937_64& rng) {
  random_plan_options o;
  o.space_bytes[0] = int64_t{1} << uniform(rng, 10, 18);
  o.space_bytes[1] = int64_t{1} << uniform(rng, 10, 18);
  o.min_phases = 1;
  o.max_phases = 5;
  o.max_ops_per_phase = static_cast<int>(uniform(rng, 1, 60));
  o.max_op_bytes = std::max(o.space_bytes[0], o.space_bytes[1]) / 4;
  return o;
}

inline space_sizes sizes_of(const random_plan_options& o) {
  return {o.space_bytes[0], o.space_bytes[1]};
}

// Runs `p` on `t` expecting success, on the twin too, and compares every byte.
inline void run_and_compare(transport& t, const fixture_memory& m, host_twin& twin,
                            const plan& p) {
  CAPTURE(p.num_ops(), p.phases.size());
  t.execute(p);
  CHECK(t.completed_phases() == static_cast<int64_t>(p.phases.size()));
  twin.execute(p);
  REQUIRE(diff(download_all(m, p.num_ranks), twin.state()) == "");
}

inline void expect_error(const std::function<void()>& f, errc want) {
  try {
    f();
    FAIL("no moebius::error thrown (wanted " << static_cast<int>(want) << ")");
  } catch (const moebius::error& e) {
    CAPTURE(e.what());
    CHECK(e.code() == want);
  }
}

// A random weight-switch setup for `num_ranks` ranks, with a KV pool of random bytes (absent
// in about a third of the setups).
struct weight_setup {
  arena_geometry g;
  logical_weights w;
  int64_t kv_bytes = 0;
};

inline weight_setup random_weight_setup(std::mt19937_64& rng, int num_ranks, int64_t min_layers) {
  weight_setup su;
  expert_shape shape = random_shape(rng, num_ranks, coin(rng));
  shape.num_layers = std::max(shape.num_layers, min_layers);
  su.g = random_geometry(rng, shape, num_ranks);
  su.w = random_weights(shape, rng);
  su.kv_bytes = uniform(rng, 0, 2) == 0 ? 0 : uniform(rng, 1, 4096);
  return su;
}

// The arena images of every rank.
inline rank_images download_arena(const fixture_memory& m, int num_ranks) {
  rank_images images;
  for (int r = 0; r < num_ranks; ++r) images.push_back(m.download(r, memory_space::arena));
  return images;
}

// ---------------------------------------------------------------------------------------------
// The properties.

inline void reshard(transport_fixture& f) {
  std::mt19937_64 rng(test_seed());
  const int P = f.num_ranks();
  for (int round = 0; round < f.rounds(); ++round) {
    const weight_setup su = random_weight_setup(rng, P, 1);
    const int64_t L = su.g.shape.num_layers;
    // EP -> TP -> EP, then between random cursors.
    const arena_cursor path[] = {arena_cursor{0}, arena_cursor{L}, arena_cursor{0},
                                 random_cursor(rng, su.g), random_cursor(rng, su.g)};
    std::vector<plan> plans;
    for (size_t i = 1; i < std::size(path); ++i) {
      plans.push_back(plan_weight_switch(su.g, path[i - 1], path[i]));
    }
    CAPTURE(round, su.g, su.kv_bytes);
    const std::unique_ptr<fixture_memory> m = f.allocate({su.g.total_bytes(), su.kv_bytes});
    rank_images images;
    load_reference(su.w, su.g, path[0], images);
    for (int r = 0; r < P; ++r) m->upload(r, memory_space::arena, images[static_cast<size_t>(r)]);
    rank_images kv;
    for (int r = 0; r < P; ++r) {
      kv.push_back(random_bytes(rng, static_cast<size_t>(su.kv_bytes)));
      m->upload(r, memory_space::kv_pool, kv.back());
    }
    const std::unique_ptr<transport> t = f.make(*m, plans);
    REQUIRE(t->num_ranks() == P);
    for (size_t i = 0; i < plans.size(); ++i) {
      const arena_cursor from = path[i], to = path[i + 1];
      CAPTURE(from.tp_layers, to.tp_layers);
      // A destination the switch forgets then keeps random bytes instead of the reference's.
      images = download_arena(*m, P);
      scribble_slot(su.g, arena_geometry::free_slot(from), images, rng);
      for (int r = 0; r < P; ++r) m->upload(r, memory_space::arena, images[static_cast<size_t>(r)]);
      t->execute(plans[i]);
      CHECK(t->completed_phases() == static_cast<int64_t>(plans[i].phases.size()));
      REQUIRE(compare_to_reference(su.w, su.g, to, download_arena(*m, P)) == "");
    }
    for (int r = 0; r < P; ++r) {
      REQUIRE(m->download(r, memory_space::kv_pool) == kv[static_cast<size_t>(r)]);
    }
  }
}

inline void random_plans(transport_fixture& f) {
  std::mt19937_64 rng(test_seed());
  const int P = f.num_ranks();
  for (int round = 0; round < f.rounds(); ++round) {
    const random_plan_options o = random_options(rng);
    std::vector<plan> plans;
    for (int i = 0; i < 3; ++i) {
      plans.push_back(random_hazard_free_plan(rng, P, o));
      REQUIRE(check_phase_disjoint(plans.back()) == "");  // the generator keeps the phase rule
    }
    CAPTURE(round, o.space_bytes[0], o.space_bytes[1]);
    const std::unique_ptr<fixture_memory> m = f.allocate(sizes_of(o));
    const memory_state start = random_state(rng, P, sizes_of(o));
    upload_all(*m, start);
    host_twin twin(P, start);
    const std::unique_ptr<transport> t = f.make(*m, plans);
    for (size_t i = 0; i < plans.size(); ++i) {
      CAPTURE(i);
      run_and_compare(*t, *m, twin, plans[i]);
    }
  }
}

inline void caller_streams(transport_fixture& f) {
  std::mt19937_64 rng(test_seed());
  const int P = f.num_ranks();
  for (int round = 0; round < f.rounds(); ++round) {
    random_plan_options o = random_options(rng);
    o.min_phases = 2;
    // Direct enqueue (no graph) onto a held stream queues every launch at once; a few hundred
    // per stream stay well inside CUDA's launch queue, so enqueue() never has to wait for room.
    o.max_phases = 4;
    o.max_ops_per_phase = std::min(o.max_ops_per_phase, 40);
    const plan p = random_hazard_free_plan(rng, P, o);
    CAPTURE(round, o.space_bytes[0], o.space_bytes[1], p.num_ops());
    const std::unique_ptr<fixture_memory> m = f.allocate(sizes_of(o));
    const memory_state start = random_state(rng, P, sizes_of(o));
    upload_all(*m, start);
    host_twin twin(P, start);
    twin.execute(p);
    const std::unique_ptr<transport> t = f.make(*m, std::span<const plan>(&p, 1));
    const std::vector<int> local = t->local_ranks();
    REQUIRE(static_cast<int>(local.size()) == P);  // every fixture drives all ranks itself
    for (int i = 0; i < P; ++i) CHECK(local[static_cast<size_t>(i)] == i);
    CHECK(t->poll());  // nothing outstanding yet
    // Prepared first: enqueue of a prepared plan only launches, so it cannot wait for a
    // held stream behind the test's back.
    t->prepare(p);

    const std::unique_ptr<held_streams> held = f.hold_streams(*m);
    if (held == nullptr) {
      // A host-memory transport: null streams stand for its own; the plan is still outstanding
      // until wait().
      const std::vector<stream_handle> none(static_cast<size_t>(P), nullptr);
      t->enqueue(p, none);
      expect_error([&] { t->enqueue(p, none); }, errc::invalid_argument);
      t->wait();
      CHECK(t->poll());
      CHECK(t->completed_phases() == static_cast<int64_t>(p.phases.size()));
      REQUIRE(diff(download_all(*m, P), twin.state()) == "");
      continue;
    }
    const std::vector<stream_handle> streams = held->streams();
    REQUIRE(streams.size() == local.size());
    t->enqueue(p, streams);
    CHECK_FALSE(t->poll());  // the held streams have not run it
    // A second plan while one is outstanding is refused, and the first one is not disturbed.
    expect_error([&] { t->enqueue(p, streams); }, errc::invalid_argument);
    CHECK_FALSE(t->poll());
    // Work enqueued after the plan must see its result: a copy of the arena, rank by rank.
    held->enqueue_probe(memory_space::arena);
    held->release();
    t->wait();
    held->synchronize();
    CHECK_FALSE(held->expired());
    CHECK(t->poll());
    CHECK(t->completed_phases() == static_cast<int64_t>(p.phases.size()));
    const memory_state want = twin.state();
    REQUIRE(diff(download_all(*m, P), want) == "");
    for (int i = 0; i < P; ++i) {
      CAPTURE(i);
      REQUIRE(held->probe(i) == want.bytes[static_cast<int>(memory_space::arena)]
                                          [static_cast<size_t>(local[static_cast<size_t>(i)])]);
    }
  }
}

// Faults on weight switches: the arena rests at a cursor, and rollback_plan() undoes it.
inline void weight_switch_faults(transport_fixture& f, std::mt19937_64& rng) {
  const int P = f.num_ranks();
  const weight_setup su = random_weight_setup(rng, P, 2);
  const int64_t L = su.g.shape.num_layers;
  const arena_cursor a = random_cursor(rng, su.g);
  arena_cursor b = random_cursor(rng, su.g);
  if (b == a) b = arena_cursor{a.tp_layers == 0 ? L : 0};
  const plan p = plan_weight_switch(su.g, a, b);
  const int64_t k = uniform(rng, 0, static_cast<int64_t>(p.phases.size()) - 1);
  const int64_t op = uniform(rng, 0, static_cast<int64_t>(p.phases[static_cast<size_t>(k)].ops.size()) - 1);
  const plan undo = rollback_plan(p, k);
  CAPTURE(su.g, su.kv_bytes, a.tp_layers, b.tp_layers, k, op);

  const std::unique_ptr<fixture_memory> m = f.allocate({su.g.total_bytes(), su.kv_bytes});
  rank_images images;
  load_reference(su.w, su.g, a, images);
  scribble_slot(su.g, arena_geometry::free_slot(a), images, rng);
  for (int r = 0; r < P; ++r) m->upload(r, memory_space::arena, images[static_cast<size_t>(r)]);
  const rank_images kv_before = [&] {
    rank_images kv;
    for (int r = 0; r < P; ++r) {
      kv.push_back(random_bytes(rng, static_cast<size_t>(su.kv_bytes)));
      m->upload(r, memory_space::kv_pool, kv.back());
    }
    return kv;
  }();
  const std::unique_ptr<transport> t = f.make(*m, std::vector<plan>{p, undo});

  t->inject_fault(fault_point{k, op});
  t->enqueue(p);
  try {
    t->wait();
    FAIL("the injected fault did not fire");
  } catch (const moebius::error& e) {
    CAPTURE(e.what());
    REQUIRE(e.code() == errc::injected_fault);
  }
  REQUIRE(t->completed_phases() == k);
  CHECK(t->poll());
  // Phase j of a switch moves one layer: after k phases the arena rests at the cursor k layers
  // on (phase k wrote, at most, into that cursor's free slot, which is not compared).
  const arena_cursor reached{b.tp_layers > a.tp_layers ? a.tp_layers + k : a.tp_layers - k};
  REQUIRE(compare_to_reference(su.w, su.g, reached, download_arena(*m, P)) == "");

  // Undo on the same transport: every byte of every occupied slot is back (padding too).
  t->execute(undo);
  CHECK(t->completed_phases() == static_cast<int64_t>(undo.phases.size()));
  REQUIRE(compare_to_reference(su.w, su.g, a, download_arena(*m, P)) == "");
  // The fault was one-shot: the same plan now runs to the end.
  t->execute(p);
  CHECK(t->completed_phases() == static_cast<int64_t>(p.phases.size()));
  REQUIRE(compare_to_reference(su.w, su.g, b, download_arena(*m, P)) == "");
  for (int r = 0; r < P; ++r) {
    REQUIRE(m->download(r, memory_space::kv_pool) == kv_before[static_cast<size_t>(r)]);
  }
}

// Faults on random plans over both spaces: every byte is what host_transport leaves after the
// phases before the fault, or (phase k's destinations only) after phase k.
inline void random_plan_faults(transport_fixture& f, std::mt19937_64& rng) {
  const int P = f.num_ranks();
  random_plan_options o = random_options(rng);
  o.min_phases = 2;
  plan p;
  do {
    p = random_hazard_free_plan(rng, P, o);
  } while (p.num_ops() == 0);
  int64_t k = uniform(rng, 0, static_cast<int64_t>(p.phases.size()) - 1);
  while (p.phases[static_cast<size_t>(k)].ops.empty()) {
    k = (k + 1) % static_cast<int64_t>(p.phases.size());
  }
  const int64_t op = uniform(rng, 0, static_cast<int64_t>(p.phases[static_cast<size_t>(k)].ops.size()) - 1);
  const plan next = random_hazard_free_plan(rng, P, o);
  CAPTURE(o.space_bytes[0], o.space_bytes[1], p.num_ops(), k, op);

  const std::unique_ptr<fixture_memory> m = f.allocate(sizes_of(o));
  const memory_state start = random_state(rng, P, sizes_of(o));
  upload_all(*m, start);
  host_twin before_k(P, start);
  before_k.execute(first_phases(p, k));
  host_twin after_k(P, before_k.state());
  after_k.execute(only_phase(p, k));

  const std::unique_ptr<transport> t = f.make(*m, std::vector<plan>{p, next});
  t->inject_fault(fault_point{k, op});
  try {
    t->execute(p);
    FAIL("the injected fault did not fire");
  } catch (const moebius::error& e) {
    CAPTURE(e.what());
    REQUIRE(e.code() == errc::injected_fault);
  }
  REQUIRE(t->completed_phases() == k);
  const memory_state want = before_k.state();
  const memory_state or_want = after_k.state();
  REQUIRE(diff(download_all(*m, P), want, &or_want) == "");

  // Usable again, from the state it left behind.
  const memory_state now = download_all(*m, P);
  host_twin twin(P, now);
  run_and_compare(*t, *m, twin, next);
}

inline void faults(transport_fixture& f) {
  std::mt19937_64 rng(test_seed());
  for (int round = 0; round < f.rounds(); ++round) {
    CAPTURE(round);
    weight_switch_faults(f, rng);
    random_plan_faults(f, rng);
  }

  // A disarmed fault, and one the plan does not reach, do not fire.
  const int P = f.num_ranks();
  random_plan_options o = random_options(rng);
  o.min_phases = 2;
  const plan p = random_hazard_free_plan(rng, P, o);
  const std::unique_ptr<fixture_memory> m = f.allocate(sizes_of(o));
  const memory_state start = random_state(rng, P, sizes_of(o));
  upload_all(*m, start);
  host_twin twin(P, start);
  const std::unique_ptr<transport> t = f.make(*m, std::span<const plan>(&p, 1));
  t->inject_fault(fault_point{0, 0});
  t->inject_fault(std::nullopt);
  run_and_compare(*t, *m, twin, p);
  t->inject_fault(fault_point{static_cast<int64_t>(p.phases.size()), 0});  // past the last phase
  run_and_compare(*t, *m, twin, p);
  t->inject_fault(fault_point{0, static_cast<int64_t>(p.phases[0].ops.size())});  // past the last op
  run_and_compare(*t, *m, twin, p);
  run_and_compare(*t, *m, twin, p);  // nothing left armed
}

inline void validation(transport_fixture& f) {
  std::mt19937_64 rng(test_seed());
  const int P = f.num_ranks();
  for (int round = 0; round < f.rounds(); ++round) {
    random_plan_options o = random_options(rng);
    o.min_phases = 2;
    plan p;
    do {
      p = random_hazard_free_plan(rng, P, o);
    } while (p.phases.back().ops.empty());
    CAPTURE(round, o.space_bytes[0], o.space_bytes[1], p.num_ops());
    const std::unique_ptr<fixture_memory> m = f.allocate(sizes_of(o));
    const memory_state start = random_state(rng, P, sizes_of(o));
    upload_all(*m, start);
    host_twin twin(P, start);
    const std::unique_ptr<transport> t = f.make(*m, std::span<const plan>(&p, 1));

    // Corrupt one op of the last phase: the phases before it must not run either.
    std::vector<std::pair<std::string, std::pair<plan, errc>>> bad;
    const auto corrupt = [&](const std::string& what, errc want, auto&& change) {
      plan q = p;
      auto& ops = q.phases.back().ops;
      copy_op& victim =
          ops[static_cast<size_t>(uniform(rng, 0, static_cast<int64_t>(ops.size()) - 1))];
      change(victim);
      bad.push_back({what, {std::move(q), want}});
    };
    const auto cap = [&](memory_space s) { return o.space_bytes[static_cast<int>(s)]; };
    corrupt("destination past the end of its space", errc::out_of_range,
            [&](copy_op& op) { op.dst_offset = cap(op.dst_space) - (op.dst_end() - op.dst_offset) + 1; });
    corrupt("source past the end of its space", errc::out_of_range,
            [&](copy_op& op) { op.src_offset = cap(op.src_space) - (op.src_end() - op.src_offset) + 1; });
    corrupt("negative source offset", errc::out_of_range, [](copy_op& op) { op.src_offset = -1; });
    corrupt("negative destination offset", errc::out_of_range,
            [](copy_op& op) { op.dst_offset = -16; });
    corrupt("destination rank P", errc::invalid_argument, [&](copy_op& op) { op.dst_rank = P; });
    corrupt("source rank -1", errc::invalid_argument, [](copy_op& op) { op.src_rank = -1; });
    corrupt("a memory space that does not exist", errc::invalid_argument,
            [](copy_op& op) { op.src_space = static_cast<memory_space>(7); });
    corrupt("no rows", errc::invalid_argument, [](copy_op& op) { op.rows = 0; });
    corrupt("empty rows", errc::invalid_argument, [](copy_op& op) { op.row_bytes = 0; });
    {
      plan more = p;
      more.num_ranks = P + 1;
      bad.push_back({"a plan for P + 1 ranks", {std::move(more), errc::invalid_argument}});
    }

    for (const auto& [what, q_want] : bad) {
      const auto& [q, want] = q_want;
      CAPTURE(what);
      expect_error([&] { t->validate(q); }, want);
      expect_error([&] { t->prepare(q); }, want);
      expect_error([&] { t->enqueue(q); }, want);
      CHECK(t->poll());  // nothing was started
      t->wait();         // and nothing is outstanding
      REQUIRE(diff(download_all(*m, P), start) == "");
    }
    // Streams: one per local rank, or none.
    for (const size_t n : {static_cast<size_t>(P) + 1, static_cast<size_t>(P) - 1}) {
      if (n == 0) continue;  // P == 1: no streams is the valid "none"
      CAPTURE(n);
      const std::vector<stream_handle> streams(n, nullptr);
      expect_error([&] { t->enqueue(p, streams); }, errc::invalid_argument);
      CHECK(t->poll());
      t->wait();
      REQUIRE(diff(download_all(*m, P), start) == "");
    }
    // The transport is unharmed.
    run_and_compare(*t, *m, twin, p);
  }
}

inline void prepare_and_cache(transport_fixture& f) {
  std::mt19937_64 rng(test_seed());
  const int P = f.num_ranks();
  for (int round = 0; round < f.rounds(); ++round) {
    const random_plan_options o = random_options(rng);
    const plan p1 = random_hazard_free_plan(rng, P, o);
    const plan p2 = random_hazard_free_plan(rng, P, o);
    // p1 with one source moved: equal but for one offset, so a cache keyed too loosely would
    // run p1's prepared work.
    plan p1b = p1;
    for (plan_phase& ph : p1b.phases) {
      if (ph.ops.empty()) continue;
      copy_op& op = ph.ops[static_cast<size_t>(uniform(rng, 0, static_cast<int64_t>(ph.ops.size()) - 1))];
      const int64_t half = o.space_bytes[static_cast<int>(op.src_space)] / 2;
      const int64_t base = op.src_offset >= half ? half : 0;
      const int64_t extent = op.src_end() - op.src_offset;
      int64_t moved = base + uniform(rng, 0, half - extent);
      if (moved == op.src_offset) moved = moved > base ? moved - 1 : moved + 1;
      if (moved + extent <= base + half) op.src_offset = moved;
      break;
    }
    CAPTURE(round, o.space_bytes[0], o.space_bytes[1], p1.num_ops(), p2.num_ops());
    const std::unique_ptr<fixture_memory> m = f.allocate(sizes_of(o));
    const memory_state start = random_state(rng, P, sizes_of(o));
    upload_all(*m, start);
    host_twin twin(P, start);
    const std::unique_ptr<transport> t = f.make(*m, std::vector<plan>{p1, p2, p1b});
    t->prepare(p1);
    t->prepare(p2);
    t->prepare(p1);  // preparing twice is harmless
    run_and_compare(*t, *m, twin, p1);
    run_and_compare(*t, *m, twin, p2);
    run_and_compare(*t, *m, twin, p1);  // from the cache, on different bytes
    run_and_compare(*t, *m, twin, p1b);
    run_and_compare(*t, *m, twin, p1);
    // An empty plan and a plan of empty phases are valid and move nothing.
    plan empty;
    empty.num_ranks = P;
    run_and_compare(*t, *m, twin, empty);
    empty.phases.resize(2);
    run_and_compare(*t, *m, twin, empty);
  }
}

inline void phase_events(transport_fixture& f) {
  std::mt19937_64 rng(test_seed());
  const int P = f.num_ranks();
  for (int round = 0; round < f.rounds(); ++round) {
    random_plan_options o = random_options(rng);
    o.min_phases = 2;
    o.max_phases = 4;  // held streams queue every launch at once (see caller_streams)
    o.max_ops_per_phase = std::min(o.max_ops_per_phase, 40);
    const plan p = random_hazard_free_plan(rng, P, o);
    const auto num_phases = static_cast<int64_t>(p.phases.size());
    CAPTURE(round, num_phases, p.num_ops());
    const std::unique_ptr<fixture_memory> m = f.allocate(sizes_of(o));
    const memory_state start = random_state(rng, P, sizes_of(o));
    upload_all(*m, start);
    host_twin twin(P, start);
    const std::unique_ptr<transport> t = f.make(*m, std::span<const plan>(&p, 1));
    const size_t num_local = t->local_ranks().size();
    using wait = transport::phase_wait;
    const std::vector<event_handle> none(num_local, nullptr);

    // Bad arguments are refused (and leave nothing armed: the next plan runs plainly).
    expect_error([&] { t->mark_phases(std::vector<int64_t>{-1}); }, errc::invalid_argument);
    expect_error([&] { t->mark_phases(std::vector<int64_t>{1, 1}); }, errc::invalid_argument);
    expect_error([&] { t->wait_before_phases(std::vector<wait>{{1, none}, {0, none}}); },
                 errc::invalid_argument);
    expect_error([&] { t->wait_before_phases(std::vector<wait>{{-1, none}}); },
                 errc::invalid_argument);
    expect_error(
        [&] { t->wait_before_phases(std::vector<wait>{{0, std::vector<event_handle>(num_local + 1)}}); },
        errc::invalid_argument);
    run_and_compare(*t, *m, twin, p);
    expect_error([&] { (void)t->phase_event(0, 0); }, errc::out_of_range);  // no marks asked

    // Marks after every phase (and one past the end, dropped), waits with nothing to wait for.
    std::vector<int64_t> marks(static_cast<size_t>(num_phases));
    for (int64_t k = 0; k < num_phases; ++k) marks[static_cast<size_t>(k)] = k;
    marks.push_back(num_phases + 3);
    t->mark_phases(marks);
    t->wait_before_phases(std::vector<wait>{{0, none}, {num_phases - 1, none}, {num_phases + 1, none}});
    run_and_compare(*t, *m, twin, p);
    for (size_t j = 0; j < static_cast<size_t>(num_phases); ++j) {
      for (size_t i = 0; i < num_local; ++i) (void)t->phase_event(j, i);
    }
    expect_error([&] { (void)t->phase_event(static_cast<size_t>(num_phases), 0); },
                 errc::out_of_range);
    expect_error([&] { (void)t->phase_event(0, num_local); }, errc::out_of_range);

    // Fresh bytes, so that the gated plan changes them; uploaded and prepared before any stream
    // is held (both may synchronize the device).
    const memory_state fresh = random_state(rng, P, sizes_of(o));
    upload_all(*m, fresh);
    host_twin gated(P, fresh);
    t->prepare(p);
    const std::unique_ptr<held_streams> held = f.hold_streams(*m);
    if (held == nullptr) {
      // The host transport has run its plan inside enqueue(): nothing to wait for.
      for (size_t i = 0; i < num_local; ++i) CHECK(t->phase_event(0, i) == nullptr);
      const std::vector<event_handle> some(num_local, reinterpret_cast<event_handle>(0x1));
      expect_error([&] { t->wait_before_phases(std::vector<wait>{{0, some}}); },
                   errc::invalid_argument);
      continue;
    }
    // Phase 0 waits for events behind the held streams; the plan runs on the transport's own
    // streams, so only the wait holds it back.
    const std::vector<event_handle> gate = held->record_events();
    REQUIRE(gate.size() == num_local);
    t->mark_phases(marks);
    t->wait_before_phases(std::vector<wait>{{0, gate}});
    t->enqueue(p);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK_FALSE(t->poll());
    for (size_t j = 0; j < static_cast<size_t>(num_phases); ++j) {
      for (size_t i = 0; i < num_local; ++i) {
        CAPTURE(j, i);
        CHECK_FALSE(held->fired(t->phase_event(j, i)));
      }
    }
    REQUIRE(diff(download_all(*m, P), fresh) == "");  // nothing moved yet
    held->release();
    t->wait();
    held->synchronize();
    CHECK_FALSE(held->expired());
    for (size_t j = 0; j < static_cast<size_t>(num_phases); ++j) {
      for (size_t i = 0; i < num_local; ++i) CHECK(held->fired(t->phase_event(j, i)));
    }
    gated.execute(p);
    REQUIRE(diff(download_all(*m, P), gated.state()) == "");
  }
}

// Runs `property` on every fixture of `make_fixtures()`, each in a section named after it.
inline void run_on_fixtures(const std::function<fixture_list()>& make_fixtures,
                            void (*property)(transport_fixture&)) {
  const fixture_list fixtures = make_fixtures();
  REQUIRE_FALSE(fixtures.empty());
  for (const std::unique_ptr<transport_fixture>& fx : fixtures) {
    DYNAMIC_SECTION(fx->name()) { property(*fx); }
  }
}

}  // namespace conformance
}  // namespace moebius::testing

// One test case per property, over the fixtures `make_fixtures` (a callable returning
// moebius::testing::fixture_list) returns. `prefix` names the transport, `tags` is a string
// literal of Catch tags.
#define MOEBIUS_TRANSPORT_CONFORMANCE(prefix, tags, make_fixtures)                                \
  TEST_CASE(prefix ": a weight reshard equals the static-load reference",                        \
            tags "[conformance][reshard]") {                                                     \
    ::moebius::testing::conformance::run_on_fixtures(make_fixtures,                              \
                                                     &::moebius::testing::conformance::reshard); \
  }                                                                                              \
  TEST_CASE(prefix ": random hazard-free plans match host_transport",                            \
            tags "[conformance][random_plan]") {                                                 \
    ::moebius::testing::conformance::run_on_fixtures(                                            \
        make_fixtures, &::moebius::testing::conformance::random_plans);                          \
  }                                                                                              \
  TEST_CASE(prefix ": enqueue on caller streams does not wait, and orders later work",           \
            tags "[conformance][streams]") {                                                     \
    ::moebius::testing::conformance::run_on_fixtures(                                            \
        make_fixtures, &::moebius::testing::conformance::caller_streams);                        \
  }                                                                                              \
  TEST_CASE(prefix ": injected faults stop at their phase and roll back",                        \
            tags "[conformance][fault]") {                                                       \
    ::moebius::testing::conformance::run_on_fixtures(make_fixtures,                              \
                                                     &::moebius::testing::conformance::faults);  \
  }                                                                                              \
  TEST_CASE(prefix ": bad plans and streams are rejected before anything moves",                 \
            tags "[conformance][validate]") {                                                    \
    ::moebius::testing::conformance::run_on_fixtures(                                            \
        make_fixtures, &::moebius::testing::conformance::validation);                            \
  }                                                                                              \
  TEST_CASE(prefix ": prepared and cached plans give the same bytes",                            \
            tags "[conformance][cache]") {                                                       \
    ::moebius::testing::conformance::run_on_fixtures(                                            \
        make_fixtures, &::moebius::testing::conformance::prepare_and_cache);                     \
  }                                                                                              \
  TEST_CASE(prefix ": phase marks fire after their phases, phase waits hold them back",          \
            tags "[conformance][events]") {                                                      \
    ::moebius::testing::conformance::run_on_fixtures(                                            \
        make_fixtures, &::moebius::testing::conformance::phase_events);                          \
  }
