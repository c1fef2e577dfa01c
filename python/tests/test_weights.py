"""A weight switch on the CPU (HostTransport over numpy arrays through DLPack), checked
against numpy slicing in the vLLM convention."""

import numpy as np
import pytest

import moebius
from conftest import ep_slice, host_memory, raw_view, tp_slice

EP, TP = moebius.Mode.EP, moebius.Mode.TP
W13, W2 = moebius.WeightTensor.w13, moebius.WeightTensor.w2
W13S, W2S = moebius.WeightTensor.w13_scale, moebius.WeightTensor.w2_scale


def make_stack(rng, shape, num_ranks):
    """Random full tensors per layer ({tensor: [E, rows, cols] uint array}), the arena
    geometry, and P poisoned host arenas loaded in the EP view."""
    geometry = moebius.make_arena_geometry(shape, num_ranks, 256, 4096)
    tensors = [W13, W2] + ([W13S, W2S] if shape.block_scales else [])
    full = []
    for _ in range(shape.num_layers):
        layer = {}
        for t in tensors:
            dims = moebius.weight_view_shape(shape, 1, EP, t)  # one rank: the whole tensor
            dt = np.uint16 if t in (W13, W2) and shape.weight_dtype == moebius.DType.bf16 else (
                np.uint8 if t in (W13, W2) else np.uint32)
            layer[t] = rng.integers(0, np.iinfo(dt).max, size=dims, dtype=dt)
        full.append(layer)
    ranks = [moebius.RankMemory(host_memory(geometry.total_bytes)) for _ in range(num_ranks)]
    for r, mem in enumerate(ranks):
        for layer in range(shape.num_layers):
            for t in tensors:
                raw_view(mem, geometry, layer, EP, t)[...] = ep_slice(
                    full[layer][t], t, r, num_ranks, shape.ep_order)
    return geometry, full, ranks, tensors


def check_layer(geometry, full, ranks, tensors, layer, mode):
    shape, P = geometry.shape, geometry.num_ranks
    for r, mem in enumerate(ranks):
        for t in tensors:
            got = raw_view(mem, geometry, layer, mode, t)
            if mode == TP:
                want = tp_slice(full[layer][t], t, r, P, shape.tp_order)
            else:
                want = ep_slice(full[layer][t], t, r, P, shape.ep_order)
            assert got.shape == want.shape
            np.testing.assert_array_equal(got, want, err_msg=f"layer {layer} {t} rank {r} {mode}")


@pytest.mark.parametrize("num_ranks,experts,hidden,inter", [(2, 4, 64, 32), (4, 8, 32, 48),
                                                            (4, 4, 16, 8)])
def test_ep_to_tp_and_back_matches_numpy(rng, num_ranks, experts, hidden, inter):
    shape = moebius.ExpertShape(num_layers=3, num_experts=experts, hidden=hidden,
                                intermediate=inter)
    geometry, full, ranks, tensors = make_stack(rng, shape, num_ranks)
    transport = moebius.HostTransport(ranks)
    L = shape.num_layers

    to_tp = moebius.plan_weight_switch(geometry, 0, L)
    assert to_tp.num_phases == L and to_tp.num_ranks == num_ranks
    transport.execute(to_tp)
    assert transport.completed_phases() == L
    for layer in range(L):
        check_layer(geometry, full, ranks, tensors, layer, TP)

    transport.execute(moebius.plan_weight_switch(geometry, L, 0))
    for layer in range(L):
        check_layer(geometry, full, ranks, tensors, layer, EP)


def test_up_first_order_and_block_scales(rng):
    shape = moebius.ExpertShape(num_layers=2, num_experts=4, hidden=32, intermediate=16,
                                weight_dtype=moebius.DType.fp8_e4m3,
                                tp_order=moebius.GateUpOrder.up_first, block_scales=True,
                                scale_block_n=4, scale_block_k=8)
    geometry, full, ranks, tensors = make_stack(rng, shape, 2)
    assert len(tensors) == 4
    moebius.HostTransport(ranks).execute(moebius.plan_weight_switch(geometry, 0, 2))
    for layer in range(2):
        check_layer(geometry, full, ranks, tensors, layer, TP)
    views = moebius.weight_views(ranks[1], geometry, TP)
    assert sorted(views[0]) == ["w13", "w13_scale", "w2", "w2_scale"]
    assert views[0]["w13"].__dlpack_device__() == (1, 0)


def test_half_switch_rests_at_cursor_and_rolls_back(rng):
    shape = moebius.ExpertShape(num_layers=4, num_experts=4, hidden=32, intermediate=16)
    geometry, full, ranks, tensors = make_stack(rng, shape, 2)
    transport = moebius.HostTransport(ranks)
    plan = moebius.plan_weight_switch(geometry, 0, 4)
    transport.inject_fault(2, 1)  # fails before op 1 of phase 2
    with pytest.raises(moebius.Error) as failure:
        transport.execute(plan)
    assert failure.value.code == "injected_fault"
    done = transport.completed_phases()
    assert done == 2
    for layer in range(4):
        check_layer(geometry, full, ranks, tensors, layer, TP if layer < done else EP)
    undo = moebius.rollback_plan(plan, done)
    assert undo.num_phases == 2 and "undo" in undo.phases[0].label
    transport.execute(undo)
    for layer in range(4):
        check_layer(geometry, full, ranks, tensors, layer, EP)


def test_views_sit_at_fixed_addresses(rng):
    shape = moebius.ExpertShape(num_layers=2, num_experts=4, hidden=32, intermediate=16)
    geometry = moebius.make_arena_geometry(shape, 2, 256, 4096)
    arena = host_memory(geometry.total_bytes)
    mem = moebius.RankMemory(arena)
    assert mem.arena_ptr == arena.ctypes.data and mem.arena_bytes == arena.nbytes
    for mode in (EP, TP):
        for layer in range(2):
            for t in (W13, W2):
                view = raw_view(mem, geometry, layer, mode, t)
                assert view.ctypes.data == arena.ctypes.data + geometry.tensor_base(mode, layer, t)
                assert list(view.shape) == moebius.weight_view_shape(shape, 2, mode, t)
    # TP layer i and EP layer i-1 share slot i: the same bytes.
    assert geometry.tensor_base(TP, 1, W13) == geometry.tensor_base(EP, 0, W13)
    # A view keeps its memory alive.
    view = mem.weight_view(geometry, 0, EP, W13, raw=True)
    del mem, arena
    assert (np.from_dlpack(view) == 0xABAB).all()


def test_plans_print_compare_and_validate():
    shape = moebius.ExpertShape(num_layers=2, num_experts=4, hidden=32, intermediate=16)
    geometry = moebius.make_arena_geometry(shape, 2, 256, 4096)
    a = moebius.plan_weight_switch(geometry, 0, 2)
    b = moebius.plan_weight_switch(geometry, 0, 2)
    c = moebius.plan_weight_switch(geometry, 2, 0)
    assert a == b and a != c
    assert str(a) == repr(a) and str(a).startswith("plan: 2 ranks, 2 phases")
    assert "layer 0 EP->TP" in str(a)
    assert len(a.format(ops=True).splitlines()) == 1 + a.num_phases + a.num_ops()
    with pytest.raises(TypeError):
        hash(a)
    assert a.find_phase_hazard() == ""
    traffic = a.traffic()
    # Volume invariance: each rank keeps 1/P of its bytes and sends (P-1)/P.
    per_layer = geometry.layer_bytes_per_rank
    assert traffic.bytes_sent == traffic.bytes_received == [per_layer * 2 // 2] * 2
    assert traffic.bytes_local == [per_layer * 2 // 2] * 2
    assert traffic.max_bytes_sent == per_layer and traffic.total_bytes_sent == 2 * per_layer
    assert a.workload() == moebius.SwitchWorkload(num_ranks=2, weight_bytes_per_rank=per_layer,
                                                  weight_phases=2)
    a.validate(geometry.total_bytes)
    # A plan is data: rebuild it op by op and it compares equal.
    rebuilt = moebius.Plan(num_ranks=2, phases=[
        moebius.PlanPhase(p.label, [moebius.CopyOp(src_rank=o.src_rank, src_offset=o.src_offset,
                                                   dst_rank=o.dst_rank, dst_offset=o.dst_offset,
                                                   rows=o.rows, row_bytes=o.row_bytes,
                                                   src_pitch=o.src_pitch, dst_pitch=o.dst_pitch)
                                    for o in p.ops]) for p in a.phases])
    assert rebuilt == a
    assert shape == moebius.ExpertShape(num_layers=2, num_experts=4, hidden=32, intermediate=16)
    assert geometry == moebius.make_arena_geometry(shape, 2, 256, 4096)
    assert "arena_geometry{" in repr(geometry)


def test_pointer_tuples_work_like_arrays(rng):
    shape = moebius.ExpertShape(num_layers=2, num_experts=4, hidden=32, intermediate=16)
    geometry, full, ranks, tensors = make_stack(rng, shape, 2)
    # The same bytes, handed in as (pointer, bytes, device=-1): the caller keeps them alive.
    backing = [np.from_dlpack(m.weight_view(geometry, 0, EP, W13, raw=True)) for m in ranks]
    tuples = [moebius.RankMemory((m.arena_ptr, m.arena_bytes, -1)) for m in ranks]
    assert [t.device for t in tuples] == [-1, -1]
    moebius.HostTransport(tuples).execute(moebius.plan_weight_switch(geometry, 0, 2))
    for layer in range(2):
        check_layer(geometry, full, ranks, tensors, layer, TP)
    assert len(backing) == 2
