// The phase barrier of cuda_peer_transport: one block per rank, enqueued on the rank's stream
// after the phase's copies, so stream order makes every copy of the phase (copy engine or SM
// kernel) complete before the rank announces its arrival. Thread j talks to rank j.

#include <cstdint>

#include "moebius/cuda/peer_kernels.hpp"

#include "moebius/cuda/check.hpp"
#include "moebius/error.hpp"

namespace moebius {
namespace {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Release at system scope: the phase's writes (to peer memory over NVLink or PCIe, possibly in
// another process) become visible before the flag does.
__device__ __forceinline__ void store_release_system(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_system(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__global__ void barrier_kernel(const __grid_constant__ barrier_args a) {
  __shared__ int skip;
  __shared__ int missing;
  __shared__ uint64_t target;
  const int j = static_cast<int>(threadIdx.x);
  if (j == 0) {
    const volatile barrier_status* s = a.status;
    skip = s->error != 0;
    missing = a.num_ranks;
    target = s->epoch_base + static_cast<uint64_t>(a.phase) + 1;
  }
  __syncthreads();
  if (skip) return;  // an earlier barrier timed out: this rank has abandoned the plan

  if (j < a.num_ranks) {
    __threadfence_system();
    store_release_system(a.peer_flags[j] + a.rank, target);
    const uint64_t start = global_timer_ns();
    while (load_acquire_system(a.my_flags + j) < target) {
      if (global_timer_ns() - start > a.timeout_ns) {
        atomicMin(&missing, j);
        break;
      }
      __nanosleep(256);
    }
  }
  __syncthreads();
  if (j == 0) {
    volatile barrier_status* s = a.status;
    if (missing < a.num_ranks) {
      s->failed_phase = static_cast<uint32_t>(a.phase);
      s->missing_rank = missing;
      __threadfence();
      s->error = 1;
    } else {
      s->passed = static_cast<uint64_t>(a.phase) + 1;
    }
  }
}

__global__ void barrier_begin_kernel(barrier_status* status, uint64_t epoch_base) {
  barrier_status s;
  s.epoch_base = epoch_base;
  *status = s;
}

}  // namespace

void launch_barrier_begin(barrier_status* status, uint64_t epoch_base, cudaStream_t stream) {
  barrier_begin_kernel<<<1, 1, 0, stream>>>(status, epoch_base);
  detail::check_launch("barrier_begin");
}

void launch_barrier(const barrier_args& args, cudaStream_t stream) {
  const int threads = (args.num_ranks + 31) / 32 * 32;
  barrier_kernel<<<1, static_cast<unsigned>(threads), 0, stream>>>(args);
  detail::check_launch("barrier");
}

}  // namespace moebius
