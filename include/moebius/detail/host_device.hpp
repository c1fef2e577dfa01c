#pragma once

// MOEBIUS_HOST_DEVICE marks a function usable from host and device code. Under nvcc it
// expands to `__host__ __device__ inline`; in a plain C++ compiler to `inline`, so every
// descriptor and layout rule is also compiled and tested on the host.
#if defined(__CUDACC__)
#define MOEBIUS_HOST_DEVICE __host__ __device__ inline
#else
#define MOEBIUS_HOST_DEVICE inline
#endif
