// main() for the GPU tests when the mini-engine is built on its own against an installed
// Moebius (inside the Moebius build they use its tests/support/gpu_main.cu, which this
// mirrors): exits 77 (ctest SKIP_RETURN_CODE) when no CUDA device is usable, so a machine
// without a GPU reports these tests as skipped, not failed.
#define CATCH_CONFIG_RUNNER
#include <cuda_runtime.h>

#include <cstdio>
#include <moebius/transport/cuda_peer_transport.hpp>

#include "tests/catch.hpp"

int main(int argc, char** argv) {
  moebius::request_hardware_queues_for_virtual_ranks();
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::printf("no CUDA device (%s): skipping GPU tests\n",
                status == cudaSuccess ? "0 devices" : cudaGetErrorString(status));
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
