#pragma once

// A scoped NVTX range, so that a profiler (Nsight Systems) shows each stage of a switch on the
// timeline. NVTX v3 is header-only and finds the profiler's library at run time (dlopen), so it
// links nothing: the host library stays free of the CUDA runtime. Compiled in only where the
// library's own sources are built with MOEBIUS_NVTX=1 (CUDA Toolkit present); elsewhere, and in
// consumers' code, the range is an empty object.
//
//   { detail::nvtx_range r("moebius/switch/weights"); run(weights); }  // one range on the timeline

#if defined(MOEBIUS_NVTX) && MOEBIUS_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

namespace moebius::detail {

class nvtx_range {
 public:
  // `name` must outlive the range (a string literal).
  explicit nvtx_range([[maybe_unused]] const char* name) {
#if defined(MOEBIUS_NVTX) && MOEBIUS_NVTX
    nvtxRangePushA(name);
#endif
  }
  nvtx_range(const nvtx_range&) = delete;
  nvtx_range& operator=(const nvtx_range&) = delete;
  ~nvtx_range() {
#if defined(MOEBIUS_NVTX) && MOEBIUS_NVTX
    nvtxRangePop();
#endif
  }
};

}  // namespace moebius::detail
