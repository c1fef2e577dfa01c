"""Every error class of the C++ library arrives as moebius.Error with the right .code."""

import contextlib

import numpy as np
import pytest

import moebius
from conftest import host_memory

EP, TP = moebius.Mode.EP, moebius.Mode.TP


def small_geometry():
    shape = moebius.ExpertShape(num_layers=2, num_experts=4, hidden=32, intermediate=16)
    return moebius.make_arena_geometry(shape, 2, 256, 4096)


@contextlib.contextmanager
def raises(code):
    """pytest.raises(moebius.Error) that also checks the error's code."""
    with pytest.raises(moebius.Error) as info:
        yield info
    assert info.value.code == code, str(info.value)


def test_error_type():
    assert issubclass(moebius.Error, RuntimeError)
    with raises("invalid_argument") as e:
        moebius.make_arena_geometry(
            moebius.ExpertShape(num_layers=2, num_experts=3, hidden=64, intermediate=32), 2)
    err = e.value
    assert "P must divide" in err.message or "must divide" in err.message
    assert err.message == str(err) and err.file.endswith(".cpp") and err.line > 0


def test_invalid_argument():
    with raises("invalid_argument"):
        moebius.make_kv_geometry(2, 3, 8, 4, 8, 2)  # P=2 does not divide H_kv=3
    with raises("invalid_argument"):
        moebius.interactive_config(0).validate()
    with raises("invalid_argument"):
        moebius.plan_weight_switch(small_geometry(), 0, 3)  # cursor beyond L=2
    with raises("invalid_argument"):  # memory that is not a byte range
        moebius.RankMemory([1, 2, 3])
    with raises("invalid_argument"):  # non-contiguous memory
        moebius.RankMemory(np.zeros((4, 4), np.uint8)[:, ::2])
    arena = host_memory(4096)
    with raises("invalid_argument"):  # two ranks over the same bytes
        moebius.HostTransport([moebius.RankMemory(arena), moebius.RankMemory(arena)])


def test_overflow():
    shape = moebius.ExpertShape(num_layers=1, num_experts=2, hidden=2**40, intermediate=2**40)
    with raises("overflow"):
        shape.validate(2)


def test_out_of_range():
    g = small_geometry()
    ranks = [moebius.RankMemory(host_memory(g.total_bytes)) for _ in range(2)]
    transport = moebius.HostTransport(ranks)
    bad = moebius.Plan(num_ranks=2, phases=[moebius.PlanPhase("too far", [
        moebius.CopyOp(src_rank=0, src_offset=g.total_bytes - 8, dst_rank=1, row_bytes=16)])])
    with raises("out_of_range"):
        transport.execute(bad)
    with raises("out_of_range"):
        ranks[0].weight_view(g, 2, EP)


def test_capacity():
    # H_kv=2 on P=4: every head lives on 2 TP ranks, so TP holds at most half of EP.
    g = moebius.make_kv_geometry(1, 2, 8, 4, 8, 4)
    tables = [[moebius.KvSequence(seq_id=10 * r + i, num_tokens=4, last_page_len=4, pages=[i])
               for i in range(6)] for r in range(4)]
    state = moebius.make_kv_state(g, EP, tables)
    report = moebius.check_kv_capacity(g, state, TP)
    assert not report.fits and not report.holds and report.reason
    assert report.pages_needed > report.pages_available and "KvCapacityReport(fits=False" in repr(report)
    with raises("capacity"):
        moebius.plan_kv_migration(g, state, TP)


def test_injected_fault():
    g = small_geometry()
    transport = moebius.HostTransport([moebius.RankMemory(host_memory(g.total_bytes))
                                       for _ in range(2)])
    transport.inject_fault(1)
    with raises("injected_fault"):
        transport.execute(moebius.plan_weight_switch(g, 0, 2))
    assert transport.completed_phases() == 1
    transport.execute(moebius.plan_weight_switch(g, 1, 2))  # one-shot: the next plan runs


@pytest.mark.parametrize("code", ["invalid_argument", "overflow", "out_of_range", "capacity",
                                  "cuda", "nccl", "timeout", "injected_fault", "internal"])
def test_every_code_translates(code):
    assert code in moebius.error_codes
    with raises(code) as e:
        moebius._moebius._raise_error(code, "from the test")
    assert f"moebius {code}: from the test" in str(e.value)


@pytest.mark.skipif(not moebius.with_nccl, reason="moebius was built without NCCL")
def test_nccl_workspace_sizes_without_a_gpu():
    """NcclTransport.workspace_bytes and moebius.distributed's sizing need no device
    (nccl_transport.hpp's worked example: E=4, H=8, I=4, P=2, one bf16 layer: 512 B)."""
    import moebius.distributed as md
    shape = moebius.ExpertShape(num_layers=1, num_experts=4, hidden=8, intermediate=4)
    arena = moebius.make_arena_geometry(shape, 2)
    plan = moebius.plan_weight_switch(arena, 0, 1)
    assert moebius.NcclTransport.workspace_bytes(plan, 0) == 512
    kv = moebius.make_kv_geometry(1, 2, 8, 4, 4, 2)
    assert md.nccl_workspace_bytes(arena, rank=0) >= 512
    assert md.nccl_workspace_bytes(arena, kv) == md.nccl_workspace_bytes(arena) + kv.pool_bytes
    assert md.nccl_workspace_bytes(arena, kv, kv_bytes=0) == md.nccl_workspace_bytes(arena)
    with pytest.raises(moebius.Error, match="unique id has 3 bytes"):
        moebius.NcclCommunicator(b"abc", 0, 1, 0)
    with pytest.raises(moebius.Error, match="outside"):
        moebius.NcclCommunicator(bytes(moebius.nccl_unique_id_bytes), 2, 2, 0)
