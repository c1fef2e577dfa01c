// hash_of(plan) and fingerprint_of(plan). hash_of: equal plans hash equal, and changing any
// one field of a random plan changes the hash (a cache keyed by it would otherwise run a stale
// prepared plan... or, with the operator== confirmation, only lose hits; either way a
// collision here is a bug).

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <unordered_set>

#include "moebius/plan/plan.hpp"
#include "support/catch.hpp"
#include "support/random.hpp"

using namespace moebius;
using moebius::testing::uniform;

namespace {

copy_op random_op(std::mt19937_64& rng, int num_ranks) {
  copy_op op;
  op.src_rank = static_cast<int32_t>(uniform(rng, 0, num_ranks - 1));
  op.dst_rank = static_cast<int32_t>(uniform(rng, 0, num_ranks - 1));
  op.src_space = static_cast<memory_space>(uniform(rng, 0, num_memory_spaces - 1));
  op.dst_space = static_cast<memory_space>(uniform(rng, 0, num_memory_spaces - 1));
  op.rows = uniform(rng, 1, 64);
  op.row_bytes = uniform(rng, 1, 4096);
  op.src_pitch = op.row_bytes + uniform(rng, 0, 256);
  op.dst_pitch = op.row_bytes + uniform(rng, 0, 256);
  op.src_offset = uniform(rng, 0, int64_t{1} << 40);
  op.dst_offset = uniform(rng, 0, int64_t{1} << 40);
  return op;
}

plan random_plan(std::mt19937_64& rng) {
  plan p;
  p.num_ranks = static_cast<int>(uniform(rng, 1, 8));
  const int64_t phases = uniform(rng, 1, 5);
  for (int64_t k = 0; k < phases; ++k) {
    plan_phase ph;
    ph.label = "phase " + std::to_string(uniform(rng, 0, 1000));
    const int64_t ops = uniform(rng, 1, 20);
    for (int64_t i = 0; i < ops; ++i) ph.ops.push_back(random_op(rng, p.num_ranks));
    const int64_t restores = uniform(rng, 0, 3);
    for (int64_t i = 0; i < restores; ++i) ph.restores.push_back(random_op(rng, p.num_ranks));
    p.phases.push_back(std::move(ph));
  }
  return p;
}

// Changes exactly one field of one op (or the plan or a phase) of `p`.
void mutate_one_field(std::mt19937_64& rng, plan& p) {
  plan_phase& ph = p.phases[static_cast<size_t>(uniform(rng, 0, static_cast<int64_t>(p.phases.size()) - 1))];
  const int64_t what = uniform(rng, 0, 13);
  if (what == 0) { ++p.num_ranks; return; }
  if (what == 1) { ph.label += "x"; return; }
  if (what == 2) { ph.restores.push_back(ph.ops.front()); return; }
  if (what == 3) { ph.ops.pop_back(); return; }
  copy_op& op = ph.ops[static_cast<size_t>(uniform(rng, 0, static_cast<int64_t>(ph.ops.size()) - 1))];
  const int64_t delta = uniform(rng, 1, 1 << 20);
  switch (what) {
    case 4: op.src_offset += delta; break;
    case 5: op.dst_offset += delta; break;
    case 6: op.rows += delta; break;
    case 7: op.row_bytes += delta; break;
    case 8: op.src_pitch += delta; break;
    case 9: op.dst_pitch += delta; break;
    case 10: op.src_rank += 1; break;
    case 11: op.dst_rank += 1; break;
    case 12: op.src_space = op.src_space == memory_space::arena ? memory_space::kv_pool : memory_space::arena; break;
    default: op.dst_space = op.dst_space == memory_space::arena ? memory_space::kv_pool : memory_space::arena; break;
  }
}

}  // namespace

TEST_CASE("hash_of: equal plans hash equal, a one-field change changes the hash") {
  std::mt19937_64 rng(0x5eed1234);
  for (int trial = 0; trial < 2000; ++trial) {
    const plan p = random_plan(rng);
    const plan copy = p;  // NOLINT(performance-unnecessary-copy-initialization): the point
    REQUIRE(hash_of(copy) == hash_of(p));
    REQUIRE(std::hash<plan>{}(copy) == std::hash<plan>{}(p));
    plan changed = p;
    mutate_one_field(rng, changed);
    REQUIRE(changed != p);
    INFO("trial " << trial);
    REQUIRE(hash_of(changed) != hash_of(p));
  }
}

TEST_CASE("hash_of: an op moved across a phase boundary changes the hash") {
  plan a;
  a.num_ranks = 2;
  copy_op op;
  op.row_bytes = 8;
  a.phases = {{"", {op, op}}, {"", {op}}};
  plan b = a;
  b.phases = {{"", {op}}, {"", {op, op}}};
  REQUIRE(hash_of(a) != hash_of(b));
  plan c = a;
  c.phases[0].ops.pop_back();
  c.phases[0].restores.push_back(op);
  REQUIRE(hash_of(a) != hash_of(c));
}

TEST_CASE("hash_of: distinct random plans do not collide") {
  std::mt19937_64 rng(77);
  std::unordered_set<uint64_t> seen;
  for (int i = 0; i < 5000; ++i) seen.insert(hash_of(random_plan(rng)));
  REQUIRE(seen.size() == 5000);
}

// fingerprint_of reads sizes and up to 16 ops per phase: equal plans give equal fingerprints;
// a change in a sampled op or in any size changes it; a change in an unsampled op may not
// (the cache's == confirms), which is what makes it O(phases).
TEST_CASE("fingerprint_of: equal plans agree, sampled fields and sizes are seen") {
  std::mt19937_64 rng(0x5eed5678);
  for (int trial = 0; trial < 2000; ++trial) {
    const plan p = random_plan(rng);  // at most 20 ops a phase: op 0 and the last always sampled
    const plan copy = p;  // NOLINT(performance-unnecessary-copy-initialization): the point
    REQUIRE(fingerprint_of(copy) == fingerprint_of(p));
    INFO("trial " << trial);
    plan changed = p;
    changed.phases.back().ops.back().src_offset += 1 + static_cast<int64_t>(rng() % 4096);
    REQUIRE(fingerprint_of(changed) != fingerprint_of(p));
    changed = p;
    changed.phases.front().ops.push_back(changed.phases.front().ops.front());
    REQUIRE(fingerprint_of(changed) != fingerprint_of(p));
  }
  // 1000 ops: op 1 is not among the 16 sampled (0, 66, 133, ...), so its change goes unseen.
  plan big = random_plan(rng);
  big.phases.resize(1);
  while (big.phases[0].ops.size() < 1000) big.phases[0].ops.push_back(big.phases[0].ops.front());
  plan unseen = big;
  unseen.phases[0].ops[1].dst_offset += 64;
  REQUIRE(unseen != big);
  REQUIRE(fingerprint_of(unseen) == fingerprint_of(big));
  unseen.phases[0].ops[66].dst_offset += 64;
  REQUIRE(fingerprint_of(unseen) != fingerprint_of(big));
}
