"""The switcher end to end on the CPU (weights + KV + tables + selector), its report (a class
generated from the C++ struct), rollback after an injected fault, and the policy's rules."""

import numpy as np
import pytest

import moebius
from conftest import ep_slice, host_memory, raw_view, tp_slice
from test_kv import logical_kv, random_ep_state

EP, TP = moebius.Mode.EP, moebius.Mode.TP
W13, W2 = moebius.WeightTensor.w13, moebius.WeightTensor.w2
Outcome = moebius.SwitchOutcome


def deployment(rng, P=2):
    shape = moebius.ExpertShape(num_layers=2, num_experts=4, hidden=32, intermediate=16)
    arena = moebius.make_arena_geometry(shape, P, 256, 4096)
    kv = moebius.make_kv_geometry(2, 4, 8, 4, 8, P)
    full = [{t: rng.integers(0, 2**16, moebius.weight_view_shape(shape, 1, EP, t),
                             dtype=np.uint16) for t in (W13, W2)} for _ in range(2)]
    ranks = [moebius.RankMemory(host_memory(arena.total_bytes),
                                rng.integers(0, 256, kv.pool_bytes, dtype=np.uint8))
             for _ in range(P)]
    for r, mem in enumerate(ranks):
        for layer in range(2):
            for t in (W13, W2):
                raw_view(mem, arena, layer, EP, t)[...] = ep_slice(full[layer][t], t, r, P)
    return arena, kv, full, ranks, random_ep_state(rng, kv, 0.4)


def checksum(arena, kv, ranks):
    def verify(cursor, state):
        total = moebius.kv_checksum(kv, state, ranks)
        for layer in range(arena.shape.num_layers):
            total += moebius.weight_checksum(arena, cursor, layer, ranks)
        return total % 2**64
    return verify


def test_switch_report_and_selector(rng):
    arena, kv, full, ranks, state = deployment(rng)
    transport = moebius.HostTransport(ranks)
    flips = []
    sw = moebius.Switcher(arena, kv, transport, state, 0, on_commit=flips.append,
                          verify=checksum(arena, kv, ranks))
    before = logical_kv(kv, state, ranks)
    assert sw.mode == EP and sw.cursor == 0 and sw.consistent
    assert sw.check(TP).fits

    report = sw.switch_to(TP)
    assert report.outcome == Outcome.committed, report.error
    assert report.from_ == EP and report.to == TP and report.cursor == 2
    assert report.verified and flips == [TP] and sw.mode == TP
    assert report.weight_phases == report.weight_phases_completed == 2
    assert len(report.weight_bytes_sent) == 2 and report.kv_stats.rounds >= 1
    assert report.kv_rounds == report.kv_stats.rounds and report.capacity.fits
    assert report.total_ms >= 0 and str(report).startswith("switch EP->TP")
    assert repr(report) == str(report)  # the C++ operator<< line
    # Fields as a dict for a JSON log, generated from the struct (nested records too).
    d = report.as_dict()
    assert list(d) == list(moebius.SwitchReport.__fields__)
    assert d["kv_stats"] == report.kv_stats.as_dict() and d["outcome"] == Outcome.committed
    with pytest.raises(AttributeError):
        report.outcome = Outcome.rolled_back  # read-only
    for r, mem in enumerate(ranks):
        for layer in range(2):
            for t in (W13, W2):
                np.testing.assert_array_equal(raw_view(mem, arena, layer, TP, t),
                                              tp_slice(full[layer][t], t, r, 2))
    after = logical_kv(kv, sw.kv_tables, ranks)
    for seq_id, data in before.items():
        np.testing.assert_array_equal(after[seq_id], data)

    assert sw.switch_to(TP).outcome == Outcome.already_there
    back = sw.switch_to(EP)
    assert back.outcome == Outcome.committed and flips == [TP, EP] and sw.cursor == 0
    assert back == sw.last_report and back != report  # compared field by field


def test_progressive_switch(rng):
    arena, kv, full, ranks, state = deployment(rng)
    flips = []
    sw = moebius.Switcher(arena, kv, moebius.HostTransport(ranks), state, on_commit=flips.append)
    before = logical_kv(kv, state, ranks)
    expected_bytes = sw.layer_bytes_of(TP)
    session = sw.begin(TP)
    assert session.open and session.report.outcome == Outcome.in_progress and sw.in_progress
    assert session.layers_remaining == 2
    assert session.bytes_per_layer == expected_bytes
    assert session.advance(1) == [0]
    while (state_now := session.poll()) == "in_flight":
        pass
    assert state_now == "ready"
    assert session.cursor == 1 and session.mode_of(0) == TP and session.mode_of(1) == EP
    for r, mem in enumerate(ranks):  # layer 0 is TP already, layer 1 still EP
        np.testing.assert_array_equal(raw_view(mem, arena, 0, TP, W13),
                                      tp_slice(full[0][W13], W13, r, 2))
        np.testing.assert_array_equal(raw_view(mem, arena, 1, EP, W13),
                                      ep_slice(full[1][W13], W13, r, 2))
    report = session.finish()
    assert report.outcome == Outcome.committed and flips == [TP] and not sw.in_progress
    assert not session.open and sw.last_report.outcome == Outcome.committed
    for seq_id, data in logical_kv(kv, sw.kv_tables, ranks).items():
        np.testing.assert_array_equal(data, before[seq_id])
    with sw.begin(EP) as back:
        assert back.advance(1) == [1]  # TP->EP moves the last layer first
        assert back.wait() == "ready" and back.cursor == 1  # blocks until the advance is done
        assert back.wait() == "ready" and back.poll() == "ready"  # nothing outstanding
    # Leaving the block aborted the open switch.
    assert sw.last_report.outcome == Outcome.rolled_back and sw.mode == TP and sw.cursor == 2
    assert sw.begin(TP).report.outcome == Outcome.already_there


@pytest.mark.parametrize("stage", [moebius.SwitchStage.weights, moebius.SwitchStage.kv])
def test_fault_rolls_back(rng, stage):
    arena, kv, full, ranks, state = deployment(rng)
    snapshot = [(np.from_dlpack(m.weight_view(arena, 0, EP, W13, raw=True)).copy()) for m in ranks]
    before = logical_kv(kv, state, ranks)
    flips = []
    sw = moebius.Switcher(arena, kv, moebius.HostTransport(ranks), state,
                          on_commit=flips.append)
    sw.inject_fault(stage, 1 if stage == moebius.SwitchStage.weights else 0)
    report = sw.switch_to(TP)
    assert report.outcome == Outcome.rolled_back and "injected_fault" in report.error
    assert sw.mode == EP and sw.cursor == 0 and flips == [] and sw.consistent
    assert sw.kv_tables == state
    for m, old in zip(ranks, snapshot):
        np.testing.assert_array_equal(raw_view(m, arena, 0, EP, W13), old)
    for seq_id, data in logical_kv(kv, sw.kv_tables, ranks).items():
        np.testing.assert_array_equal(data, before[seq_id])
    assert sw.switch_to(TP).outcome == Outcome.committed  # one-shot


def test_callback_failure_is_a_rolled_back_switch(rng):
    arena, kv, full, ranks, state = deployment(rng)

    def broken(cursor, state):
        raise ValueError("verify hook broke")

    sw = moebius.Switcher(arena, kv, moebius.HostTransport(ranks), state, verify=broken)
    report = sw.switch_to(TP)
    assert report.outcome == Outcome.rolled_back and "verify hook broke" in report.error
    assert sw.mode == EP


def test_policy_rules():
    config = moebius.interactive_config(256)
    assert (config.t_high, config.t_low) == (256, 205)
    policy = moebius.SwitchPolicy(config)
    decision = policy.step(300, TP, 0.0)
    assert decision and decision.do_switch and decision.target == EP
    assert decision.reason == moebius.DecisionReason.above_high
    assert "EP" in repr(decision)
    held = policy.step(10, EP, 1.0)  # cooldown (5 s) and window
    assert not held
    stats = policy.stats
    assert stats.steps == 2 and stats.switches == 1
    assert stats.by_reason[moebius.DecisionReason.above_high] == 1
    assert sum(stats.by_reason.values()) == 2 and set(stats.by_reason) == set(moebius.DecisionReason)
    with pytest.raises(moebius.Error) as e:
        policy.step(-1, EP, 2.0)
    assert e.value.code == "invalid_argument"

    # Blocked admission (requests wait with TP's pool full) enters EP under T_h only when asked.
    paper = moebius.SwitchPolicy(moebius.interactive_config(256))
    assert not paper.step(40, TP, 0.0, admission_blocked=True)
    ours_cfg = moebius.interactive_config(256)
    ours_cfg.enter_on_blocked_admission = True
    assert "EP on blocked admission" in repr(ours_cfg)
    ours = moebius.SwitchPolicy(ours_cfg)
    d = ours.step(40, TP, 0.0, admission_blocked=True)
    assert d and d.target == EP and d.reason == moebius.DecisionReason.admission_blocked
    assert ours.stats.by_reason[moebius.DecisionReason.admission_blocked] == 1

    # So does the caller's finding that EP is faster at the sustained load; with both signals
    # the reason names the pool first.
    assert not paper.step(40, TP, 1.0, sustained_gain=True)
    ours_cfg.enter_on_sustained_gain = True
    assert "EP on sustained gain" in repr(ours_cfg)
    for blocked, reason in ((False, moebius.DecisionReason.sustained_gain),
                            (True, moebius.DecisionReason.admission_blocked)):
        both = moebius.SwitchPolicy(ours_cfg)
        assert not both.step(40, TP, 0.0)
        d = both.step(40, TP, 1.0, admission_blocked=blocked, sustained_gain=True)
        assert d and d.target == EP and d.reason == reason


def test_policy_two_phases():
    """propose() runs the rules; the caller prices the proposal; decide() settles it: refused
    for capacity, refused by the gate, or switched (then the cooldown holds)."""
    R = moebius.DecisionReason
    policy = moebius.SwitchPolicy(moebius.rollout_config(256))
    p = policy.propose(100, EP, 0.0)
    assert p and p.proposed and p.target == TP and p.reason == R.below_low and p.load == 100
    with pytest.raises(moebius.Error, match="decide"):  # every propose() needs its decide()
        policy.propose(100, EP, 0.0)
    d = policy.decide(p, moebius.SwitchPricing(fits=False))
    assert not d and d.blocked and d.reason == R.capacity_refused and d.target == TP
    with pytest.raises(moebius.Error):  # decided already
        policy.decide(p)

    gate = moebius.GateEvaluation(evaluated=True, target=TP, load=100, gain_ms=10.0,
                                  cost_ms=20.0, passed=False)
    p = policy.propose(100, EP, 1.0)
    d = policy.decide(p, moebius.SwitchPricing(fits=True, gate=gate))
    assert not d and d.reason == R.cost_exceeds_gain

    passed = moebius.GateEvaluation(evaluated=True, target=TP, passed=True)
    p = policy.propose(100, EP, 2.0)
    d = policy.decide(p, moebius.SwitchPricing(gate=passed))
    assert d and d.do_switch and d.reason == R.below_low
    stats = policy.stats
    assert (stats.steps, stats.switches) == (3, 1)
    assert (stats.by_reason[R.capacity_refused], stats.by_reason[R.cost_exceeds_gain],
            stats.by_reason[R.below_low]) == (1, 1, 1)
    # A hold proposes nothing and is decided too (counted there).
    p = policy.propose(100, TP, 3.0)
    assert not p and p.reason == R.hold
    assert policy.decide(p).reason == R.hold and policy.stats.steps == 4


def test_residency_predictor():
    config = moebius.ResidencyConfig()
    assert (config.window_steps, config.horizon_steps) == (256, 4096)
    config.window_steps = 1
    p = moebius.ResidencyPredictor(config)
    p.observe(0, 1, 28, 0)  # one request that ran 28 steps
    p.observe(3, 0, 0, 128)  # 3 arrivals, 128 running: drift 3 - 128/28
    assert abs(p.drift - (3 - 128 / 28)) < 1e-12
    assert p.steps_until_cross(128, 100) == 19  # ceil(29 / 1.571)
    assert p.steps_until_cross(50, 100) == 4096  # falling load never climbs back: the horizon
    cfg = moebius.interactive_config(256)
    cfg.gate_margin = 0.5
    assert "gate margin 0.5" in repr(cfg)
    # The residency a gate weighs: the predictor up to the boundary of the rule that would
    # switch back (T_l after entering EP, T_h after entering TP), else the fixed expectation.
    assert moebius.residency_boundary(cfg, EP) == 205 and moebius.residency_boundary(cfg, TP) == 256
    low = moebius.interactive_config(125)  # T_h 125, T_l 100; the load falls 1.571 a step
    assert moebius.residency_steps(low, p, 128, EP) == 19  # under T_l: ceil(29 / 1.571)
    assert moebius.residency_steps(low, p, 128, TP) == 3  # under T_h: ceil(4 / 1.571)
    assert moebius.residency_steps(low, None, 128, EP) == 0  # no predictor: unknown, gate off
    low.expected_residency_steps = 70
    assert moebius.residency_steps(low, None, 128, TP) == 70
    cfg.gate_margin = -1.0
    with pytest.raises(moebius.Error) as e:
        cfg.validate()
    assert "gate_margin" in str(e.value)
    with pytest.raises(moebius.Error):
        p.observe(-1, 0, 0, 0)
