"""Page tables as CSR arrays (FlashInfer's indptr / indices / last_page_len, a KvCsr): out of
random EP and TP states, checked against the same tables walked as KvSequence lists; back in
through make_kv_state_from_csr (equal states); written in place into the caller's buffers (only the
prefix written, poison beyond); strided and read-only inputs read without a copy; every bad
input named."""

import numpy as np
import pytest

import moebius
from test_kv import random_ep_state

EP, TP = moebius.Mode.EP, moebius.Mode.TP
POISON = -7


def reference_csr(rank_state, order=None):
    """CSR of one rank built from its KvSequence objects, independently of the binding."""
    seqs = {s.seq_id: s for s in rank_state.sequences}
    ids = list(seqs) if order is None else list(order)
    indptr, indices, last = [0], [], []
    for i in ids:
        indices += list(seqs[i].pages)
        indptr.append(len(indices))
        last.append(seqs[i].last_page_len)
    return {"seq_ids": ids, "indptr": indptr, "indices": indices, "last_page_len": last}


def random_geometry(rng):
    ranks = int(rng.choice([1, 2, 4]))
    heads = ranks * int(rng.integers(1, 3))
    return moebius.make_kv_geometry(num_layers=2, num_kv_heads=heads, head_dim=8,
                                    page_size=int(rng.integers(1, 9)),
                                    num_ep_pages=int(rng.integers(8, 40)), num_ranks=ranks)


def tp_state_of(geometry, ep_state):
    return moebius.plan_kv_migration(geometry, ep_state, TP).new_state


@pytest.mark.parametrize("dtype", ["int32", "int64", np.int32, np.dtype("int64")])
@pytest.mark.parametrize("trial", range(4))
def test_csr_matches_sequence_lists(rng, dtype, trial):
    g = random_geometry(rng)
    ep = random_ep_state(rng, g, 0.5)
    bits = 64 if "64" in str(dtype) else 32
    for state in (ep, tp_state_of(g, ep)):
        for r, rank in enumerate(state.ranks):
            want = reference_csr(rank)
            for got in (state.csr(r, dtype), rank.csr(dtype)):
                assert got.shared_prefix_pages is None and got.prefill_cursor is None
                for key, value in want.items():
                    array = getattr(got, key)
                    assert array.dtype == np.dtype(f"int{bits}"), key
                    assert array.ndim == 1 and array.flags.c_contiguous
                    np.testing.assert_array_equal(array, np.asarray(value, np.int64),
                                                  err_msg=f"{state.mode} rank {r} {key}")


def test_csr_rows_in_the_callers_batch_order(rng):
    g = moebius.make_kv_geometry(2, 4, 8, 4, 32, 2)
    state = random_ep_state(rng, g, 0.6)
    for r, rank in enumerate(state.ranks):
        ids = np.array([s.seq_id for s in rank.sequences])
        order = rng.permutation(ids)[: max(1, len(ids) - 1)]  # a subset, shuffled
        got = state.csr(r, "int64", seq_ids=order)
        want = reference_csr(rank, order.tolist())
        for key, value in want.items():
            np.testing.assert_array_equal(getattr(got, key), value, err_msg=key)
        with pytest.raises(moebius.Error, match="is not a sequence of this rank") as e:
            state.csr(r, seq_ids=np.array([ids.max() + 1000]))
        assert e.value.code == "invalid_argument"


@pytest.mark.parametrize("trial", range(3))
def test_csr_round_trip_through_make_kv_state_from_csr(rng, trial):
    g = random_geometry(rng)
    ep = random_ep_state(rng, g, 0.5)
    for state in (ep, tp_state_of(g, ep)):
        # Give some sequences prefill cursors; one dtype per rank, mixed.
        tables = []
        for r in range(g.num_ranks):
            t = state.csr(r, "int32" if r % 2 else "int64")
            t.prefill_cursor = np.array([s.prefill_cursor for s in state.ranks[r].sequences])
            tables.append(t)
        back = moebius.make_kv_state_from_csr(g, state.mode, tables)
        assert back == state


def test_csr_in_place_into_callers_buffers(rng):
    g = moebius.make_kv_geometry(2, 4, 8, 4, 32, 2)
    state = random_ep_state(rng, g, 0.5)
    for r, rank in enumerate(state.ranks):
        want = reference_csr(rank)
        rows, nnz = len(want["seq_ids"]), len(want["indices"])  # the reference (a plain dict)
        # Buffers larger than needed, of different dtypes, poisoned: only the prefix changes.
        indptr = np.full(rows + 5, POISON, np.int32)
        indices = np.full(nnz + 3, POISON, np.int64)
        last = np.full(rows + 2, POISON, np.int32)
        ids = np.full(rows + 1, POISON, np.int64)
        addresses = [a.ctypes.data for a in (indptr, indices, last, ids)]
        assert state.csr_into(r, indptr, indices, last, out_seq_ids=ids) == (rows, nnz)
        assert [a.ctypes.data for a in (indptr, indices, last, ids)] == addresses
        for buf, key, n in ((indptr, "indptr", rows + 1), (indices, "indices", nnz),
                            (last, "last_page_len", rows), (ids, "seq_ids", rows)):
            np.testing.assert_array_equal(buf[:n], want[key], err_msg=key)
            assert (buf[n:] == POISON).all(), f"{key} written past its prefix"
        # A strided, writable destination (every other element) is written through its stride.
        wide = np.full(2 * (rows + 1), POISON, np.int64)
        state.csr_into(r, wide[::2], indices, last)
        np.testing.assert_array_equal(wide[::2], want["indptr"])
        assert (wide[1::2] == POISON).all()
        # Too small: refused before anything is written.
        small = np.full(rows, POISON, np.int32)
        with pytest.raises(moebius.Error, match="enlarge the buffers") as e:
            state.csr_into(r, small, indices, last)
        assert e.value.code == "out_of_range" and (small == POISON).all()
        # Read-only destinations are refused.
        frozen = np.zeros(rows + 1, np.int32)
        frozen.flags.writeable = False
        with pytest.raises(moebius.Error, match="writable"):
            state.csr_into(r, frozen, indices, last)


def test_csr_inputs_read_in_place_strided_and_read_only():
    g = moebius.make_kv_geometry(2, 4, 8, 16, 16, 2)
    # seq 4: pages {7, 2}, 20 tokens; seq 9: pages {5}, 3 tokens (bind_kv_csr.cpp's example).
    seq_ids = np.array([4, 0, 9, 0], np.int64)[::2]
    indptr = np.array([0, 2, 3], np.int32)
    indices = np.array([7, 2, 5], np.int32)
    indices.flags.writeable = False
    last = np.array([4, 3], np.int64)
    s = moebius.make_kv_state_from_csr(
        g, EP, [moebius.KvCsr(seq_ids=seq_ids, indptr=indptr, indices=indices,
                              last_page_len=last),
                moebius.KvCsr(seq_ids=np.zeros(0, np.int32), indptr=np.zeros(1, np.int32),
                              indices=np.zeros(0, np.int32),
                              last_page_len=np.zeros(0, np.int32))])
    seqs = s.ranks[0].sequences
    assert [(q.seq_id, q.pages, q.num_tokens, q.last_page_len) for q in seqs] == \
        [(4, [7, 2], 20, 4), (9, [5], 3, 3)]
    assert s.ranks[0].free_pages == [p for p in range(16) if p not in (7, 2, 5)]
    assert s.ranks[1].sequences == [] and s.ranks[1].free_pages == list(range(16))


@pytest.mark.parametrize("bad,match", [
    (dict(indptr=np.array([0, 2, 3], np.float32)), "int32 or int64"),
    (dict(indptr=np.array([[0, 2, 3]], np.int32)), "1-D"),
    (dict(indptr=[0, 2, 3]), "__dlpack__"),
    (dict(indptr=np.array([0, 2], np.int32)), "n \\+ 1"),
    (dict(indptr=np.array([1, 2, 3], np.int32)), "start at 0 and end at len"),
    (dict(indptr=np.array([0, 2, 2], np.int32)), "start at 0 and end at len"),
    (dict(indptr=np.array([0, 4, 3], np.int32), indices=np.array([7, 2, 5], np.int32)),
     "must not decrease"),
    # a row running far past indices: refused before any row is read or sized from it
    (dict(indptr=np.array([0, 2**40, 3], np.int64)), "must not decrease"),
    (dict(last_page_len=np.array([4, 17], np.int32)), "last_page_len=17"),
    (dict(indices=np.array([7, 2, 16], np.int32)), "id 16 outside"),
    (dict(indices=np.array([7, 2, 7], np.int32)), "page 7 is used twice"),
])
def test_csr_bad_inputs_are_named(bad, match):
    g = moebius.make_kv_geometry(2, 4, 8, 16, 16, 1)
    t = dict(seq_ids=np.array([4, 9]), indptr=np.array([0, 2, 3], np.int32),
             indices=np.array([7, 2, 5], np.int32), last_page_len=np.array([4, 3], np.int32))
    t.update(bad)
    with pytest.raises(moebius.Error, match=match) as e:
        moebius.make_kv_state_from_csr(g, EP, [moebius.KvCsr(**t)])
    assert e.value.code == "invalid_argument"


def test_csr_missing_array_and_int32_overflow():
    g = moebius.make_kv_geometry(2, 4, 8, 16, 16, 1)
    with pytest.raises(TypeError, match="last_page_len"):
        moebius.KvCsr(seq_ids=np.array([1]), indptr=np.array([0, 1]), indices=np.array([0]))
    with pytest.raises(TypeError):  # the four arrays are required, None is none of them
        moebius.KvCsr(seq_ids=np.array([1]), indptr=np.array([0, 1]), indices=np.array([0]),
                      last_page_len=None)
    t = moebius.KvCsr(seq_ids=np.array([1]), indptr=np.array([0, 1]), indices=np.array([0]),
                      last_page_len=[1])
    with pytest.raises(moebius.Error, match="last_page_len must be a 1-D"):
        moebius.make_kv_state_from_csr(g, EP, [t])
    with pytest.raises(TypeError):  # a dict is not a KvCsr
        moebius.make_kv_state_from_csr(g, EP, [dict(seq_ids=np.array([1]))])
    big = 2**31 + 5  # a seq id past int32: int64 works, int32 says so
    s = moebius.make_kv_state(g, EP, [[moebius.KvSequence(seq_id=big, num_tokens=1,
                                                          last_page_len=1, pages=[3])]])
    assert s.csr(0, "int64").seq_ids.tolist() == [big]
    with pytest.raises(moebius.Error, match="does not fit int32") as e:
        s.csr(0)
    assert e.value.code == "overflow"
    with pytest.raises(moebius.Error, match="int32 or int64"):
        s.csr(0, "uint8")


def test_switcher_tables_as_csr(rng):
    shape = moebius.ExpertShape(num_layers=2, num_experts=4, hidden=16, intermediate=8)
    arena = moebius.make_arena_geometry(shape, 2)
    g = moebius.make_kv_geometry(2, 2, 8, 4, 16, 2)
    state = random_ep_state(rng, g, 0.3)
    ranks = [moebius.RankMemory(np.zeros(arena.total_bytes, np.uint8),
                                np.zeros(g.pool_bytes, np.uint8)) for _ in range(2)]
    sw = moebius.Switcher(arena, g, moebius.HostTransport(ranks), state)
    for r in range(2):
        np.testing.assert_array_equal(sw.kv_csr(r).indices, state.csr(r).indices)
    assert sw.switch_to(TP).outcome == moebius.SwitchOutcome.committed
    tp = sw.kv_tables
    for r in range(2):
        want = reference_csr(tp.ranks[r])
        got = sw.kv_csr(r, "int64")
        for key, value in want.items():
            np.testing.assert_array_equal(getattr(got, key), value, err_msg=key)
        buf = [np.zeros(64, np.int32) for _ in range(3)]
        assert sw.kv_csr_into(r, *buf) == (len(want["seq_ids"]), len(want["indices"]))
        np.testing.assert_array_equal(buf[1][:len(want["indices"])], want["indices"])
    with sw.begin(EP) as p:
        for mode in (EP, TP):
            np.testing.assert_array_equal(p.kv_csr(mode, 0).indices,
                                          p.tables(mode).csr(0).indices)
