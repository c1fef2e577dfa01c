// validate(plan, space_bytes): every op must name real ranks, be non-empty and stay inside
// its memory space at both ends, with 64-bit arithmetic that refuses to wrap.

#include <cstdint>
#include <limits>
#include <string>

#include "moebius/error.hpp"
#include "moebius/plan/plan.hpp"
#include "support/catch.hpp"

using namespace moebius;

namespace {

const int64_t k_space[num_memory_spaces] = {1000, 64};

plan one_op(copy_op op, int num_ranks = 2) {
  plan p;
  p.num_ranks = num_ranks;
  p.phases.push_back({"only", {op}});
  return p;
}

copy_op good_op() {
  copy_op op;
  op.src_rank = 0;
  op.dst_rank = 1;
  op.src_offset = 0;
  op.dst_offset = 500;
  op.rows = 1;
  op.row_bytes = 100;
  op.src_pitch = op.dst_pitch = 100;
  return op;
}

void require_rejected(const copy_op& op, errc code, const std::string& substring,
                      int num_ranks = 2) {
  INFO("op " << op);
  try {
    validate(one_op(op, num_ranks), k_space);
    FAIL("no throw");
  } catch (const moebius::error& e) {
    INFO("message: " << e.what());
    CHECK(e.code() == code);
    CHECK(std::string(e.what()).find(substring) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("valid ops pass", "[plan][validate]") {
  CHECK_NOTHROW(validate(one_op(good_op()), k_space));
  copy_op op = good_op();
  op.dst_offset = 900;  // ends exactly at the end of the space
  CHECK_NOTHROW(validate(one_op(op), k_space));
  op.rows = 3;
  op.src_pitch = 300;
  op.dst_pitch = 100;
  op.dst_offset = 700;
  op.src_offset = 300;  // src ends at 300 + 2*300 + 100 = 1000
  CHECK_NOTHROW(validate(one_op(op), k_space));
  op = good_op();
  op.dst_space = memory_space::kv_pool;
  op.dst_offset = 0;
  op.row_bytes = 64;
  CHECK_NOTHROW(validate(one_op(op), k_space));
  CHECK_NOTHROW(validate(plan{2, {}}, k_space));
}

TEST_CASE("ops beyond the space are rejected", "[plan][validate]") {
  copy_op op = good_op();
  op.dst_offset = 901;
  require_rejected(op, errc::out_of_range, "writes up to byte 1001");
  op = good_op();
  op.src_offset = 950;
  require_rejected(op, errc::out_of_range, "reads up to byte 1050");
  op = good_op();
  op.rows = 3;
  op.dst_pitch = 400;
  op.dst_offset = 0;
  op.row_bytes = 300;  // 0 + 2*400 + 300 = 1100
  require_rejected(op, errc::out_of_range, "writes up to byte 1100");
  op = good_op();
  op.dst_space = memory_space::kv_pool;
  op.dst_offset = 0;  // 100 bytes into a 64-byte space
  require_rejected(op, errc::out_of_range, "of kv_pool (64 bytes)");
}

TEST_CASE("negative offsets are rejected", "[plan][validate]") {
  copy_op op = good_op();
  op.src_offset = -1;
  require_rejected(op, errc::out_of_range, "negative offset");
  op = good_op();
  op.dst_offset = std::numeric_limits<int64_t>::min();
  require_rejected(op, errc::out_of_range, "negative offset");
}

TEST_CASE("ops whose extent overflows 64 bits are rejected", "[plan][validate]") {
  copy_op op = good_op();
  op.src_offset = std::numeric_limits<int64_t>::max() - 10;
  require_rejected(op, errc::overflow, "overflows 64 bits");
  op = good_op();
  op.rows = int64_t{1} << 40;
  op.dst_pitch = int64_t{1} << 40;
  require_rejected(op, errc::overflow, "overflows 64 bits");
  op = good_op();
  op.rows = 2;
  op.row_bytes = std::numeric_limits<int64_t>::max();
  op.src_pitch = op.dst_pitch = std::numeric_limits<int64_t>::max();
  require_rejected(op, errc::overflow, "overflows 64 bits");
}

TEST_CASE("malformed ops are rejected", "[plan][validate]") {
  copy_op op = good_op();
  op.dst_rank = 2;
  require_rejected(op, errc::invalid_argument, "names a rank outside [0, 2)");
  op = good_op();
  op.src_rank = -1;
  require_rejected(op, errc::invalid_argument, "names a rank outside");
  op = good_op();
  op.rows = 0;
  require_rejected(op, errc::invalid_argument, "rows >= 1 and row_bytes >= 1");
  op = good_op();
  op.row_bytes = 0;
  require_rejected(op, errc::invalid_argument, "rows >= 1 and row_bytes >= 1");
  op = good_op();
  op.rows = 2;
  op.dst_pitch = 99;  // rows of the destination would overlap
  require_rejected(op, errc::invalid_argument, "dst_pitch >= row_bytes");
  op = good_op();
  op.rows = 2;
  op.src_pitch = -100;
  require_rejected(op, errc::invalid_argument, "src_pitch >= 0");
  require_rejected(good_op(), errc::invalid_argument, "num_ranks >= 1", 0);
  // A bad op in a later phase is found too.
  plan p = one_op(good_op());
  copy_op bad = good_op();
  bad.dst_offset = 2000;
  p.phases.push_back({"second", {good_op(), bad}});
  try {
    validate(p, k_space);
    FAIL("no throw");
  } catch (const moebius::error& e) {
    CHECK(e.code() == errc::out_of_range);
    CHECK(std::string(e.what()).find("op 1 of phase 1") != std::string::npos);
  }
}
