"""Shared fixtures of the Python tests. CPU tests use numpy through DLPack; tests marked
`gpu` need torch with CUDA and are skipped without it."""

import zlib

import numpy as np
import pytest

import moebius

# The GPU tests put up to 4 virtual ranks on one device, each on a caller's stream: every such
# stream needs a hardware queue of its own (cuda_peer_transport.hpp). This must run before
# anything (torch) creates a CUDA context in this process, so it runs when pytest loads this
# file, before the test modules import torch.
if moebius.with_cuda:
    moebius.request_hardware_queues_for_virtual_ranks()

POISON = 0xAB


def host_memory(nbytes, fill=POISON):
    """A host allocation as a numpy byte array, poisoned so unwritten bytes show."""
    return np.full(nbytes, fill, dtype=np.uint8)


def raw_view(memory, geometry, layer, mode, tensor):
    """numpy view (unsigned ints of the element width) of one weight tensor of one rank."""
    return np.from_dlpack(memory.weight_view(geometry, layer, mode, tensor, raw=True))


def tp_slice(full, tensor, rank, num_ranks, order=moebius.GateUpOrder.gate_first):
    """vLLM's TP shard of a full [E, rows, cols] tensor: w13 = [gate; up], rank r holds gate
    rows [r*I/P, (r+1)*I/P) then up rows (or up first); w2 columns slice r."""
    if tensor in (moebius.WeightTensor.w13, moebius.WeightTensor.w13_scale):
        half = full.shape[1] // 2
        n = half // num_ranks
        gate = full[:, rank * n:(rank + 1) * n]
        up = full[:, half + rank * n:half + (rank + 1) * n]
        parts = [gate, up] if order == moebius.GateUpOrder.gate_first else [up, gate]
        return np.concatenate(parts, axis=1)
    n = full.shape[2] // num_ranks
    return full[:, :, rank * n:(rank + 1) * n]


def ep_slice(full, tensor, rank, num_ranks, order=moebius.GateUpOrder.gate_first):
    """EP shard: experts [r*E/P, (r+1)*E/P) whole, w13 halves in `order`."""
    n = full.shape[0] // num_ranks
    part = full[rank * n:(rank + 1) * n]
    if order == moebius.GateUpOrder.up_first and tensor in (
            moebius.WeightTensor.w13, moebius.WeightTensor.w13_scale):
        half = part.shape[1] // 2
        part = np.concatenate([part[:, half:], part[:, :half]], axis=1)
    return part


@pytest.fixture
def rng(request):
    # One fixed seed per test (its id), so a failure reproduces.
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))
