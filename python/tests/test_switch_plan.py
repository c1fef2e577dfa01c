"""A switch planned once, over a KV pool laid out as vLLM's FlashInfer backend lays it out, from
Python: the pool is host memory in vLLM's layout (moebius.vllm_flashinfer_layout, the C++
preset), the switcher is given that layout (kv_layout=), the plan is made once and read for the
capacity check, the pacing and the run (switch_to(plan), begin(plan)), and every live KV byte is
checked where vLLM's cache puts it in the target mode, by offsets written out here in numpy from
vLLM's tensor shapes (not from the library). A plan made before the state moved on is refused
with why_stale's reason. Then the policy's two phases priced from that one plan, and the gates'
worked examples."""

import numpy as np
import pytest

import moebius
from conftest import ep_slice, host_memory, raw_view, tp_slice
from test_kv import random_ep_state

EP, TP = moebius.Mode.EP, moebius.Mode.TP
W13, W2 = moebius.WeightTensor.w13, moebius.WeightTensor.w2
Outcome = moebius.SwitchOutcome
ITEM = 2  # bf16


def vllm_flashinfer_offset(kv, mode, layer, tensor, block, head, token):
    """Byte offset of element (layer, K|V, block, head, token, dim 0) of vLLM's FlashInfer
    cache: per layer a tensor (num_blocks, 2, block_size, num_kv_heads, head_size) with stride
    order (0, 1, 3, 2, 4) (HND: each block's K then V, each [heads][tokens][dim]), the layers
    back to back in one buffer. A TP engine over the same buffer sees num_blocks * split blocks
    of its heads_tp = H / split heads (split = H / max(1, H / P))."""
    H, T, D, N, P = kv.num_kv_heads, kv.page_size, kv.head_dim, kv.num_ep_pages, kv.num_ranks
    heads = H if mode == EP else max(1, H // P)
    block_bytes = 2 * heads * T * D * ITEM
    layer_bytes = N * 2 * H * T * D * ITEM
    return (layer * layer_bytes + block * block_bytes + tensor.value * (block_bytes // 2)
            + (head * T + token) * D * ITEM)


def heads_of_rank(kv, rank):
    """The KV heads TP rank `rank` holds: slice `rank` of H/P heads, or with H < P head
    rank // (P / H) (each head replicated on P / H ranks)."""
    H, P = kv.num_kv_heads, kv.num_ranks
    if H >= P:
        return range(rank * (H // P), (rank + 1) * (H // P))
    return range(rank // (P // H), rank // (P // H) + 1)


def read_sequence(kv, pool, mode, seq, heads):
    """[L, K|V, tokens, len(heads), D * ITEM] bytes of one sequence from one rank's pool (a
    uint8 array), through its pages, at vllm_flashinfer_offset. `heads` index the page's
    heads in `mode` (TP: 0 .. heads_tp - 1)."""
    T, D = kv.page_size, kv.head_dim
    out = np.empty((kv.num_layers, 2, seq.num_tokens, len(heads), D * ITEM), np.uint8)
    for layer in range(kv.num_layers):
        for t in (moebius.KvTensor.K, moebius.KvTensor.V):
            for i in range(seq.num_tokens):
                for j, h in enumerate(heads):
                    at = vllm_flashinfer_offset(kv, mode, layer, t, seq.pages[i // T], h, i % T)
                    out[layer, t.value, i, j] = pool[at:at + D * ITEM]
    return out


def logical_kv(kv, pools, state):
    """{seq_id: [L, K|V, tokens, H, D * ITEM]} of an EP state (each sequence on its owner)."""
    return {seq.seq_id: read_sequence(kv, pools[r], EP, seq, range(kv.num_kv_heads))
            for r, rank in enumerate(state.ranks) for seq in rank.sequences}


def check_in_mode(kv, pools, state, want):
    """Every live KV byte of `state` (any mode) is where vLLM's cache puts it: EP on the owner
    with every head, TP on every rank with its heads."""
    seen = set()
    for r, rank in enumerate(state.ranks):
        for seq in rank.sequences:
            seen.add(seq.seq_id)
            if state.mode == EP:
                got = read_sequence(kv, pools[r], EP, seq, range(kv.num_kv_heads))
                np.testing.assert_array_equal(got, want[seq.seq_id],
                                              err_msg=f"EP rank {r} seq {seq.seq_id}")
            else:
                heads = heads_of_rank(kv, r)
                got = read_sequence(kv, pools[r], TP, seq, range(len(heads)))
                np.testing.assert_array_equal(got, want[seq.seq_id][:, :, :, heads.start:heads.stop],
                                              err_msg=f"TP rank {r} seq {seq.seq_id}")
    assert seen == set(want)


@pytest.mark.parametrize("heads,P", [(4, 2), (2, 4)])
def test_planned_once_switch_over_a_vllm_flashinfer_pool(rng, heads, P):
    L = 2
    shape = moebius.ExpertShape(num_layers=L, num_experts=4, hidden=32, intermediate=16)
    arena = moebius.make_arena_geometry(shape, P, 256, 4096)
    kv = moebius.make_kv_geometry(L, heads, 8, 4, 8, P, layout=moebius.KvLayout.HND)
    layout = moebius.vllm_flashinfer_layout(kv)
    assert layout.preset == moebius.KvPreset.vllm_flashinfer and layout.pool_bytes == kv.pool_bytes
    assert layout == moebius.kv_preset_layout(moebius.KvPreset.vllm_flashinfer, kv)
    assert layout.ep.page == 2 * kv.ep_page_bytes and layout.ep.kv == kv.ep_page_bytes
    layout.validate(kv)
    # The preset puts every element where vLLM's shape says (spot-checked here; every live
    # byte below).
    for mode in (EP, TP):
        for args in ((1, moebius.KvTensor.V, 3, 0, 2), (0, moebius.KvTensor.K, 5, 0, 1)):
            layer, t, page, head, token = args
            assert layout.offset(mode, layer, t, page, head, token, 0) == \
                vllm_flashinfer_offset(kv, mode, layer, t, page, head, token)

    full = [{t: rng.integers(0, 2**16, moebius.weight_view_shape(shape, 1, EP, t),
                             dtype=np.uint16) for t in (W13, W2)} for _ in range(L)]
    pools = [rng.integers(0, 256, layout.pool_bytes, dtype=np.uint8) for _ in range(P)]
    ranks = [moebius.RankMemory(host_memory(arena.total_bytes), pool) for pool in pools]
    for r, mem in enumerate(ranks):
        for layer in range(L):
            for t in (W13, W2):
                raw_view(mem, arena, layer, EP, t)[...] = ep_slice(full[layer][t], t, r, P)
    state = random_ep_state(rng, kv, 0.4 * min(1.0, heads / P))
    want = logical_kv(kv, pools, state)
    checksum = moebius.kv_checksum(kv, state, ranks, layout=layout)
    assert checksum != moebius.kv_checksum(kv, state, ranks)  # the present pool reads elsewhere

    checked = []

    def verify_layer(layer, mode, tables):  # every layer, before anything moves and as it lands
        checked.append((layer, mode))
        cursor = 0 if mode == EP else L
        return (moebius.weight_checksum(arena, cursor, layer, ranks)
                + moebius.kv_layer_checksum(kv, tables, layer, ranks, layout=layout)) % 2**64

    flips = []
    sw = moebius.Switcher(arena, kv, moebius.HostTransport(ranks), state, 0,
                          on_commit=flips.append, verify_layer=verify_layer, kv_layout=layout,
                          stage_kv_in_free_slot=True, max_kv_rounds=64)
    assert sw.kv_layout == layout

    # Plan once; the capacity check, the pacing and the run all read this one plan.
    plan = sw.plan(TP)
    assert (plan.from_, plan.to, plan.start, plan.goal) == (EP, TP, 0, L)
    assert not plan.already_there and sw.why_stale(plan) == ""
    assert plan.capacity.fits and plan.capacity.reason == "" and plan.capacity.rounds >= 1
    assert plan.capacity == sw.check(TP)
    assert plan.layer_capacity.fits and plan.bytes_per_layer == sw.layer_bytes_of(TP)
    assert plan.bytes_per_layer.busiest > 0 and len(plan.bytes_per_layer.kv_bytes_sent) == P
    assert plan.weights.num_phases == L and plan.weights == moebius.plan_weight_switch(arena, 0, L)
    assert plan.kv is not None and plan.kv.new_state.mode == TP
    assert plan.kv.copies.num_phases == plan.capacity.rounds
    assert repr(plan).startswith("switch_plan{EP->TP cursor 0->2")

    report = sw.switch_to(plan)
    assert report.outcome == Outcome.committed, report.error
    assert report.verified and flips == [TP] and sw.mode == TP and sw.cursor == L
    assert report.plan_ms == plan.plan_ms  # it ran the plan, planning nothing of its own
    assert sw.kv_tables == plan.kv.new_state
    assert set(checked) == {(layer, m) for layer in range(L) for m in (EP, TP)}
    check_in_mode(kv, pools, sw.kv_tables, want)
    for r, mem in enumerate(ranks):
        for layer in range(L):
            for t in (W13, W2):
                np.testing.assert_array_equal(raw_view(mem, arena, layer, TP, t),
                                              tp_slice(full[layer][t], t, r, P))
    assert moebius.kv_checksum(kv, sw.kv_tables, ranks, layout=layout) == checksum

    # The plan is stale now: refused by name, with why_stale's reason.
    reason = sw.why_stale(plan)
    assert "generation" in reason and "a switch to TP" in reason
    with pytest.raises(moebius.Error) as e:
        sw.switch_to(plan)
    assert e.value.code == "invalid_argument" and "stale" in str(e.value)
    assert reason in str(e.value)
    back = sw.plan(EP)
    sw.kv_tables = sw.kv_tables  # the engine hands its tables in: every older plan is stale
    reason = sw.why_stale(back)
    assert "mutable_kv_tables" in reason
    with pytest.raises(moebius.Error, match="stale") as e:
        sw.begin(back)
    assert reason in str(e.value) and sw.mode == TP
    other = moebius.Switcher(arena, kv, moebius.HostTransport(ranks), sw.kv_tables, L,
                             kv_layout=layout)
    assert "another switcher" in sw.why_stale(other.plan(EP))

    # Back to EP progressively from one plan: its per-layer bytes pace the session.
    back = sw.plan(EP)
    assert back.layer_kv is not None and back.layer_capacity.fits
    with sw.begin(back) as session:
        assert session.open and session.bytes_per_layer == back.bytes_per_layer
        moved = []
        while session.layers_remaining:
            moved += session.advance(1)
            assert session.wait() == "ready"
        assert moved == list(reversed(range(L)))  # TP -> EP moves the last layer first
        done = session.finish()
    assert done.outcome == Outcome.committed, done.error
    assert sw.mode == EP and flips == [TP, EP]
    check_in_mode(kv, pools, sw.kv_tables, want)

    # A stop-the-world plan has no per-layer half: begin refuses it, switch_to runs it.
    quick = sw.plan(TP, scope=moebius.PlanScope.stop_the_world)
    assert quick.layer_kv is None and not quick.layer_capacity.fits
    assert "not planned" in quick.layer_capacity.reason and quick.capacity.fits
    refused = sw.begin(quick)
    assert not refused.open and refused.report.outcome == Outcome.refused_capacity
    assert sw.why_stale(quick) == ""  # a refused begin moved nothing
    assert sw.switch_to(quick).outcome == Outcome.committed
    check_in_mode(kv, pools, sw.kv_tables, want)


def test_a_plan_that_does_not_fit_moves_nothing(rng):
    """H_kv = 2 on P = 4: TP holds half of what EP holds. A full EP pool's plan says so, and
    running it gives the refused report without moving a byte."""
    shape = moebius.ExpertShape(num_layers=1, num_experts=4, hidden=32, intermediate=16)
    arena = moebius.make_arena_geometry(shape, 4, 256, 4096)
    kv = moebius.make_kv_geometry(1, 2, 8, 4, 8, 4)
    layout = moebius.vllm_flashinfer_layout(kv)
    ranks = [moebius.RankMemory(host_memory(arena.total_bytes),
                                rng.integers(0, 256, layout.pool_bytes, dtype=np.uint8))
             for _ in range(4)]
    before = [np.from_dlpack(m.kv_pool_view(kv, EP, raw=True)).copy() for m in ranks]
    state = random_ep_state(rng, kv, 0.9)
    sw = moebius.Switcher(arena, kv, moebius.HostTransport(ranks), state, kv_layout=layout)
    plan = sw.plan(TP)
    assert not plan.capacity.fits and plan.kv is None and plan.capacity.reason
    assert plan.capacity.pages_needed > plan.capacity.pages_available
    report = sw.switch_to(plan)
    assert report.outcome == Outcome.refused_capacity and report.capacity == plan.capacity
    assert sw.mode == EP and sw.kv_tables == state
    for m, old in zip(ranks, before):
        np.testing.assert_array_equal(np.from_dlpack(m.kv_pool_view(kv, EP, raw=True)), old)


def test_staging_and_round_options_reach_the_plan(rng):
    """stage_kv_in_free_slot and max_kv_rounds from Python: a full EP pool fits TP only by
    staging through the arena's free slot, in two rounds; one round is not enough."""
    shape = moebius.ExpertShape(num_layers=2, num_experts=4, hidden=32, intermediate=16)
    arena = moebius.make_arena_geometry(shape, 2, 256, 4096)
    kv = moebius.make_kv_geometry(2, 4, 8, 4, 8, 2)
    ranks = [moebius.RankMemory(host_memory(arena.total_bytes), host_memory(kv.pool_bytes))
             for _ in range(2)]
    full = random_ep_state(rng, kv, 1.0)
    assert all(not r.free_pages for r in full.ranks)

    def plan(**options):
        return moebius.Switcher(arena, kv, moebius.HostTransport(ranks), full, **options).plan(TP)

    staged = plan(stage_kv_in_free_slot=True)
    assert staged.capacity.fits and staged.capacity.rounds == 2 and staged.kv.stats.pages_staged > 0
    unstaged = plan(stage_kv_in_free_slot=False)
    assert not unstaged.capacity.fits and "stuck" in unstaged.capacity.reason
    one_round = plan(max_kv_rounds=1)
    assert not one_round.capacity.fits and "max_rounds=1" in one_round.capacity.reason


def test_ep_placement_callable_places_the_way_to_ep(rng):
    """switcher_options.ep_placement from Python: the owners it returns are the plan's, and the
    sequences land on them."""
    shape = moebius.ExpertShape(num_layers=1, num_experts=4, hidden=32, intermediate=16)
    arena = moebius.make_arena_geometry(shape, 2, 256, 4096)
    kv = moebius.make_kv_geometry(1, 4, 8, 4, 16, 2)
    ranks = [moebius.RankMemory(host_memory(arena.total_bytes), host_memory(kv.pool_bytes))
             for _ in range(2)]
    tp = moebius.plan_kv_migration(kv, random_ep_state(rng, kv, 0.3), TP).new_state
    seen = []

    def everyone_on_rank_1(tp_tables):
        seen.append(tp_tables)
        demands, _ = moebius.kv_demands_of(kv, tp_tables)
        load = sum(d.own_pages for d in demands)
        return moebius.KvPlacement(owner=[1] * len(demands), load=[0, load], fits=True,
                                   imbalance=2.0)

    sw = moebius.Switcher(arena, kv, moebius.HostTransport(ranks), tp, 1,
                          ep_placement=everyone_on_rank_1)
    plan = sw.plan(EP)
    assert seen == [tp] and plan.ep_placement.owner == [1] * len(tp.ranks[0].sequences)
    assert sw.switch_to(plan).outcome == Outcome.committed
    assert sw.kv_tables.ranks[0].sequences == []
    assert [s.seq_id for s in sw.kv_tables.ranks[1].sequences] == \
        [s.seq_id for s in tp.ranks[0].sequences]


def test_recover_after_an_inconsistent_switch(rng):
    shape = moebius.ExpertShape(num_layers=2, num_experts=4, hidden=32, intermediate=16)
    arena = moebius.make_arena_geometry(shape, 2, 256, 4096)
    kv = moebius.make_kv_geometry(2, 4, 8, 4, 8, 2)
    full = [{t: rng.integers(0, 2**16, moebius.weight_view_shape(shape, 1, EP, t),
                             dtype=np.uint16) for t in (W13, W2)} for _ in range(2)]
    ranks = [moebius.RankMemory(host_memory(arena.total_bytes),
                                rng.integers(0, 256, kv.pool_bytes, dtype=np.uint8))
             for _ in range(2)]
    state = random_ep_state(rng, kv, 0.4)
    sw = moebius.Switcher(arena, kv, moebius.HostTransport(ranks), state)
    sw.inject_fault(moebius.SwitchStage.weights, 1)
    sw.inject_fault(moebius.SwitchStage.undo, 0)
    assert sw.switch_to(TP).outcome == Outcome.inconsistent and not sw.consistent
    refused = sw.switch_to(TP)  # refused, moving nothing, until recover()
    assert refused.outcome == Outcome.inconsistent and "inconsistent" in refused.error
    reloads = []

    def reload_experts(cursor):
        reloads.append(cursor)
        for r, mem in enumerate(ranks):
            for layer in range(2):
                for t in (W13, W2):
                    raw_view(mem, arena, layer, EP, t)[...] = ep_slice(full[layer][t], t, r, 2)

    rec = sw.recover(EP, reload_experts)
    assert rec.recovered and rec.error == "" and rec.layout == EP and rec.cursor == 0
    assert reloads == [0] and sw.consistent and sw.mode == EP
    assert sorted(rec.kept + rec.lost) == sorted(s.seq_id for r in state.ranks for s in r.sequences)
    assert "RecoveryReport(recovered=True" in repr(rec)
    assert sw.switch_to(TP).outcome == Outcome.committed


def test_policy_decides_on_the_priced_plan(rng):
    """The two phases from Python: the rules propose, the proposal is planned once and priced
    from that plan (capacity from plan.capacity, the step-time gate with a residency from the
    config), the policy decides, and the same plan runs."""
    shape = moebius.ExpertShape(num_layers=2, num_experts=4, hidden=32, intermediate=16)
    arena = moebius.make_arena_geometry(shape, 2, 256, 4096)
    kv = moebius.make_kv_geometry(2, 4, 8, 4, 8, 2)
    ranks = [moebius.RankMemory(host_memory(arena.total_bytes), host_memory(kv.pool_bytes))
             for _ in range(2)]
    sw = moebius.Switcher(arena, kv, moebius.HostTransport(ranks), random_ep_state(rng, kv, 0.3))
    # EP 20 + 0.05 b ms, TP 10 + 0.1 b ms (crossover 200).
    batches = [1, 64, 512]
    curves = moebius.LatencyCurves(
        ep=moebius.LatencyCurve.fit([(b, 20 + 0.05 * b) for b in batches]),
        tp=moebius.LatencyCurve.fit([(b, 10 + 0.1 * b) for b in batches]))
    config = moebius.rollout_config(256)
    config.expected_residency_steps = 100
    policy = moebius.SwitchPolicy(config)

    def step(load, now, switch_ms):
        p = policy.propose(load, sw.mode, now)
        pricing, plan = moebius.SwitchPricing(), None
        if p:
            plan = sw.plan(p.target)
            pricing.fits = plan.capacity.fits
            if pricing.fits:
                residency = moebius.residency_steps(config, None, p.load, p.target)
                pricing.gate = moebius.weigh_step_time(curves, sw.mode, p.target, p.load,
                                                       residency, switch_ms, config.gate_margin)
        d = policy.decide(p, pricing)
        if d:
            assert sw.switch_to(plan).outcome == Outcome.committed
        return d, pricing.gate

    # EP -> TP at load 10 saves 9.5 ms a step, 950 ms over 100 steps: 951 ms is refused.
    d, gate = step(10, 0.0, 951.0)
    assert not d and d.reason == moebius.DecisionReason.cost_exceeds_gain
    assert gate.evaluated and not gate.passed and gate.gain_ms == pytest.approx(950.0)
    assert sw.mode == EP
    d, gate = step(10, 1.0, 949.0)
    assert d and gate.passed and sw.mode == TP and policy.stats.switches == 1


def test_gates_worked_examples():
    line = moebius.LatencyCurve.fit([(1, 10), (3, 14)])
    assert (line.intercept, line.slope) == pytest.approx((8.0, 2.0)) and line.at(5) == 18
    batches = [1, 64, 512]
    ep = moebius.LatencyCurve.fit([(b, 20 + 0.05 * b) for b in batches])
    tp = moebius.LatencyCurve.fit([(b, 10 + 0.1 * b) for b in batches])
    curves = moebius.LatencyCurves(ep, tp)
    cross = moebius.find_crossover(curves)
    assert cross.status == moebius.CrossoverStatus.found and cross.batch == pytest.approx(200)
    result = moebius.calibrate([(b, 20 + 0.05 * b) for b in batches],
                               [(b, 10 + 0.1 * b) for b in batches])
    assert result.has_thresholds and (result.t_high, result.t_low) == (250, 200)
    assert moebius.apply_calibration(result, moebius.SwitchPolicyConfig()).t_high == 250

    # Step-time gate (step_time_gate.hpp): EP -> TP at load 10 saves 9.5 ms a step.
    g = moebius.weigh_step_time(curves, EP, TP, 10, 100, 949.0, 0.0)
    assert g.evaluated and g.passed and g.gain_ms == pytest.approx(950.0) and g.cost_ms == 949.0
    assert (g.target, g.load, g.residency_steps) == (TP, 10, 100)
    assert not moebius.weigh_step_time(curves, EP, TP, 10, 100, 951.0, 0.0).passed
    assert not moebius.weigh_step_time(curves, EP, TP, 10, 100, 700.0, 0.5).passed  # 1050 > 950
    assert not moebius.weigh_step_time(curves, EP, TP, 10, 0, 1.0, 0.0).evaluated  # unknown
    with pytest.raises(moebius.Error):
        moebius.weigh_step_time(curves, EP, EP, 10, 100, 1.0, 0.0)

    # Throughput gate (throughput_gate.hpp): EP 30 + 0.02 b, TP 20 + 0.08 b; TP runs its pool's
    # 300, 500 wait, EP admits 600: B_tp 300 (44 ms), B_ep 600 (42 ms); 200 steps gain
    # 200 * (44 - 300 * 42 / 600) = 4,600 ms.
    curves = moebius.LatencyCurves(
        moebius.LatencyCurve.fit([(b, 30 + 0.02 * b) for b in batches]),
        moebius.LatencyCurve.fit([(b, 20 + 0.08 * b) for b in batches]))
    load = moebius.ServingLoad(running=300, waiting=500, max_running=2048, admits_ep=600,
                               admits_tp=300, known_residency_steps=200)
    g = moebius.weigh_switch(curves, TP, EP, load, 150.0, 0.0)
    assert g.evaluated and g.passed and g.gain_ms == pytest.approx(4600.0)
    assert (g.current_batch, g.target_batch, g.waiting, g.load) == (300, 600, 500, 800)
    assert g.residency_from == "known work" and g.residency_steps == 200
    # Without the admission term both run 800: 200 * (84 - 46) = 7,600 ms.
    g = moebius.weigh_switch(curves, TP, EP, load, 150.0, 0.0,
                             moebius.GateTerms(admission=False))
    assert g.gain_ms == pytest.approx(7600.0) and g.current_batch == g.target_batch == 800
    assert "admission off" in repr(moebius.GateTerms(admission=False)) or \
        "admission" in repr(moebius.GateTerms(admission=False))


def test_experts_alone_under_tp_attention(rng):
    """Attention and experts as two layouts: from EP, the attention alone goes to TP
    (stop the world; begin refuses it), then the experts alone go EP -> TP progressively and
    back: no KV round, every pool byte unchanged, the experts where numpy slices put them."""
    P, L = 2, 2
    shape = moebius.ExpertShape(num_layers=L, num_experts=4, hidden=32, intermediate=16)
    arena = moebius.make_arena_geometry(shape, P, 256, 4096)
    kv = moebius.make_kv_geometry(L, 2, 8, 4, 8, P)
    full = [{t: rng.integers(0, 2**16, moebius.weight_view_shape(shape, 1, EP, t),
                             dtype=np.uint16) for t in (W13, W2)} for _ in range(L)]
    ranks = [moebius.RankMemory(host_memory(arena.total_bytes),
                                rng.integers(0, 256, kv.pool_bytes, dtype=np.uint8))
             for _ in range(P)]
    for r, mem in enumerate(ranks):
        for layer in range(L):
            for t in (W13, W2):
                raw_view(mem, arena, layer, EP, t)[...] = ep_slice(full[layer][t], t, r, P)
    flips = []
    sw = moebius.Switcher(arena, kv, moebius.HostTransport(ranks), random_ep_state(rng, kv, 0.4),
                          0, on_commit=flips.append)
    tep = moebius.ParallelLayout(TP, EP)
    assert sw.layout == EP and moebius.ParallelLayout(EP) == EP and not tep.uniform
    assert str(tep) == "TP attention, EP experts" and tep.attention == TP and tep.experts == EP

    attention_only = sw.plan(tep)
    assert attention_only.moves_kv and not attention_only.moves_experts
    assert not attention_only.layer_capacity.fits and "switch_to" in attention_only.layer_capacity.reason
    with pytest.raises(moebius.Error) as e:
        sw.begin(attention_only)
    assert e.value.code == "invalid_argument" and "stop-the-world" in str(e.value)
    report = sw.switch_to(attention_only)
    assert report.outcome == Outcome.committed and report.weight_phases == 0
    assert sw.layout == tep and sw.mode == TP and flips == [tep]

    tables = sw.kv_tables
    pools = [np.from_dlpack(m.kv_pool_view(kv, EP, raw=True)).copy() for m in ranks]
    plan = sw.plan(moebius.ParallelLayout(TP, TP))
    assert plan.moves_experts and not plan.moves_kv and plan.capacity.rounds == 0
    assert plan.from_ == tep and plan.to == TP and sum(plan.bytes_per_layer.kv_bytes_sent) == 0
    with sw.begin(plan) as p:
        assert not p.moves_kv
        while p.layers_remaining:
            p.advance(1)
            p.wait()
            assert [p.layout_of(layer) for layer in range(L)] == \
                [moebius.ParallelLayout(TP, TP if layer < p.cursor else EP) for layer in range(L)]
        done = p.finish()
    assert done.outcome == Outcome.committed and done.kv_rounds == 0 and sum(done.kv_bytes_sent) == 0
    assert sw.layout == TP and sw.cursor == L and sw.kv_tables == tables and flips[-1] == TP
    for m, old in zip(ranks, pools):
        np.testing.assert_array_equal(np.from_dlpack(m.kv_pool_view(kv, EP, raw=True)), old)
    for r, mem in enumerate(ranks):
        for layer in range(L):
            for t in (W13, W2):
                np.testing.assert_array_equal(raw_view(mem, arena, layer, TP, t),
                                              tp_slice(full[layer][t], t, r, P))
    back = sw.switch_to(tep)
    assert back.outcome == Outcome.committed and back.kv_rounds == 0 and sw.layout == tep
