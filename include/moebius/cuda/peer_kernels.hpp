#pragma once

// Kernels of cuda_peer_transport (kernels/peer_copy.cu, kernels/peer_barrier.cu): their
// argument structs and host launchers. Plain C++ declarations, so host code compiled without
// nvcc can launch them.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moebius {

// Per-rank state a barrier leaves for the host and for later kernels of the same execute().
// Lives in the rank's device memory; zeroed at the start of every execute().
struct barrier_status {
  uint32_t error = 0;         // 0: fine; 1: a barrier timed out (later kernels of this rank
                              // do nothing; copy-engine copies already queued still run)
  uint32_t failed_phase = 0;  // phase whose closing barrier timed out
  int32_t missing_rank = -1;  // first peer that had not arrived
  uint32_t reserved = 0;
  uint64_t passed = 0;        // barriers passed: phases complete on every rank
  // Arrival value base of this execute(): the barrier closing phase k arrives with
  // epoch_base + k + 1. Set by the begin kernel, so a captured CUDA graph replays unchanged.
  uint64_t epoch_base = 0;
};

// One op of the fused copy kernel with resolved pointers (as mapped in this process). Copies
// `rows` rows of `row_bytes` from src + j*src_pitch to dst + j*dst_pitch. The op is cut into
// chunks a warp moves at once:
//   row_bytes > chunk_bytes: pieces_per_row = ceil(row_bytes / chunk_bytes) chunks per row;
//   otherwise rows_per_chunk = chunk_bytes / row_bytes whole rows per chunk.
//   e.g. chunk 32 KiB: 3 rows of 80 KiB -> 3 pieces/row, 9 chunks; 1000 rows of 3 KiB ->
//   10 rows/chunk, 100 chunks.
struct peer_copy_desc {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
  int64_t rows = 0;
  int64_t row_bytes = 0;
  int64_t src_pitch = 0;
  int64_t dst_pitch = 0;
  int64_t pieces_per_row = 1;
  int64_t rows_per_chunk = 1;
  int64_t first_chunk = 0;  // index of this op's first chunk in the launch (prefix sum)
};

// Chunk split of one op (see peer_copy_desc); fills pieces_per_row and rows_per_chunk and
// returns the op's chunk count.
inline int64_t split_into_chunks(peer_copy_desc& d, int64_t chunk_bytes) {
  if (d.row_bytes > chunk_bytes) {
    d.pieces_per_row = (d.row_bytes + chunk_bytes - 1) / chunk_bytes;
    d.rows_per_chunk = 1;
    return d.rows * d.pieces_per_row;
  }
  d.pieces_per_row = 1;
  d.rows_per_chunk = chunk_bytes / d.row_bytes;
  return (d.rows + d.rows_per_chunk - 1) / d.rows_per_chunk;
}

struct peer_copy_args {
  const peer_copy_desc* descs = nullptr;  // [num_descs], device memory, ascending first_chunk
  int64_t num_descs = 0;
  int64_t num_chunks = 0;                 // chunks of all descs
  int64_t chunk_bytes = 0;                // power of two, 16 .. 2^30
  const barrier_status* status = nullptr; // skip all work when status->error != 0 (may be null)
};

// Largest block the fused copy kernel launches with: it keeps several 16-byte loads in flight
// per thread (about 96 registers), so 1024-thread blocks would not fit the register file.
inline constexpr int peer_copy_max_threads = 512;

// Launches the fused copy kernel: warps take chunks round-robin. A no-op without chunks or
// blocks. Throws errc::invalid_argument for a bad thread count, errc::cuda when the launch
// fails (every launcher here: detail::check_launch).
void launch_peer_copy(const peer_copy_args& args, int blocks, int threads, cudaStream_t stream);

struct barrier_args {
  uint64_t* const* peer_flags = nullptr;  // [num_ranks] device array: rank j's flag array
  const uint64_t* my_flags = nullptr;     // this rank's flag array [num_ranks]
  barrier_status* status = nullptr;       // this rank's status
  int rank = 0;
  int num_ranks = 0;
  int64_t phase = 0;                      // phase this barrier closes
  uint64_t timeout_ns = 0;
};

// Launches the one-block barrier: with target = status->epoch_base + phase + 1, writes target
// into peer_flags[j][rank] for every j (system-scope release), then waits until
// my_flags[j] >= target for every j (acquire) or until timeout_ns passed (then
// status->error = 1). Does nothing when status->error != 0.
void launch_barrier(const barrier_args& args, cudaStream_t stream);

// Launches one thread that starts an execute(): status = {error 0, passed 0, epoch_base}.
void launch_barrier_begin(barrier_status* status, uint64_t epoch_base, cudaStream_t stream);

}  // namespace moebius
