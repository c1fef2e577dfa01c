// Longest-first placement on the GPU (include/moebius/cuda/kv_placement.hpp): key kernels,
// two stable CUB radix sorts, then one block of one warp placing the demands in order.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>

#include "moebius/cuda/check.hpp"
#include "moebius/cuda/kv_placement.hpp"
#include "moebius/error.hpp"

namespace moebius {
namespace {

constexpr int64_t k_align = 256;
constexpr uint64_t k_sign = uint64_t{1} << 63;

int64_t align_up(int64_t x) { return (x + k_align - 1) / k_align * k_align; }

// Workspace carve-up: 4 key arrays (uint64), 3 index arrays (uint32), CUB storage.
struct workspace_layout {
  int64_t keys_bytes = 0;
  int64_t index_bytes = 0;
  int64_t cub_bytes = 0;
  int64_t total() const { return 4 * keys_bytes + 3 * index_bytes + cub_bytes; }
};

workspace_layout layout_for(int64_t n) {
  MOEBIUS_CHECK(n >= 0 && n < (int64_t{1} << 31), errc::invalid_argument,
                "device placement needs 0 <= num_demands < 2^31, got ", n);
  workspace_layout w;
  w.keys_bytes = align_up(n * 8);
  w.index_bytes = align_up(n * 4);
  size_t cub_bytes = 0;
  const cudaError_t st = cub::DeviceRadixSort::SortPairs(
      nullptr, cub_bytes, static_cast<const uint64_t*>(nullptr), static_cast<uint64_t*>(nullptr),
      static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<int>(n));
  MOEBIUS_CHECK(st == cudaSuccess, errc::cuda, "CUB radix sort sizing failed for ", n,
                " demands: ", cudaGetErrorString(st));
  w.cub_bytes = align_up(static_cast<int64_t>(cub_bytes));
  return w;
}

// --- kernels ------------------------------------------------------------------------------

struct seq_key_args {
  const int64_t* seq_id;
  uint64_t* keys;     // out: seq id with the sign bit flipped (ascending = signed order)
  uint32_t* index;    // out: 0 .. n-1
  int64_t n;
};

__global__ void seq_key_kernel(const __grid_constant__ seq_key_args a) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.n;
       i += stride) {
    a.keys[i] = static_cast<uint64_t>(a.seq_id[i]) ^ k_sign;
    a.index[i] = static_cast<uint32_t>(i);
  }
}

struct page_key_args {
  const int64_t* own_pages;
  const uint32_t* index;  // demands in seq id order
  uint64_t* keys;         // out: ~pages, so ascending keys = pages descending
  int64_t n;
};

__global__ void page_key_kernel(const __grid_constant__ page_key_args a) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.n;
       i += stride)
    a.keys[i] = ~static_cast<uint64_t>(a.own_pages[a.index[i]]);
}

struct greedy_args {
  const int64_t* own_pages;
  const uint32_t* order;  // demands, longest first
  int64_t n;
  const int64_t* capacity;
  int num_ranks;
  int* owner;
  int64_t* load;
  int64_t* unplaced;
};

// One warp: lane l keeps the loads of ranks l, l+32, ... in shared memory; per demand every
// lane finds its best fitting rank, a shuffle reduction picks (least load, lowest rank).
__global__ void __launch_bounds__(32) greedy_kernel(const __grid_constant__ greedy_args a) {
  __shared__ int64_t load[kv_device_placement_max_ranks];
  const int lane = static_cast<int>(threadIdx.x);
  for (int r = lane; r < a.num_ranks; r += 32) load[r] = 0;
  __syncwarp();
  int64_t unplaced = 0;
  for (int64_t k = 0; k < a.n; ++k) {
    const uint32_t d = a.order[k];
    const int64_t pages = a.own_pages[d];
    int64_t best_load = INT64_MAX;
    int best = -1;
    for (int r = lane; r < a.num_ranks; r += 32) {
      const int64_t l = load[r];
      if (l + pages <= a.capacity[r] && l < best_load) {  // r ascending: ties keep the lower
        best_load = l;
        best = r;
      }
    }
    for (int off = 16; off > 0; off /= 2) {
      const int64_t ol = __shfl_down_sync(0xFFFFFFFFu, best_load, off);
      const int ob = __shfl_down_sync(0xFFFFFFFFu, best, off);
      if (ob >= 0 && (best < 0 || ol < best_load || (ol == best_load && ob < best))) {
        best_load = ol;
        best = ob;
      }
    }
    if (lane == 0) {
      a.owner[d] = best;
      if (best >= 0) load[best] += pages;
      else ++unplaced;
    }
    __syncwarp();
  }
  for (int r = lane; r < a.num_ranks; r += 32) a.load[r] = load[r];
  if (lane == 0) *a.unplaced = unplaced;
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks < 1024 ? (blocks < 1 ? 1 : blocks) : 1024);
}

}  // namespace

int64_t place_longest_first_device_workspace_bytes(int64_t num_demands) {
  return layout_for(num_demands).total();
}

void place_longest_first_device(const kv_device_placement_args& a, void* workspace,
                                int64_t workspace_bytes, cudaStream_t stream) {
  MOEBIUS_CHECK(a.num_ranks >= 1 && a.num_ranks <= kv_device_placement_max_ranks,
                errc::invalid_argument, "device placement needs 1 <= num_ranks <= ",
                kv_device_placement_max_ranks, ", got ", a.num_ranks);
  const workspace_layout w = layout_for(a.num_demands);
  MOEBIUS_CHECK(workspace_bytes >= w.total() && (workspace != nullptr || w.total() == 0),
                errc::invalid_argument, "device placement workspace of ", workspace_bytes,
                " B < ", w.total(), " B needed for ", a.num_demands, " demands");
  MOEBIUS_CHECK(a.capacity != nullptr && a.load != nullptr && a.unplaced != nullptr &&
                    (a.num_demands == 0 || (a.own_pages != nullptr && a.seq_id != nullptr &&
                                            a.owner != nullptr)),
                errc::invalid_argument, "device placement got a null array (", a.num_demands,
                " demands, ", a.num_ranks, " ranks)");
  const int64_t n = a.num_demands;
  auto* base = static_cast<std::byte*>(workspace);
  auto* keys0 = reinterpret_cast<uint64_t*>(base);
  auto* keys1 = reinterpret_cast<uint64_t*>(base + w.keys_bytes);
  auto* keys2 = reinterpret_cast<uint64_t*>(base + 2 * w.keys_bytes);
  auto* keys3 = reinterpret_cast<uint64_t*>(base + 3 * w.keys_bytes);
  auto* idx0 = reinterpret_cast<uint32_t*>(base + 4 * w.keys_bytes);
  auto* idx1 = reinterpret_cast<uint32_t*>(base + 4 * w.keys_bytes + w.index_bytes);
  auto* idx2 = reinterpret_cast<uint32_t*>(base + 4 * w.keys_bytes + 2 * w.index_bytes);
  void* cub_tmp = base + 4 * w.keys_bytes + 3 * w.index_bytes;
  size_t cub_bytes = static_cast<size_t>(w.cub_bytes);
  if (n > 0) {
    // Radix sorts are stable: by seq id, then by pages, gives (pages desc, seq id asc).
    seq_key_kernel<<<grid_for(n), 256, 0, stream>>>(seq_key_args{a.seq_id, keys0, idx0, n});
    detail::check_launch("placement seq key");
    cudaError_t st = cub::DeviceRadixSort::SortPairs(cub_tmp, cub_bytes, keys0, keys1, idx0,
                                                     idx1, static_cast<int>(n), 0, 64, stream);
    MOEBIUS_CHECK(st == cudaSuccess, errc::cuda, "placement sort by seq id failed: ",
                  cudaGetErrorString(st));
    page_key_kernel<<<grid_for(n), 256, 0, stream>>>(page_key_args{a.own_pages, idx1, keys2, n});
    detail::check_launch("placement page key");
    cub_bytes = static_cast<size_t>(w.cub_bytes);
    st = cub::DeviceRadixSort::SortPairs(cub_tmp, cub_bytes, keys2, keys3, idx1, idx2,
                                         static_cast<int>(n), 0, 64, stream);
    MOEBIUS_CHECK(st == cudaSuccess, errc::cuda, "placement sort by pages failed: ",
                  cudaGetErrorString(st));
  }
  greedy_kernel<<<1, 32, 0, stream>>>(
      greedy_args{a.own_pages, idx2, n, a.capacity, a.num_ranks, a.owner, a.load, a.unplaced});
  detail::check_launch("placement greedy");
}

}  // namespace moebius
