// Links the CUDA (and NCCL) components of the installed package; runs without a GPU: it calls
// only host code of those components, and checks that it answers.
#include <cstdio>

#include <moebius/error.hpp>
#include <moebius/memory/device_rank_ipc.hpp>

int main() {
  // A handle that was never exported is refused before any CUDA call (no device needed).
  try {
    moebius::imported_rank_memory m(moebius::device_rank_ipc{}, 0);
    return 1;
  } catch (const moebius::error&) {
  }
  std::printf("consumer: ok\n");
  return 0;
}
