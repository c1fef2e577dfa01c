"""The NCCL transport and torch.distributed process groups from Python, on the GPU: P=1 NCCL in
this process (every op a local copy, strided and contiguous), a switcher on it with KV; then
through a process group (moebius.distributed): P=1 in a spawned process (NCCL and CUDA IPC
transports made from a gloo group), and P=2 with one process per GPU when there are two.
Marked `gpu`.

Run on the device: python -m pytest -q -m gpu python/tests/test_distributed.py
"""

import datetime
import os

import pytest

import moebius
from test_gpu import check_ep, check_tp, run_ranks, weight_deployment, _rank_in_ep
from test_kv import logical_kv, random_ep_state

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not moebius.with_cuda, reason="moebius was built without CUDA"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
needs_nccl = pytest.mark.skipif(not moebius.with_nccl, reason="moebius was built without NCCL")

EP, TP = moebius.Mode.EP, moebius.Mode.TP


@needs_nccl
def test_nccl_transport_p1_in_process():
    shape, arena, full, tensors, ranks = weight_deployment(1)
    (comm,) = moebius.NcclCommunicator.init_all([0])
    assert (comm.rank, comm.num_ranks, comm.device) == (0, 1, 0)
    to_tp = moebius.plan_weight_switch(arena, 0, shape.num_layers)
    need = moebius.NcclTransport.workspace_bytes(to_tp, 0)
    transport = moebius.NcclTransport(ranks, [comm], need)
    assert transport.num_ranks() == 1 and transport.local_ranks() == [0]
    stream = torch.cuda.Stream()
    transport.enqueue(to_tp, [stream.cuda_stream])
    transport.wait()
    check_tp(ranks[0], arena, full, 0)
    transport.execute(moebius.plan_weight_switch(arena, shape.num_layers, 0))
    check_ep(ranks[0], arena, full, 0)


@needs_nccl
def test_nccl_transport_needs_no_workspace_at_p1():
    """At P=1 every op is local (no pack, no unpack): the workspace needed is 0 and a transport
    without one switches. A workspace too small for remote ops is refused in the C++ tests
    (test_nccl_transport, 'workspace_bytes and its check')."""
    shape, arena, full, tensors, ranks = weight_deployment(1)
    (comm,) = moebius.NcclCommunicator.init_all([0])
    plan = moebius.plan_weight_switch(arena, 0, shape.num_layers)
    assert moebius.NcclTransport.workspace_bytes(plan, 0) == 0
    transport = moebius.NcclTransport(ranks, [comm], 0)
    transport.execute(plan)
    check_tp(ranks[0], arena, full, 0)


@needs_nccl
def test_switcher_on_nccl_with_kv():
    shape = moebius.ExpertShape(num_layers=2, num_experts=4, hidden=128, intermediate=64)
    arena = moebius.make_arena_geometry(shape, 1)
    kv = moebius.make_kv_geometry(2, 4, 16, 4, 16, 1)
    import numpy as np
    rng = np.random.default_rng(3)
    state = random_ep_state(rng, kv, 0.5)
    arena_t = torch.zeros(arena.total_bytes, dtype=torch.uint8, device="cuda")
    pool_t = torch.from_numpy(rng.integers(0, 256, kv.pool_bytes, dtype=np.uint8)).cuda()
    mem = moebius.RankMemory(arena_t, pool_t)
    host = moebius.RankMemory(pool_t.new_zeros(1).cpu().numpy(), pool_t.cpu().numpy())
    before = logical_kv(kv, state, [host])
    (comm,) = moebius.NcclCommunicator.init_all([0])
    import moebius.distributed as md
    transport = moebius.NcclTransport([mem], [comm], md.nccl_workspace_bytes(arena, kv))
    sw = moebius.Switcher(arena, kv, transport, state)
    for target in (TP, EP):
        report = sw.switch_to(target)
        assert report.outcome == moebius.SwitchOutcome.committed, report.error
        torch.cuda.synchronize()
        host = moebius.RankMemory(pool_t.new_zeros(1).cpu().numpy(), pool_t.cpu().numpy())
        after = logical_kv(kv, sw.kv_tables, [host])
        assert after.keys() == before.keys()
        for s, v in before.items():
            np.testing.assert_array_equal(after[s], v)


def _group_rank(rank, P, init_file, backend_transport, results):
    try:
        import socket

        import torch.distributed as dist
        import moebius.distributed as md
        if "lo" in (name for _, name in socket.if_nameindex()):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=P, timeout=datetime.timedelta(seconds=60))
        shape, arena, full, buffer, mem = _rank_in_ep(rank, P, num_layers=3, seed=6)
        if backend_transport == "nccl":
            transport = md.nccl_transport(mem, arena)
        else:
            transport = md.cuda_peer_transport(mem)
        assert transport.local_ranks() == [rank] and transport.num_ranks() == P
        transport.execute(moebius.plan_weight_switch(arena, 0, 3))
        check_tp(mem, arena, full, rank)
        transport.execute(moebius.plan_weight_switch(arena, 3, 0))
        check_ep(mem, arena, full, rank)
        dist.barrier()  # no rank unmaps its peers' memory while one still writes into it
        del transport
        dist.destroy_process_group()
        results.put((rank, "ok"))
    except BaseException as e:  # report, never hang the parent
        results.put((rank, repr(e)))


@pytest.mark.parametrize("kind", [pytest.param("nccl", marks=needs_nccl), "cuda_peer"])
def test_process_group_p1(tmp_path, kind):
    assert run_ranks(_group_rank, 1, str(tmp_path / "init"), kind) == {0: "ok"}


@pytest.mark.parametrize("kind", [pytest.param("nccl", marks=needs_nccl), "cuda_peer"])
def test_process_group_p2(tmp_path, kind):
    if kind == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank (two ranks on one GPU are refused)")
    assert run_ranks(_group_rank, 2, str(tmp_path / "init"), kind) == {0: "ok", 1: "ok"}
