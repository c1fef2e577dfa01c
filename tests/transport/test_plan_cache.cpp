// The transports' cache of prepared plans (src/transport/plan_cache.hpp): a hit needs an equal
// plan (a change in an op the fingerprint does not sample is a miss), the least recently used
// entry goes first, and capacity 0 keeps nothing.
#include <cstdint>
#include <memory>
#include <string>

#include "moebius/plan/plan.hpp"
#include "plan_cache.hpp"
#include "support/catch.hpp"

using namespace moebius;

namespace {

// One phase of `ops` one-row copies from rank 0 to rank 1, op i at offset 16 * i + shift.
plan copies(int64_t ops, int64_t shift) {
  plan p;
  p.num_ranks = 2;
  plan_phase& ph = p.phases.emplace_back();
  ph.label = "copies";
  for (int64_t i = 0; i < ops; ++i) {
    copy_op op;
    op.src_rank = 0;
    op.dst_rank = 1;
    op.src_offset = 16 * i + shift;
    op.dst_offset = 16 * i;
    op.row_bytes = 16;
    ph.ops.push_back(op);
  }
  return p;
}

}  // namespace

TEST_CASE("plan_cache: equal plans hit, others miss, least recently used dropped first") {
  const plan a = copies(1000, 0);
  plan a_unsampled = a;  // equal fingerprint (op 1 is not sampled), not equal
  a_unsampled.phases[0].ops[1].dst_offset += 64;
  REQUIRE(fingerprint_of(a_unsampled) == fingerprint_of(a));
  const plan b = copies(10, 1);
  const plan c = copies(10, 2);

  detail::plan_cache<int> cache;
  REQUIRE(cache.find(a) == nullptr);
  cache.insert(a, std::make_shared<const int>(1), 2);
  cache.insert(b, std::make_shared<const int>(2), 2);
  const plan a_copy = a;  // NOLINT(performance-unnecessary-copy-initialization): the point
  REQUIRE(cache.find(a_copy) != nullptr);
  CHECK(*cache.find(a_copy) == 1);
  CHECK(cache.find(a_unsampled) == nullptr);
  // a was used last: inserting c drops b.
  cache.insert(c, std::make_shared<const int>(3), 2);
  CHECK(cache.size() == 2);
  CHECK(cache.find(b) == nullptr);
  CHECK(*cache.find(a) == 1);
  CHECK(*cache.find(c) == 3);
  cache.insert(b, std::make_shared<const int>(2), 0);  // capacity 0: not kept
  CHECK(cache.find(b) == nullptr);
  CHECK(cache.size() == 2);
  cache.clear();
  CHECK(cache.size() == 0);
  CHECK(cache.find(a) == nullptr);
}
