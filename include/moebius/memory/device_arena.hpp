#pragma once

// Device memory for a deployment (Moebius::cuda) in one include: the owner over cudaMalloc
// (device_deployment_memory.hpp) and the CUDA IPC handles through which processes of one host
// share it (device_rank_ipc.hpp).

#include "moebius/memory/device_deployment_memory.hpp"
#include "moebius/memory/device_rank_ipc.hpp"
