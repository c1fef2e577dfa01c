"""GPU tests with torch: the CUDA peer transport in one process (ranks on devices, or virtual
ranks sharing one device) and across processes (IPC handles as bytes, gathered by the caller).
Marked `gpu`; skipped without torch, CUDA devices or a CUDA build of moebius.

Run on the device: python -m pytest -q -m gpu python/tests
"""

import multiprocessing as mp

import numpy as np
import pytest

import moebius
from conftest import tp_slice
from test_kv import logical_kv, random_ep_state

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not moebius.with_cuda, reason="moebius was built without CUDA"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

EP, TP = moebius.Mode.EP, moebius.Mode.TP
W13, W2 = moebius.WeightTensor.w13, moebius.WeightTensor.w2


def devices(P):
    n = torch.cuda.device_count()
    return [r % n for r in range(P)]  # one device: virtual ranks


def make_weights(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return [{t: torch.randn(moebius.weight_view_shape(shape, 1, EP, t), generator=g)
             .to(torch.bfloat16) for t in (W13, W2)} for _ in range(shape.num_layers)]


def load_ep(mem, arena, full, rank):
    P = arena.num_ranks
    for layer, tensors in enumerate(full):
        for t, w in tensors.items():
            n = w.shape[0] // P
            torch.from_dlpack(mem.weight_view(arena, layer, EP, t)).copy_(w[rank * n:(rank + 1) * n])


def check_tp(mem, arena, full, rank):
    for layer, tensors in enumerate(full):
        for t, w in tensors.items():
            got = torch.from_dlpack(mem.weight_view(arena, layer, TP, t)).cpu()
            want = torch.from_numpy(tp_slice(w.view(torch.int16).numpy(), t, rank,
                                              arena.num_ranks)).view(torch.bfloat16)
            assert torch.equal(got, want), f"layer {layer} {t} rank {rank}"


@pytest.mark.parametrize("P", [2, 4])
def test_single_process_weight_switch(P):
    shape = moebius.ExpertShape(num_layers=3, num_experts=8, hidden=256, intermediate=128)
    arena = moebius.make_arena_geometry(shape, P)
    full = make_weights(shape, 1)
    tensors = [torch.full((arena.total_bytes,), 0xAB, dtype=torch.uint8, device=f"cuda:{d}")
               for d in devices(P)]
    ranks = [moebius.RankMemory(t) for t in tensors]
    for r, mem in enumerate(ranks):
        assert mem.device == tensors[r].device.index
        load_ep(mem, arena, full, r)
    view = torch.from_dlpack(ranks[0].weight_view(arena, 1, TP, W13))
    assert view.dtype == torch.bfloat16 and view.is_cuda
    assert view.data_ptr() == tensors[0].data_ptr() + arena.tensor_base(TP, 1, W13)
    streams = [torch.cuda.Stream(device=d) for d in devices(P)]
    transport = moebius.CudaPeerTransport.single_process(ranks)
    assert transport.stream_of(0) != 0
    torch.cuda.synchronize()
    # On the caller's streams: the plan runs after what was queued there before it.
    transport.enqueue(moebius.plan_weight_switch(arena, 0, shape.num_layers),
                      [s.cuda_stream for s in streams])
    transport.wait()
    for r, mem in enumerate(ranks):
        check_tp(mem, arena, full, r)
    assert transport.last_execute_stats["copy_engine_ops"] + \
        transport.last_execute_stats["sm_kernel_ops"] > 0
    transport.execute(moebius.plan_weight_switch(arena, shape.num_layers, 0))
    for r, mem in enumerate(ranks):
        for layer in range(shape.num_layers):
            n = shape.num_experts // P
            got = torch.from_dlpack(mem.weight_view(arena, layer, EP, W2)).cpu()
            assert torch.equal(got, full[layer][W2][r * n:(r + 1) * n])


def test_kv_migration_on_gpu():
    P = 2
    rng = np.random.default_rng(7)
    kv = moebius.make_kv_geometry(2, 4, 64, 16, 32, P)
    state = random_ep_state(rng, kv, 0.4)
    host = [rng.integers(0, 256, kv.pool_bytes, dtype=np.uint8) for _ in range(P)]
    pools = [torch.from_numpy(h).to(f"cuda:{d}") for h, d in zip(host, devices(P))]
    arenas = [torch.zeros(4096, dtype=torch.uint8, device=p.device) for p in pools]
    ranks = [moebius.RankMemory(a, p) for a, p in zip(arenas, pools)]
    before = logical_kv(kv, state, [moebius.RankMemory(np.zeros(64, np.uint8), h) for h in host])
    transport = moebius.CudaPeerTransport.single_process(ranks)
    migration = moebius.plan_kv_migration(kv, state, TP)
    transport.execute(migration.copies)
    after_host = [p.cpu().numpy() for p in pools]
    after = logical_kv(kv, migration.new_state,
                       [moebius.RankMemory(np.zeros(64, np.uint8), h) for h in after_host])
    for seq_id, data in before.items():
        np.testing.assert_array_equal(after[seq_id], data)


def _ipc_rank(rank, P, to_parent, from_parent, results):
    try:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        shape = moebius.ExpertShape(num_layers=2, num_experts=4, hidden=128, intermediate=64)
        arena = moebius.make_arena_geometry(shape, P)
        full = make_weights(shape, 3)
        buffer = torch.full((arena.total_bytes,), 0xAB, dtype=torch.uint8, device="cuda")
        mem = moebius.RankMemory(buffer)
        load_ep(mem, arena, full, rank)
        torch.cuda.synchronize()
        exchange = moebius.CudaPeerTransport.export_ipc(mem, rank, P)
        to_parent.put((rank, exchange.local_info()))  # the engine's process group does this
        transport = exchange.open(from_parent.get(timeout=120))
        assert transport.process_rank == rank and transport.local_ranks() == [rank]
        transport.execute(moebius.plan_weight_switch(arena, 0, 2))
        check_tp(mem, arena, full, rank)
        results.put((rank, "ok"))
    except Exception as e:  # report, never hang the parent
        results.put((rank, repr(e)))


def test_multi_process_ipc_exchange():
    P = 2
    ctx = mp.get_context("spawn")
    to_parent, results = ctx.Queue(), ctx.Queue()
    from_parent = [ctx.Queue() for _ in range(P)]
    procs = [ctx.Process(target=_ipc_rank, args=(r, P, to_parent, from_parent[r], results))
             for r in range(P)]
    for p in procs:
        p.start()
    infos = dict(to_parent.get(timeout=120) for _ in range(P))
    assert all(len(b) == moebius.cuda_ipc_rank_info_bytes for b in infos.values())
    for q in from_parent:
        q.put([infos[r] for r in range(P)])
    outcome = dict(results.get(timeout=120) for _ in range(P))
    for p in procs:
        p.join(timeout=60)
    assert outcome == {r: "ok" for r in range(P)}
