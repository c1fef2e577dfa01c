#include <cmath>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <moebius/error.hpp>

#include "common.cuh"
#include "kernels.hpp"

namespace mini_engine::gpu {

namespace {

constexpr int k_tile_map_threads = 1024;  // num_local <= 1024

int64_t align16(int64_t b) {
  return (b + 15) / 16 * 16;
}

int end_bit_for(int64_t max_key) {
  int bits = 1;
  while ((int64_t{1} << bits) <= max_key) ++bits;
  return bits;
}

__device__ __forceinline__ int64_t lower_bound(const int32_t* v, int64_t n, int32_t key) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (v[mid] < key)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

}  // namespace

int64_t moe_tile_rows(int64_t pairs, int64_t num_local) {
  const int64_t mean = (pairs + num_local - 1) / num_local;
  int64_t rows = 8;
  while (rows < 128 && rows * 2 <= mean) rows *= 2;
  return rows;
}

int64_t moe_max_tiles(int64_t pairs, int64_t num_local, int64_t tile_rows) {
  return (pairs + tile_rows - 1) / tile_rows + (num_local < pairs ? num_local : pairs);
}

int64_t moe_pair_capacity(int64_t tokens, int64_t top_k, int64_t experts, int64_t num_local,
                          bool optimistic, double capacity_factor) {
  const int64_t worst = tokens * (top_k < num_local ? top_k : num_local);
  if (!optimistic) return worst;
  const double expected = static_cast<double>(tokens * top_k) * static_cast<double>(num_local) /
                          static_cast<double>(experts);
  const auto cap = static_cast<int64_t>(std::ceil(capacity_factor * expected)) + top_k;
  return cap < worst ? cap : worst;
}

size_t moe_sort_temp_bytes(int64_t pairs) {
  size_t bytes = 0;
  MOEBIUS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<int>(pairs)));
  return bytes;
}

moe_tokens moe_token_layout(int64_t tokens, int64_t hidden, int64_t top_k, moebius::dtype type) {
  moe_tokens m;
  m.tokens = tokens;
  m.top_k = top_k;
  m.ids_offset = align16(hidden * moebius::dtype_bytes(type));
  m.weights_offset = m.ids_offset + align16(4 * top_k);
  m.row_bytes = m.weights_offset + align16(4 * top_k);
  return m;
}

// 1. pair keys: local expert id, or num_local for a pair that is not ours.
__global__ void moe_route_kernel(const __grid_constant__ moe_plan p,
                                 const __grid_constant__ moe_tokens src) {
  const int64_t pairs = src.tokens * src.top_k;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < pairs;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / src.top_k, j = i % src.top_k;
    const int32_t id =
        reinterpret_cast<const int32_t*>(src.rows + t * src.row_bytes + src.ids_offset)[j];
    const int64_t local = static_cast<int64_t>(id) - p.first_expert;
    p.keys[i] = (id >= 0 && local >= 0 && local < p.num_local) ? static_cast<int32_t>(local)
                                                               : static_cast<int32_t>(p.num_local);
    p.values[i] = static_cast<int32_t>(i);
  }
}

// 3. per expert: first sorted pair, count, first tile; then every tile slot's pointers.
__global__ void __launch_bounds__(k_tile_map_threads)
    moe_tile_map_kernel(const __grid_constant__ moe_plan p, int64_t pairs) {
  using scan = cub::BlockScan<int32_t, k_tile_map_threads>;
  __shared__ typename scan::TempStorage temp;
  __shared__ int32_t s_tile_start[k_tile_map_threads + 1];
  const int e = threadIdx.x;
  int32_t first = 0, count = 0, tiles = 0;
  if (e < p.num_local) {
    first = static_cast<int32_t>(lower_bound(p.keys_sorted, pairs, e));
    count = static_cast<int32_t>(lower_bound(p.keys_sorted, pairs, e + 1)) - first;
    tiles = static_cast<int32_t>((count + p.tile_rows - 1) / p.tile_rows);
  }
  int32_t start = 0, total = 0;
  scan(temp).ExclusiveSum(tiles, start, total);
  if (e < p.num_local) {
    p.expert_info[e] = first;
    p.expert_info[p.num_local + e] = count;
    p.expert_info[2 * p.num_local + e] = start;
    s_tile_start[e] = start;
  }
  if (e == 0) {
    p.expert_info[3 * p.num_local] = total;
    if (total > p.max_tiles && p.overflow != nullptr) *p.overflow = 1;
  }
  __syncthreads();
  const int64_t es = moebius::dtype_bytes(p.type);
  const int64_t H = p.hidden, I = p.inter, M = p.tile_rows;
  for (int64_t s = threadIdx.x; s < p.max_tiles; s += blockDim.x) {
    int64_t ex = 0;
    if (s < total) {  // the largest expert whose first tile is <= s (it has tiles)
      int64_t lo = 0, hi = p.num_local - 1;
      while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (s_tile_start[mid] <= s)
          lo = mid;
        else
          hi = mid - 1;
      }
      ex = lo;
    }
    p.ptr_w13[s] = p.w13 + ex * 2 * I * H * es;
    p.ptr_x[s] = p.x_perm + s * M * H * es;
    p.ptr_gu[s] = p.gu + s * M * 2 * I;
    p.ptr_w2[s] = p.w2 + ex * H * I * es;
    p.ptr_act[s] = p.act + s * M * I * es;
    p.ptr_y[s] = p.y + s * M * H;
  }
}

// 4. one block per sorted pair: its row, and its token's x copied there.
__global__ void moe_gather_kernel(const __grid_constant__ moe_plan p,
                                  const __grid_constant__ moe_tokens src) {
  const int64_t i = blockIdx.x;
  const int32_t key = p.keys_sorted[i];
  const int32_t pair = p.values_sorted[i];
  if (key >= p.num_local) {
    if (threadIdx.x == 0) p.pair_row[pair] = -1;
    return;
  }
  const int64_t first = p.expert_info[key];
  const int64_t start = p.expert_info[2 * p.num_local + key];
  const int64_t row = start * p.tile_rows + (i - first);
  if (row >= p.max_tiles * p.tile_rows) {  // past the capacity: dropped, overflow is set
    if (threadIdx.x == 0) p.pair_row[pair] = -1;
    return;
  }
  if (threadIdx.x == 0) p.pair_row[pair] = static_cast<int32_t>(row);
  const int64_t bytes = p.hidden * moebius::dtype_bytes(p.type);
  const std::byte* from = src.rows + (pair / src.top_k) * src.row_bytes;
  std::byte* to = p.x_perm + row * bytes;
  if (bytes % 16 == 0) {
    for (int64_t b = threadIdx.x; b < bytes / 16; b += blockDim.x)
      reinterpret_cast<uint4*>(to)[b] = reinterpret_cast<const uint4*>(from)[b];
  } else {
    for (int64_t b = threadIdx.x; b < bytes; b += blockDim.x) to[b] = from[b];
  }
}

void launch_moe_permute(const moe_plan& p, const moe_tokens& src, cudaStream_t stream) {
  MOEBIUS_CHECK(p.num_local >= 1 && p.num_local <= k_tile_map_threads,
                moebius::errc::invalid_argument, "moe_permute: ", p.num_local,
                " local experts (need 1..1024)");
  const int64_t pairs = src.tokens * src.top_k;
  if (pairs == 0) return;
  moe_route_kernel<<<detail::grid_for(pairs, 256), 256, 0, stream>>>(p, src);
  check_launch("moe_route");
  size_t temp_bytes = p.sort_temp_bytes;
  MOEBIUS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      p.sort_temp, temp_bytes, p.keys, p.keys_sorted, p.values, p.values_sorted,
      static_cast<int>(pairs), 0, end_bit_for(p.num_local), stream));
  moe_tile_map_kernel<<<1, k_tile_map_threads, 0, stream>>>(p, pairs);
  check_launch("moe_tile_map");
  moe_gather_kernel<<<static_cast<unsigned>(pairs), 128, 0, stream>>>(p, src);
  check_launch("moe_gather");
}

// 6. one block per token: weighted sum of its pairs' rows, choices in order. The token's pair
// rows and weights are read once into shared memory, and the rows four floats at a time when
// the hidden size allows (the TP rank's combine reads k x H floats per token: this kernel is
// bound by those bytes). The sum per element runs over the choices in order, as before.
constexpr int k_combine_max_top_k = 64;

__global__ void moe_combine_kernel(const __grid_constant__ moe_combine_args a) {
  __shared__ int32_t rows[k_combine_max_top_k];
  __shared__ float weights[k_combine_max_top_k];
  const int64_t t = blockIdx.x;
  const int64_t K = a.src.top_k;
  const float* w =
      reinterpret_cast<const float*>(a.src.rows + t * a.src.row_bytes + a.src.weights_offset);
  for (int64_t j = threadIdx.x; j < K; j += blockDim.x) {
    rows[j] = a.pair_row[t * K + j];
    weights[j] = w[j];
  }
  __syncthreads();
  float* out = a.out + t * a.hidden;
  if (a.hidden % 4 == 0) {
    const int64_t n4 = a.hidden / 4;
    for (int64_t c = threadIdx.x; c < n4; c += blockDim.x) {
      float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int64_t j = 0; j < K; ++j) {
        if (rows[j] < 0) continue;
        const float4 y = reinterpret_cast<const float4*>(a.y + int64_t{rows[j]} * a.hidden)[c];
        sum.x += weights[j] * y.x;
        sum.y += weights[j] * y.y;
        sum.z += weights[j] * y.z;
        sum.w += weights[j] * y.w;
      }
      reinterpret_cast<float4*>(out)[c] = sum;
    }
    return;
  }
  for (int64_t c = threadIdx.x; c < a.hidden; c += blockDim.x) {
    float sum = 0.0f;
    for (int64_t j = 0; j < K; ++j)
      if (rows[j] >= 0) sum += weights[j] * a.y[int64_t{rows[j]} * a.hidden + c];
    out[c] = sum;
  }
}

void launch_moe_combine(const moe_combine_args& a, cudaStream_t stream) {
  MOEBIUS_CHECK(a.src.top_k >= 1 && a.src.top_k <= k_combine_max_top_k,
                moebius::errc::invalid_argument, "moe_combine: top_k ", a.src.top_k,
                " (need 1..", k_combine_max_top_k, ")");
  if (a.src.tokens == 0) return;
  moe_combine_kernel<<<static_cast<unsigned>(a.src.tokens), 256, 0, stream>>>(a);
  check_launch("moe_combine");
}

__global__ void moe_pack_kernel(const __grid_constant__ moe_pack_args a) {
  const int64_t t = blockIdx.x;
  std::byte* row = a.rows + t * a.dst.row_bytes;
  for (int64_t c = threadIdx.x; c < a.hidden; c += blockDim.x)
    detail::store_from_float(row, a.type, c, a.x[t * a.hidden + c]);
  for (int64_t j = threadIdx.x; j < a.dst.top_k; j += blockDim.x) {
    reinterpret_cast<int32_t*>(row + a.dst.ids_offset)[j] = a.ids[t * a.dst.top_k + j];
    reinterpret_cast<float*>(row + a.dst.weights_offset)[j] = a.weights[t * a.dst.top_k + j];
  }
}

void launch_moe_pack(const moe_pack_args& a, cudaStream_t stream) {
  if (a.dst.tokens == 0) return;
  moe_pack_kernel<<<static_cast<unsigned>(a.dst.tokens), 256, 0, stream>>>(a);
  check_launch("moe_pack");
}

}  // namespace mini_engine::gpu
