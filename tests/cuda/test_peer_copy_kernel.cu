// The fused copy kernel on its own: random ops (1 byte .. 1 MiB, unaligned offsets, odd
// pitches, source pitch below row_bytes) launched with launch_peer_copy must produce exactly
// what host memcpy of the same ops produces, for several chunk sizes and grid shapes.

#include <cstring>
#include <random>
#include <vector>

#include "support/cuda_test_util.hpp"
#include "moebius/cuda/peer_kernels.hpp"
#include "support/catch.hpp"
#include "support/reference.hpp"

namespace mt = moebius::testing;
using moebius::barrier_status;
using moebius::peer_copy_args;
using moebius::peer_copy_desc;

namespace {

struct host_op {
  int64_t src_offset, dst_offset, rows, row_bytes, src_pitch, dst_pitch;
};

// Random ops whose destinations do not overlap: a bump allocator over dst.
std::vector<host_op> random_ops(std::mt19937_64& rng, int64_t bytes, int max_ops,
                                int64_t max_op_bytes) {
  std::vector<host_op> ops;
  int64_t used = 0;
  for (int i = 0; i < max_ops; ++i) {
    const int64_t room = bytes - used - 64;
    if (room < 64) break;
    const int64_t budget = std::min(room, max_op_bytes);
    host_op op{};
    const int kind = static_cast<int>(mt::uniform(rng, 0, 3));
    if (kind == 0) {  // contiguous
      op.rows = 1;
      op.row_bytes = mt::uniform(rng, 1, budget);
      op.src_pitch = op.dst_pitch = 0;
    } else if (kind == 1) {  // big rows
      op.row_bytes = mt::uniform(rng, 1, budget);
      op.dst_pitch = op.row_bytes + mt::uniform(rng, 0, 33);
      op.rows = mt::uniform(rng, 1, std::max<int64_t>(1, budget / op.dst_pitch));
      op.src_pitch = op.row_bytes + mt::uniform(rng, 0, 99);
    } else if (kind == 2) {  // many short rows, 16-byte multiples (the flattened path)
      op.row_bytes = 16 * mt::uniform(rng, 1, 20);
      op.dst_pitch = op.row_bytes + 16 * mt::uniform(rng, 0, 3);
      op.rows = mt::uniform(rng, 1, std::max<int64_t>(1, budget / op.dst_pitch));
      op.src_pitch = op.row_bytes + 16 * mt::uniform(rng, 0, 3);
    } else {  // short rows, odd everything, source rows overlapping
      op.row_bytes = mt::uniform(rng, 1, 300);
      op.dst_pitch = op.row_bytes + mt::uniform(rng, 0, 7);
      op.rows = mt::uniform(rng, 1, std::max<int64_t>(1, budget / op.dst_pitch));
      op.src_pitch = mt::uniform(rng, 0, op.row_bytes + 5);
    }
    const int64_t dst_extent = (op.rows - 1) * op.dst_pitch + op.row_bytes;
    const int64_t src_extent = (op.rows - 1) * op.src_pitch + op.row_bytes;
    if (dst_extent > room || src_extent > bytes) continue;
    // 16-aligned base sometimes, to hit the vector paths from their first byte.
    const int64_t skip = mt::coin(rng) ? (16 - used % 16) % 16 : mt::uniform(rng, 0, 15);
    op.dst_offset = used + skip;
    used = op.dst_offset + dst_extent;
    op.src_offset = mt::uniform(rng, 0, bytes - src_extent);
    if (mt::coin(rng)) {  // same misalignment as dst: vector body after a byte-wise head
      op.src_offset -= ((op.src_offset - op.dst_offset) % 16 + 16) % 16;
      if (op.src_offset < 0) op.src_offset += 16;
      if (op.src_offset + src_extent > bytes) op.src_offset = 0;
    }
    ops.push_back(op);
  }
  return ops;
}

void host_apply(const std::vector<host_op>& ops, const std::vector<std::byte>& src,
                std::vector<std::byte>& dst) {
  for (const host_op& op : ops) {
    for (int64_t r = 0; r < op.rows; ++r) {
      std::memcpy(dst.data() + op.dst_offset + r * op.dst_pitch,
                  src.data() + op.src_offset + r * op.src_pitch,
                  static_cast<size_t>(op.row_bytes));
    }
  }
}

}  // namespace

TEST_CASE("fused copy kernel matches host memcpy for random unaligned ops", "[peer_copy]") {
  const uint64_t seed = mt::test_seed();
  std::mt19937_64 rng(seed);
  const int64_t bytes = int64_t{6} << 20;
  mt::device_buffer d_src(0, static_cast<size_t>(bytes));
  mt::device_buffer d_dst(0, static_cast<size_t>(bytes));
  mt::device_buffer d_status(0, sizeof(barrier_status));
  MOEBIUS_CUDA_CHECK(cudaMemset(d_status.data(), 0, sizeof(barrier_status)));

  struct grid_case {
    int64_t chunk;
    int blocks;
    int threads;
  };
  const grid_case grids[] = {{32 << 10, 132, 512}, {16, 1, 32},     {64, 7, 96},
                             {4096, 33, 256},      {1 << 20, 2, 512}, {256 << 10, 200, 128}};
  for (int iter = 0; iter < 24; ++iter) {
    const grid_case g = grids[iter % 6];
    static constexpr int64_t op_sizes[] = {1, 17, 4096, 65536, int64_t{1} << 20};
    const int64_t max_op = mt::pick(rng, op_sizes);
    // Tiny chunks make millions of work items out of big ops: keep those ops small.
    const int64_t op_cap = g.chunk <= 64 ? std::min<int64_t>(max_op, 8192) : max_op;
    const std::vector<host_op> ops = random_ops(rng, bytes, static_cast<int>(mt::uniform(rng, 1, 300)), op_cap);
    CAPTURE(seed, iter, g.chunk, g.blocks, g.threads, max_op, ops.size());

    const std::vector<std::byte> src = mt::random_bytes(rng, static_cast<size_t>(bytes));
    std::vector<std::byte> want = mt::random_bytes(rng, static_cast<size_t>(bytes));  // poison
    d_src.upload(src);
    d_dst.upload(want);
    host_apply(ops, src, want);

    std::vector<peer_copy_desc> descs;
    int64_t chunks = 0;
    for (const host_op& op : ops) {
      peer_copy_desc d;
      d.src = d_src.data() + op.src_offset;
      d.dst = d_dst.data() + op.dst_offset;
      d.rows = op.rows;
      d.row_bytes = op.row_bytes;
      d.src_pitch = op.src_pitch;
      d.dst_pitch = op.dst_pitch;
      d.first_chunk = chunks;
      chunks += moebius::split_into_chunks(d, g.chunk);
      descs.push_back(d);
    }
    mt::device_buffer d_descs(0, descs.size() * sizeof(peer_copy_desc));
    MOEBIUS_CUDA_CHECK(cudaMemcpy(d_descs.data(), descs.data(), d_descs.size(),
                                  cudaMemcpyHostToDevice));
    peer_copy_args a;
    a.descs = reinterpret_cast<const peer_copy_desc*>(d_descs.data());
    a.num_descs = static_cast<int64_t>(descs.size());
    a.num_chunks = chunks;
    a.chunk_bytes = g.chunk;
    a.status = reinterpret_cast<const barrier_status*>(d_status.data());
    moebius::launch_peer_copy(a, g.blocks, g.threads, nullptr);
    MOEBIUS_CUDA_CHECK(cudaDeviceSynchronize());
    const std::string diff = mt::first_difference(want, d_dst.download(), "dst");
    REQUIRE(diff == "");
  }
}

TEST_CASE("fused copy kernel does nothing once a barrier has failed", "[peer_copy]") {
  const uint64_t seed = mt::test_seed();
  std::mt19937_64 rng(seed);
  const int64_t bytes = 1 << 16;
  mt::device_buffer d_src(0, bytes), d_dst(0, bytes), d_status(0, sizeof(barrier_status));
  barrier_status failed;
  failed.error = 1;
  MOEBIUS_CUDA_CHECK(cudaMemcpy(d_status.data(), &failed, sizeof(failed), cudaMemcpyHostToDevice));
  const std::vector<std::byte> before = mt::random_bytes(rng, bytes);
  d_src.upload(mt::random_bytes(rng, bytes));
  d_dst.upload(before);
  peer_copy_desc d;
  d.src = d_src.data();
  d.dst = d_dst.data();
  d.rows = 1;
  d.row_bytes = bytes;
  const int64_t chunks = moebius::split_into_chunks(d, 4096);
  mt::device_buffer d_descs(0, sizeof(d));
  MOEBIUS_CUDA_CHECK(cudaMemcpy(d_descs.data(), &d, sizeof(d), cudaMemcpyHostToDevice));
  peer_copy_args a;
  a.descs = reinterpret_cast<const peer_copy_desc*>(d_descs.data());
  a.num_descs = 1;
  a.num_chunks = chunks;
  a.chunk_bytes = 4096;
  a.status = reinterpret_cast<const barrier_status*>(d_status.data());
  moebius::launch_peer_copy(a, 4, 128, nullptr);
  MOEBIUS_CUDA_CHECK(cudaDeviceSynchronize());
  REQUIRE(mt::first_difference(before, d_dst.download(), "dst") == "");
}

TEST_CASE("chunk split covers every byte exactly once", "[peer_copy]") {
  // Host check of split_into_chunks' arithmetic (the kernel relies on it).
  const uint64_t seed = mt::test_seed();
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 2000; ++i) {
    peer_copy_desc d;
    d.rows = mt::uniform(rng, 1, 50);
    d.row_bytes = mt::uniform(rng, 1, 5000);
    const int64_t chunk = int64_t{16} << mt::uniform(rng, 0, 9);
    const int64_t n = moebius::split_into_chunks(d, chunk);
    int64_t covered = 0;
    for (int64_t c = 0; c < n; ++c) {
      if (d.pieces_per_row > 1) {
        const int64_t begin = (c % d.pieces_per_row) * chunk;
        covered += std::min(chunk, d.row_bytes - begin);
        REQUIRE(begin < d.row_bytes);
      } else {
        const int64_t r0 = c * d.rows_per_chunk;
        REQUIRE(r0 < d.rows);
        covered += (std::min(d.rows, r0 + d.rows_per_chunk) - r0) * d.row_bytes;
        REQUIRE(d.rows_per_chunk * d.row_bytes <= chunk);
      }
    }
    CAPTURE(seed, i, d.rows, d.row_bytes, chunk);
    REQUIRE(covered == d.rows * d.row_bytes);
  }
}
