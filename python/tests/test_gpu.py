"""GPU tests with torch: the CUDA peer transport in one process (ranks on devices, or virtual
ranks sharing one device) and across processes (IPC handles as bytes, gathered by the caller
or through a torch.distributed group), the progressive switcher on caller streams. With one
GPU every test runs: P ranks share it (virtual ranks in one process, or one process each).
Marked `gpu`; skipped without torch, CUDA devices or a CUDA build of moebius.

Run on the device: python -m pytest -q -m gpu python/tests
"""

import datetime
import multiprocessing as mp
import os
import queue

import numpy as np
import pytest

import moebius
from conftest import ep_slice, host_memory, raw_view, tp_slice
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
    return [r % n for r in range(P)]  # fewer devices than ranks: virtual ranks


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


def tp_reference(w, t, rank, P):
    """vLLM's TP shard of the full bf16 tensor `w`, by numpy slicing (conftest.tp_slice)."""
    return torch.from_numpy(tp_slice(w.view(torch.int16).numpy(), t, rank, P)).view(torch.bfloat16)


def check_tp(mem, arena, full, rank, layers=None):
    for layer, tensors in enumerate(full):
        if layers is not None and layer not in layers:
            continue
        for t, w in tensors.items():
            got = torch.from_dlpack(mem.weight_view(arena, layer, TP, t)).cpu()
            assert torch.equal(got, tp_reference(w, t, rank, arena.num_ranks)), \
                f"layer {layer} {t} rank {rank}"


def check_ep(mem, arena, full, rank):
    for layer, tensors in enumerate(full):
        for t, w in tensors.items():
            n = w.shape[0] // arena.num_ranks
            got = torch.from_dlpack(mem.weight_view(arena, layer, EP, t)).cpu()
            assert torch.equal(got, w[rank * n:(rank + 1) * n]), f"layer {layer} {t} rank {rank}"


def weight_deployment(P, num_layers=3, seed=1):
    """P ranks (poisoned arenas, EP shards loaded) on devices(P)."""
    shape = moebius.ExpertShape(num_layers=num_layers, num_experts=8, hidden=256, intermediate=128)
    arena = moebius.make_arena_geometry(shape, P)
    full = make_weights(shape, seed)
    tensors = [torch.full((arena.total_bytes,), 0xAB, dtype=torch.uint8, device=f"cuda:{d}")
               for d in devices(P)]
    ranks = [moebius.RankMemory(t) for t in tensors]
    for r, mem in enumerate(ranks):
        assert mem.device == tensors[r].device.index
        load_ep(mem, arena, full, r)
    torch.cuda.synchronize()
    return shape, arena, full, tensors, ranks


@pytest.mark.parametrize("P", [2, 4])
def test_single_process_weight_switch(P):
    shape, arena, full, tensors, ranks = weight_deployment(P)
    view = torch.from_dlpack(ranks[0].weight_view(arena, 1, TP, W13))
    assert view.dtype == torch.bfloat16 and view.is_cuda
    assert view.data_ptr() == tensors[0].data_ptr() + arena.tensor_base(TP, 1, W13)
    streams = [torch.cuda.Stream(device=d) for d in devices(P)]
    transport = moebius.CudaPeerTransport.single_process(ranks)
    assert transport.num_ranks() == P and transport.local_ranks() == list(range(P))
    assert transport.process_rank == -1 and transport.stream_of(0) != 0
    assert [transport.device_of(r) for r in range(P)] == devices(P)
    # On the caller's streams: the plan runs after what was queued there before it, and what
    # the caller queues after enqueue() returns runs after the plan (here: a copy of each
    # rank's last TP layer, taken before wait()).
    transport.enqueue(moebius.plan_weight_switch(arena, 0, shape.num_layers),
                      [s.cuda_stream for s in streams])
    copies = []
    for r, (mem, s) in enumerate(zip(ranks, streams)):
        with torch.cuda.stream(s):
            copies.append(torch.from_dlpack(
                mem.weight_view(arena, shape.num_layers - 1, TP, W2)).clone())
    while not transport.poll():
        pass
    transport.wait()
    assert transport.completed_phases() == shape.num_layers
    torch.cuda.synchronize()
    for r, mem in enumerate(ranks):
        check_tp(mem, arena, full, r)
        assert torch.equal(copies[r].cpu(), tp_reference(full[-1][W2], W2, r, P)), f"rank {r}"
    stats = transport.last_execute_stats
    assert stats.copy_engine_ops + stats.sm_kernel_ops > 0
    # Back to EP on the transport's own streams.
    transport.execute(moebius.plan_weight_switch(arena, shape.num_layers, 0))
    for r, mem in enumerate(ranks):
        check_ep(mem, arena, full, r)
    # The same plan again comes from the plan cache.
    transport.execute(moebius.plan_weight_switch(arena, 0, shape.num_layers))
    assert transport.last_execute_stats.from_cache
    for r, mem in enumerate(ranks):
        check_tp(mem, arena, full, r)


@pytest.mark.parametrize("engine", ["copy_engine", "sm_kernel"])
def test_injected_fault_then_resume(engine):
    """A plan that fails at phase 1 leaves layer 0 in TP and the rest in EP; the switch then
    resumes from cursor 1. Both engines, so each moves whole layers."""
    P = 2
    shape, arena, full, tensors, ranks = weight_deployment(P, num_layers=4, seed=2)
    config = moebius.CudaPeerConfig()
    config.engine = getattr(moebius.EnginePolicy, engine)
    transport = moebius.CudaPeerTransport.single_process(ranks, config)
    transport.inject_fault(1)
    with pytest.raises(moebius.Error) as e:
        transport.execute(moebius.plan_weight_switch(arena, 0, shape.num_layers))
    assert e.value.code == "injected_fault"
    assert transport.completed_phases() == 1
    for r, mem in enumerate(ranks):
        check_tp(mem, arena, full, r, layers=[0])
    transport.execute(moebius.plan_weight_switch(arena, 1, shape.num_layers))  # one-shot
    stats = transport.last_execute_stats
    assert getattr(stats, f"{engine}_ops") > 0
    assert getattr(stats, "copy_engine_ops" if engine == "sm_kernel" else "sm_kernel_ops") == 0
    for r, mem in enumerate(ranks):
        check_tp(mem, arena, full, r)


def test_kv_migration_on_gpu():
    P = 2
    rng = np.random.default_rng(7)
    kv = moebius.make_kv_geometry(2, 4, 64, 16, 32, P)
    state = random_ep_state(rng, kv, 0.4)
    host = [rng.integers(0, 256, kv.pool_bytes, dtype=np.uint8) for _ in range(P)]
    pools = [torch.from_numpy(h).to(f"cuda:{d}") for h, d in zip(host, devices(P))]
    arenas = [torch.zeros(4096, dtype=torch.uint8, device=p.device) for p in pools]
    ranks = [moebius.RankMemory(a, p) for a, p in zip(arenas, pools)]

    def on_host(tensors):
        return [moebius.RankMemory(host_memory(64), t.cpu().numpy()) for t in tensors]

    before = logical_kv(kv, state, on_host(pools))
    transport = moebius.CudaPeerTransport.single_process(ranks)
    to_tp = moebius.plan_kv_migration(kv, state, TP)
    transport.execute(to_tp.copies)
    after = logical_kv(kv, to_tp.new_state, on_host(pools))
    assert after.keys() == before.keys()
    for seq_id, data in before.items():
        np.testing.assert_array_equal(after[seq_id], data, err_msg=f"sequence {seq_id} in TP")
    to_ep = moebius.plan_kv_migration(kv, to_tp.new_state, EP)
    transport.execute(to_ep.copies)
    back = logical_kv(kv, to_ep.new_state, on_host(pools))
    for seq_id, data in before.items():
        np.testing.assert_array_equal(back[seq_id], data, err_msg=f"sequence {seq_id} in EP")


def switcher_deployment(rng, P, L):
    """Host memory of a weights + KV deployment (as test_switcher.deployment, L layers)."""
    shape = moebius.ExpertShape(num_layers=L, num_experts=4, hidden=64, intermediate=32)
    arena = moebius.make_arena_geometry(shape, P, 256, 4096)
    kv = moebius.make_kv_geometry(L, 4, 16, 4, 16, P)
    full = [{t: rng.integers(0, 2**16, moebius.weight_view_shape(shape, 1, EP, t),
                             dtype=np.uint16) for t in (W13, W2)} for _ in range(L)]
    arenas = [host_memory(arena.total_bytes) for _ in range(P)]
    pools = [rng.integers(0, 256, kv.pool_bytes, dtype=np.uint8) for _ in range(P)]
    for r in range(P):
        mem = moebius.RankMemory(arenas[r], pools[r])
        for layer in range(L):
            for t in (W13, W2):
                raw_view(mem, arena, layer, EP, t)[...] = ep_slice(full[layer][t], t, r, P)
    return arena, kv, full, arenas, pools, random_ep_state(rng, kv, 0.4)


@pytest.mark.parametrize("preset", [None, moebius.KvPreset.vllm_flashinfer])
def test_progressive_switch_on_caller_streams(preset):
    """The switcher over CudaPeerTransport, planned once, one layer per "decode step" on the
    engine's streams; each step's reads queued behind advance() see the moved layer. Every byte
    of every rank ends as the host transport's run of the same switch leaves it, and weights and
    KV match numpy slicing (the present pool; over vLLM's FlashInfer layout, the KV by its
    layout-aware checksum: test_switch_plan checks that layout byte by byte on the host)."""
    P, L = 2, 3
    rng = np.random.default_rng(5)
    arena, kv, full, arenas, pools, state = switcher_deployment(rng, P, L)
    pool_layout = None if preset is None else moebius.kv_preset_layout(preset, kv)
    start = [moebius.RankMemory(a, p) for a, p in zip(arenas, pools)]
    before = logical_kv(kv, state, start)
    checksum = moebius.kv_checksum(kv, state, start, layout=pool_layout)

    # The reference: the same progressive switch on the host transport.
    host_arenas, host_pools = [a.copy() for a in arenas], [p.copy() for p in pools]
    host_ranks = [moebius.RankMemory(a, p) for a, p in zip(host_arenas, host_pools)]
    host = moebius.Switcher(arena, kv, moebius.HostTransport(host_ranks), state,
                            kv_layout=pool_layout)
    host_session = host.begin(host.plan(TP))
    assert host_session.open
    for _ in range(L):
        host_session.advance(1)
        assert host_session.poll() == "ready"
    assert host_session.finish().outcome == moebius.SwitchOutcome.committed

    gpu_arenas = [torch.from_numpy(a).to(f"cuda:{d}") for a, d in zip(arenas, devices(P))]
    gpu_pools = [torch.from_numpy(p).to(f"cuda:{d}") for p, d in zip(pools, devices(P))]
    ranks = [moebius.RankMemory(a, p) for a, p in zip(gpu_arenas, gpu_pools)]
    streams = [torch.cuda.Stream(device=d) for d in devices(P)]
    flips = []
    sw = moebius.Switcher(arena, kv, moebius.CudaPeerTransport.single_process(ranks), state,
                          on_commit=flips.append, kv_layout=pool_layout)
    plan = sw.plan(TP)
    assert plan.capacity.fits and plan.layer_capacity.fits and plan.capacity == sw.check(TP)
    torch.cuda.synchronize()
    session = sw.begin(plan)
    assert session.open and session.layers_remaining == L
    assert session.bytes_per_layer == plan.bytes_per_layer
    for layer in range(L):
        assert session.advance(1, [s.cuda_stream for s in streams]) == [layer]
        reads = []
        for mem, s in zip(ranks, streams):  # the engine's next step reads the layer in TP
            with torch.cuda.stream(s):
                reads.append(torch.from_dlpack(mem.weight_view(arena, layer, TP, W13)).clone())
        while (state_now := session.poll()) == "in_flight":
            pass
        assert state_now == "ready"
        assert session.cursor == layer + 1 and session.mode_of(layer) == TP
        torch.cuda.synchronize()
        for r, got in enumerate(reads):
            np.testing.assert_array_equal(got.view(torch.int16).cpu().numpy().view(np.uint16),
                                          tp_slice(full[layer][W13], W13, r, P),
                                          err_msg=f"layer {layer} rank {r}")
    report = session.finish()
    assert report.outcome == moebius.SwitchOutcome.committed, report.error
    assert flips == [TP] and sw.mode == TP and not sw.in_progress

    def same_bytes_as_host(when):
        for r in range(P):
            np.testing.assert_array_equal(gpu_arenas[r].cpu().numpy(), host_arenas[r],
                                          err_msg=f"arena of rank {r} {when}")
            np.testing.assert_array_equal(gpu_pools[r].cpu().numpy(), host_pools[r],
                                          err_msg=f"KV pool of rank {r} {when}")

    same_bytes_as_host("in TP")
    on_host = [moebius.RankMemory(a.cpu().numpy(), p.cpu().numpy())
               for a, p in zip(gpu_arenas, gpu_pools)]
    for r, mem in enumerate(on_host):
        for layer in range(L):
            for t in (W13, W2):
                np.testing.assert_array_equal(raw_view(mem, arena, layer, TP, t),
                                              tp_slice(full[layer][t], t, r, P))
    assert moebius.kv_checksum(kv, sw.kv_tables, on_host, layout=pool_layout) == checksum
    if pool_layout is None:
        after = logical_kv(kv, sw.kv_tables, on_host)
        assert after.keys() == before.keys()
        for seq_id, data in before.items():
            np.testing.assert_array_equal(after[seq_id], data, err_msg=f"sequence {seq_id}")
    assert "generation" in sw.why_stale(plan)  # the switch moved the state on
    with pytest.raises(moebius.Error, match="stale"):
        sw.switch_to(plan)

    back = sw.switch_to(sw.plan(EP))
    assert back.outcome == moebius.SwitchOutcome.committed, back.error
    assert flips == [TP, EP] and sw.cursor == 0
    assert host.switch_to(EP).outcome == moebius.SwitchOutcome.committed
    same_bytes_as_host("back in EP")


# --- across processes: one rank per process, on device rank % devices ---------------------------
def run_ranks(target, P, *args, timeout=180):
    """Runs target(rank, P, *args, results) in P spawned processes; returns {rank: outcome}.
    Children that have not reported by `timeout` are killed, never left behind."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, P, *args, results)) for r in range(P)]
    for p in procs:
        p.start()
    outcome = {}
    try:
        for _ in range(P):
            rank, what = results.get(timeout=timeout)
            outcome[rank] = what
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return outcome


def _rank_in_ep(rank, P, num_layers, seed):
    """A child process's rank: its GPU, a small arena in a torch buffer (poisoned with 0xAB),
    holding its EP experts of weights drawn from `seed`."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    shape = moebius.ExpertShape(num_layers=num_layers, num_experts=4, hidden=128, intermediate=64)
    arena = moebius.make_arena_geometry(shape, P)
    full = make_weights(shape, seed)
    buffer = torch.full((arena.total_bytes,), 0xAB, dtype=torch.uint8, device="cuda")
    mem = moebius.RankMemory(buffer)
    load_ep(mem, arena, full, rank)
    torch.cuda.synchronize()
    return shape, arena, full, buffer, mem


def _ipc_rank(rank, P, to_parent, from_parent, results):
    sent = False
    try:
        shape, arena, full, buffer, mem = _rank_in_ep(rank, P, num_layers=2, seed=3)
        exchange = moebius.CudaPeerTransport.export_ipc(mem, rank, P)
        to_parent.put((rank, exchange.local_info()))  # the engine's process group does this
        sent = True
        infos = from_parent.get(timeout=120)
        if infos is None:
            raise RuntimeError("another rank failed before the exchange")
        transport = exchange.open(infos)
        assert transport.process_rank == rank and transport.local_ranks() == [rank]
        transport.execute(moebius.plan_weight_switch(arena, 0, 2))
        check_tp(mem, arena, full, rank)
        transport.execute(moebius.plan_weight_switch(arena, 2, 0))
        check_ep(mem, arena, full, rank)
        results.put((rank, "ok"))
    except BaseException as e:  # report, never hang the parent
        if not sent:
            to_parent.put((rank, None))
        results.put((rank, repr(e)))


def _relay(P, to_parent, from_parent):
    """The parent's part of the IPC exchange: gathers every rank's bytes, sends them all back
    (None to every rank when one failed before it sent its bytes)."""
    infos = dict(to_parent.get(timeout=120) for _ in range(P))
    ok = all(b is not None for b in infos.values())
    if ok:
        assert all(len(b) == moebius.cuda_ipc_rank_info_bytes for b in infos.values())
    for q in from_parent:
        q.put([infos[r] for r in range(P)] if ok else None)


def test_multi_process_ipc_exchange():
    P = 2
    ctx = mp.get_context("spawn")
    to_parent, results = ctx.Queue(), ctx.Queue()
    from_parent = [ctx.Queue() for _ in range(P)]
    procs = [ctx.Process(target=_ipc_rank, args=(r, P, to_parent, from_parent[r], results))
             for r in range(P)]
    for p in procs:
        p.start()
    outcome = {}
    try:
        _relay(P, to_parent, from_parent)
        outcome = dict(results.get(timeout=180) for _ in range(P))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    assert outcome == {r: "ok" for r in range(P)}


def _gloo_rank(rank, P, init_file, results):
    try:
        import socket

        import torch.distributed as dist
        if "lo" in (name for _, name in socket.if_nameindex()):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # no network but the loopback
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=P, timeout=datetime.timedelta(seconds=60))
        shape, arena, full, buffer, mem = _rank_in_ep(rank, P, num_layers=3, seed=4)

        def all_gather(local):
            gathered = [None] * P
            dist.all_gather_object(gathered, local)
            return gathered

        transport = moebius.CudaPeerTransport.multi_process(mem, rank, P, all_gather)
        assert transport.process_rank == rank and transport.local_ranks() == [rank]
        stream = torch.cuda.Stream()
        transport.enqueue(moebius.plan_weight_switch(arena, 0, 3), [stream.cuda_stream])
        transport.wait()
        check_tp(mem, arena, full, rank)
        transport.execute(moebius.plan_weight_switch(arena, 3, 0))
        check_ep(mem, arena, full, rank)
        dist.barrier()  # no rank unmaps its peers' memory while one still writes into it
        del transport
        dist.destroy_process_group()
        results.put((rank, "ok"))
    except BaseException as e:
        results.put((rank, repr(e)))


def test_multi_process_all_gather_through_torch_distributed(tmp_path):
    P = 2
    outcome = run_ranks(_gloo_rank, P, str(tmp_path / "gloo_init"))
    assert outcome == {r: "ok" for r in range(P)}
