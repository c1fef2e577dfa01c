#pragma once
// Longest-first placement on the GPU (moebius/kv/placement.hpp), for demand arrays that
// already live in device memory: the same assignment as place_longest_first for demands
// WITHOUT share groups.
//
// Two stable CUB radix sorts give the host order (pages descending, then seq id ascending):
// first by seq id, then stably by pages. One block then walks the sorted demands and gives
// each the least-loaded rank (ties: lowest rank id) whose remaining capacity holds it, one
// warp reducing over the ranks per demand (O(n * P / 32) steps, n sequential).
//
//   capacity {10, 10}, own_pages a=6, b=5, c=4 (seq ids 0, 1, 2):
//   owner {0, 1, 1}, load {6, 9}, unplaced 0 (as place_longest_first).
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moebius {

// Device arrays of one placement problem; every pointer is device memory.
struct kv_device_placement_args {
  const int64_t* own_pages = nullptr;  // [num_demands] pages each sequence needs, >= 0
  const int64_t* seq_id = nullptr;     // [num_demands] unique ids (the tie-break key)
  int64_t num_demands = 0;             // < 2^31
  const int64_t* capacity = nullptr;   // [num_ranks] pages each rank may take
  int num_ranks = 0;                   // 1 .. kv_device_placement_max_ranks
  int* owner = nullptr;                // out [num_demands]: rank, or -1 when it fits nowhere
  int64_t* load = nullptr;             // out [num_ranks]: pages given to each rank
  int64_t* unplaced = nullptr;         // out [1]: demands that fit nowhere (0: fits)
};

inline constexpr int kv_device_placement_max_ranks = 1024;

// Workspace bytes place_longest_first_device needs for `num_demands` demands (sort keys,
// indices and CUB's temporary storage). Throws errc::invalid_argument for a count outside
// [0, 2^31), errc::cuda when CUB cannot size its storage.
int64_t place_longest_first_device_workspace_bytes(int64_t num_demands);

// Enqueues the placement on `stream` (nothing is synchronized). `workspace` holds at least
// place_longest_first_device_workspace_bytes(args.num_demands) bytes of device memory.
// Throws errc::invalid_argument for a null array, a rank count outside [1, 1024], a demand
// count outside [0, 2^31) or a small workspace; errc::cuda when a launch fails.
void place_longest_first_device(const kv_device_placement_args& args, void* workspace,
                                int64_t workspace_bytes, cudaStream_t stream);

}  // namespace moebius
