"""A KV migration on the CPU, checked byte for byte (per layer, K/V, token, head) against a
numpy gather of each sequence's KV through its page tables."""

import numpy as np
import pytest

import moebius
from conftest import host_memory

EP, TP = moebius.Mode.EP, moebius.Mode.TP


def random_ep_state(rng, geometry, occupancy):
    """EP tables: sequences of random length on random owners, pages drawn at random."""
    P, ps = geometry.num_ranks, geometry.page_size
    tables = [[] for _ in range(P)]
    seq_id = 0
    for r in range(P):
        free = list(rng.permutation(geometry.num_ep_pages))
        budget = int(geometry.num_ep_pages * occupancy)
        while budget > 0:
            pages = int(rng.integers(1, min(budget, 4) + 1))
            last = int(rng.integers(1, ps + 1))
            tables[r].append(moebius.KvSequence(
                seq_id=seq_id, num_tokens=(pages - 1) * ps + last, last_page_len=last,
                pages=[int(free.pop()) for _ in range(pages)], prefill_cursor=seq_id * 3))
            seq_id += 1
            budget -= pages
    return moebius.make_kv_state(geometry, EP, tables)


def gather(geometry, pool_view, seq, mode):
    """[tokens, L, K|V, heads, D] of one sequence from one rank's pool view."""
    ps = geometry.page_size
    tokens = np.arange(seq.num_tokens)
    pages = np.asarray(seq.pages)[tokens // ps]
    slots = tokens % ps
    if geometry.layout == moebius.KvLayout.HND:  # [L, T, page, head, slot, D]
        return pool_view[:, :, pages, :, slots, :]  # split advanced indices go first
    # NHD: [L, T, page, slot, head, D]; adjacent advanced indices stay in place
    return np.moveaxis(pool_view[:, :, pages, slots, :, :], 2, 0)


def logical_kv(geometry, state, pools):
    """Every live sequence's KV, {seq_id: [tokens, L, T, H_kv, D]}, assembled from the view of
    `state.mode` (TP: each head slice from the first rank that holds it)."""
    views = [np.from_dlpack(p.kv_pool_view(geometry, state.mode, raw=True)) for p in pools]
    kv = {}
    if state.mode == EP:
        for r, rank in enumerate(state.ranks):
            for seq in rank.sequences:
                kv[seq.seq_id] = gather(geometry, views[r], seq, EP)
        return kv
    heads_tp = geometry.heads_per_tp_page
    for r, rank in enumerate(state.ranks):
        first = geometry.tp_slice_of_rank(r)
        if r > 0 and geometry.tp_slice_of_rank(r - 1) == first:
            continue  # a replica: read the first one
        for seq in rank.sequences:
            part = gather(geometry, views[r], seq, TP)
            whole = kv.setdefault(seq.seq_id, [None] * geometry.tp_pages_per_ep_page)
            whole[first] = part
    return {s: np.concatenate(parts, axis=3) for s, parts in kv.items()}


@pytest.mark.parametrize("layout", [moebius.KvLayout.HND, moebius.KvLayout.NHD])
@pytest.mark.parametrize("heads,ranks", [(4, 2), (2, 4), (4, 4)])
def test_kv_migration_round_trip_matches_numpy_gather(rng, layout, heads, ranks):
    geometry = moebius.make_kv_geometry(num_layers=2, num_kv_heads=heads, head_dim=8,
                                        page_size=4, num_ep_pages=16, num_ranks=ranks,
                                        layout=layout)
    # TP holds min(1, H_kv/P) of what EP holds: stay well inside it.
    state = random_ep_state(rng, geometry, 0.4 * min(1.0, heads / ranks))
    pools = [moebius.RankMemory(host_memory(64), rng.integers(0, 256, geometry.pool_bytes,
                                                              dtype=np.uint8))
             for _ in range(ranks)]
    transport = moebius.HostTransport(pools)
    before = logical_kv(geometry, state, pools)
    assert before and all(v.shape[3] == heads for v in before.values())
    checksum = moebius.kv_checksum(geometry, state, pools)

    capacity = moebius.check_kv_capacity(geometry, state, TP)
    assert capacity.fits, capacity.reason
    to_tp = moebius.plan_kv_migration(geometry, state, TP)
    assert to_tp.copies.num_phases == to_tp.stats.rounds == capacity.rounds
    assert to_tp.stats.bytes_copied == to_tp.copies.traffic().total_bytes_sent + \
        sum(to_tp.copies.traffic().bytes_local)
    assert to_tp.copies.find_phase_hazard() == ""
    transport.execute(to_tp.copies)
    tp_state = to_tp.new_state
    assert tp_state.mode == TP
    tp_state.validate(geometry)
    assert moebius.kv_checksum(geometry, tp_state, pools) == checksum
    after = logical_kv(geometry, tp_state, pools)
    assert after.keys() == before.keys()
    for seq_id, kv in before.items():
        np.testing.assert_array_equal(after[seq_id], kv, err_msg=f"sequence {seq_id} in TP")
    # Every TP replica holds its slice too, and the chunked-prefill cursor travelled.
    views = [np.from_dlpack(p.kv_pool_view(geometry, TP, raw=True)) for p in pools]
    hp = geometry.heads_per_tp_page
    for r, rank in enumerate(tp_state.ranks):
        lo = geometry.tp_slice_of_rank(r) * hp
        for seq in rank.sequences:
            np.testing.assert_array_equal(gather(geometry, views[r], seq, TP),
                                          before[seq.seq_id][:, :, :, lo:lo + hp])
            assert seq.prefill_cursor == seq.seq_id * 3

    to_ep = moebius.plan_kv_migration(geometry, tp_state, EP)
    transport.execute(to_ep.copies)
    back = logical_kv(geometry, to_ep.new_state, pools)
    for seq_id, kv in before.items():
        np.testing.assert_array_equal(back[seq_id], kv, err_msg=f"sequence {seq_id} back in EP")
    assert moebius.kv_checksum(geometry, to_ep.new_state, pools) == checksum


def test_kv_geometry_and_views():
    g = moebius.make_kv_geometry(94, 4, 128, 16, 64, 8)
    assert g.ep_page_bytes == 16 * 4 * 128 * 2 and g.tp_pages_per_ep_page == 4
    assert g.pool_bytes == 188 * 64 * 16384
    assert [g.tp_slice_of_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert g.offset(EP, 1, moebius.KvTensor.V, 5, 2, 3, 0) == \
        3 * g.region_bytes + 5 * 16384 + (2 * 16 + 3) * 128 * 2
    small = moebius.make_kv_geometry(2, 4, 8, 4, 3, 2)
    mem = moebius.RankMemory(host_memory(64), host_memory(small.pool_bytes))
    ep = np.from_dlpack(mem.kv_pool_view(small, EP, raw=True))
    tp = np.from_dlpack(mem.kv_pool_view(small, TP, raw=True))
    assert ep.shape == (2, 2, 3, 4, 4, 8) and tp.shape == (2, 2, 6, 2, 4, 8)
    assert ep.ctypes.data == tp.ctypes.data == mem.kv_pool_ptr
    # HND: EP page p is TP pages p*split .. p*split+split-1 (same bytes).
    ep[1, 0, 2, 2:4] = 7
    assert (tp[1, 0, 2 * 2 + 1] == 7).all() and not (tp[1, 0, 2 * 2] == 7).any()


def test_placement_worked_example():
    demands = [moebius.KvDemand(seq_id=i, own_pages=n) for i, n in enumerate([6, 5, 4])]
    placed = moebius.place_longest_first(demands, [], [10, 10])
    assert placed.owner == [0, 1, 1] and placed.load == [6, 9] and placed.fits
    assert placed.imbalance == pytest.approx(1.2) and placed.split_groups == 0
    assert placed == moebius.KvPlacement(owner=[0, 1, 1], load=[6, 9], fits=True,
                                         imbalance=placed.imbalance)


@pytest.mark.parametrize("layout", [moebius.KvLayout.HND, moebius.KvLayout.NHD])
@pytest.mark.parametrize("heads,ranks,dcp", [(1, 2, 2), (2, 4, 2), (1, 4, 4), (1, 4, 2)])
def test_kv_migration_with_dcp_matches_numpy(rng, layout, heads, ranks, dcp):
    """TP without duplicated KV: with dcp, TP rank r holds head slice tp_slice_of_rank(r) of
    the logical pages i with i % dcp == r % dcp only (numpy gathers them here by that rule, not
    by the library's helpers); EP -> TP(dcp) -> EP gives back every byte."""
    base = moebius.make_kv_geometry(num_layers=2, num_kv_heads=heads, head_dim=8, page_size=4,
                                    num_ep_pages=16, num_ranks=ranks, layout=layout)
    geometry = moebius.with_dcp(base, dcp)
    assert geometry.dcp == dcp and base.dcp == 1 and geometry.tp_replica_sets == base.tp_replicas // dcp
    assert geometry.token_place(9) == ((9 // 4) % dcp, (9 // 4) // dcp, 1)
    with pytest.raises(moebius.Error) as e:
        moebius.with_dcp(base, 3)
    assert e.value.code == "invalid_argument" and "dcp" in str(e.value)
    # dcp = P / H_kv holds what EP holds (up to a page a sequence on DCP index 0).
    state = random_ep_state(rng, geometry, 0.5 if heads * dcp == ranks else 0.25)
    pools = [moebius.RankMemory(host_memory(64), rng.integers(0, 256, geometry.pool_bytes,
                                                              dtype=np.uint8))
             for _ in range(ranks)]
    before = logical_kv(geometry, state, pools)
    to_tp = moebius.plan_kv_migration(geometry, state, TP)
    moebius.HostTransport(pools).execute(to_tp.copies)
    views = [np.from_dlpack(p.kv_pool_view(geometry, TP, raw=True)) for p in pools]
    hp, ps = geometry.heads_per_tp_page, geometry.page_size
    for r, rank in enumerate(to_tp.new_state.ranks):
        lo = geometry.tp_slice_of_rank(r) * hp
        for seq in rank.sequences:
            want = before[seq.seq_id]
            logical = -(-seq.num_tokens // ps)
            mine = [i for i in range(logical) if i % dcp == r % dcp]
            assert len(seq.pages) == len(mine)
            for local, i in enumerate(mine):
                tokens = np.arange(i * ps, min((i + 1) * ps, seq.num_tokens))
                page = seq.pages[local]
                if layout == moebius.KvLayout.HND:  # [L, T, page, head, slot, D]
                    got = np.moveaxis(views[r][:, :, page, :, tokens % ps, :], 0, 0)
                else:  # [L, T, page, slot, head, D]
                    got = np.moveaxis(views[r][:, :, page, tokens % ps, :, :], 2, 0)
                np.testing.assert_array_equal(got, want[tokens][:, :, :, lo:lo + hp],
                                              err_msg=f"rank {r} seq {seq.seq_id} page {i}")
    back = moebius.plan_kv_migration(geometry, to_tp.new_state, EP)
    moebius.HostTransport(pools).execute(back.copies)
    after = logical_kv(geometry, back.new_state, pools)
    for seq_id, kv in before.items():
        np.testing.assert_array_equal(after[seq_id], kv)


@pytest.mark.parametrize("layout", [moebius.KvLayout.HND, moebius.KvLayout.NHD])
@pytest.mark.parametrize("heads,ranks,a,b", [(1, 2, 2, 1), (1, 2, 1, 2), (1, 4, 4, 2),
                                             (1, 4, 1, 4), (0, 6, 2, 3), (0, 6, 3, 2)])
def test_kv_dcp_change_matches_numpy(rng, layout, heads, ranks, a, b):
    """TP(dcp a) -> TP(dcp b) (plan_kv_dcp_change): afterwards TP rank r holds, of each
    sequence, the logical pages i with i % b == r % b, each the KV the sequence had (numpy
    gathers it by that rule); dcp 1 -> 2 copies nothing; a dcp the geometry refuses is named.
    Then a Switcher changes the dcp alone (plan_dcp / switch_dcp)."""
    base = moebius.make_kv_geometry(num_layers=2, num_kv_heads=heads, head_dim=8, page_size=4,
                                    num_ep_pages=16, num_ranks=ranks, layout=layout)
    ga, gb = moebius.with_dcp(base, a), moebius.with_dcp(base, b)
    state = random_ep_state(rng, ga, 0.6 * min(a, b) / base.tp_replicas)
    kv_bytes = [rng.integers(0, 256, base.pool_bytes, dtype=np.uint8) for _ in range(ranks)]
    pools = [moebius.RankMemory(host_memory(64), kv) for kv in kv_bytes]
    before = logical_kv(base, state, pools)
    tp = moebius.plan_kv_migration(ga, state, TP)
    moebius.HostTransport(pools).execute(tp.copies)
    with pytest.raises(moebius.Error) as e:
        moebius.plan_kv_dcp_change(ga, tp.new_state, 5)
    assert e.value.code == "invalid_argument" and "dcp=5" in str(e.value)
    change = moebius.plan_kv_dcp_change(ga, tp.new_state, b)
    assert change.stats.rounds <= 2 and change.stats.pages_staged == 0
    if b % a == 0:  # every page a rank holds at b it held at a: nothing to copy
        assert change.copies.num_ops() == 0 and change.stats.bytes_copied == 0
    moebius.HostTransport(pools).execute(change.copies)
    change.new_state.validate(gb)
    views = [np.from_dlpack(p.kv_pool_view(gb, TP, raw=True)) for p in pools]
    hp, ps = gb.heads_per_tp_page, gb.page_size
    for r, rank in enumerate(change.new_state.ranks):
        lo = gb.tp_slice_of_rank(r) * hp
        for seq in rank.sequences:
            mine = [i for i in range(-(-seq.num_tokens // ps)) if i % b == r % b]
            assert len(seq.pages) == len(mine)
            for local, i in enumerate(mine):
                tokens = np.arange(i * ps, min((i + 1) * ps, seq.num_tokens))
                page = seq.pages[local]
                if layout == moebius.KvLayout.HND:  # [L, T, page, head, slot, D]
                    got = views[r][:, :, page, :, tokens % ps, :]
                else:  # [L, T, page, slot, head, D]
                    got = np.moveaxis(views[r][:, :, page, tokens % ps, :, :], 2, 0)
                want = before[seq.seq_id][tokens][:, :, :, lo:lo + hp]
                np.testing.assert_array_equal(got, want,
                                              err_msg=f"rank {r} seq {seq.seq_id} page {i}")

    # The switcher: TP attention with EP experts at dcp b, back to dcp a, the KV alone.
    shape = moebius.ExpertShape(num_layers=2, num_experts=ranks, hidden=32,
                                intermediate=2 * ranks)
    arena = moebius.make_arena_geometry(shape, ranks, 256, 4096)
    mems = [moebius.RankMemory(host_memory(arena.total_bytes), kv) for kv in kv_bytes]
    sw = moebius.Switcher(arena, gb, moebius.HostTransport(mems), change.new_state, 0)
    assert sw.dcp == b and sw.layout == moebius.ParallelLayout(TP, EP)
    plan = sw.plan_dcp(a)
    assert plan.from_dcp == b and plan.to_dcp == a and plan.changes_dcp
    assert not plan.moves_experts and plan.layer_kv is None
    with pytest.raises(moebius.Error) as e:
        sw.begin(plan)
    assert "stop-the-world" in str(e.value)
    expected = moebius.plan_kv_dcp_change(gb, change.new_state, a).stats.bytes_copied
    report = sw.switch_to(plan)
    assert report.outcome == moebius.SwitchOutcome.committed, report.error
    assert report.from_dcp == b and report.to_dcp == a and sw.dcp == a
    assert "(dcp %d->%d)" % (b, a) in str(report)
    assert sum(report.kv_bytes_sent) == expected
    # Back to EP at dcp a: every sequence's KV as it was.
    ep = moebius.plan_kv_migration(ga, sw.kv_tables, EP)
    moebius.HostTransport(mems).execute(ep.copies)
    after = logical_kv(base, ep.new_state, mems)
    for seq_id, kv in before.items():
        np.testing.assert_array_equal(after[seq_id], kv)
