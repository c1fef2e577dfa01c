#include <algorithm>
#include <moebius/cuda/check.hpp>

#include "profiler.hpp"

namespace mini_engine::gpu {

void stage_marks::record(cudaStream_t stream, int st) {
  if (used == events.size()) {
    cudaEvent_t e = nullptr;
    MOEBIUS_CUDA_CHECK(cudaEventCreate(&e));
    events.push_back(e);
    stage.push_back(-1);
  }
  MOEBIUS_CUDA_CHECK(cudaEventRecord(events[used], stream));
  stage[used++] = st;
}

std::vector<double> stage_marks::collect() {
  std::vector<double> mine(st_count, 0.0);
  for (size_t i = 1; i < used; ++i) {
    float ms = 0;
    MOEBIUS_CUDA_CHECK(cudaEventElapsedTime(&ms, events[i - 1], events[i]));
    if (stage[i] >= 0) mine[static_cast<size_t>(stage[i])] += ms * 1e-3;
  }
  used = 0;
  return mine;
}

void stage_marks::release() {
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  events.clear();
  stage.clear();
  used = 0;
}

std::vector<double> stage_times_of(std::span<stage_marks* const> ranks) {
  std::vector<double> s(st_count, 0.0);
  for (stage_marks* m : ranks) {
    const std::vector<double> mine = m->collect();
    for (size_t k = 0; k < mine.size(); ++k) s[k] = std::max(s[k], mine[k]);
  }
  return s;
}

}  // namespace mini_engine::gpu
