"""moebius.distributed's agreement step on the CPU (no torch): every rank learns whether every
rank got through a setup step, and raises when any failed, naming the ranks."""

import pytest

from moebius import distributed as md


def gather_of(errors):
    """A fake all_gather over ranks whose own errors are `errors`: each call returns them all,
    and records what this rank sent."""
    sent = []

    def all_gather(local):
        sent.append(local)
        return list(errors)
    return all_gather, sent


def test_every_rank_through():
    all_gather, sent = gather_of(["", "", ""])
    md._agree(all_gather, "", "setup")  # no raise
    assert sent == [""]


def test_a_failed_peer_is_named_on_a_rank_that_got_through():
    all_gather, sent = gather_of(["", "cudaMalloc: out of memory", "", "host memory"])
    with pytest.raises(RuntimeError) as e:
        md._agree(all_gather, "", "nccl_transport (the workspace)")
    msg = str(e.value)
    assert "nccl_transport (the workspace) failed on rank(s) 1: cudaMalloc: out of memory; 3: host memory" in msg
    assert "0:" not in msg and "2:" not in msg
    assert sent == [""]


def test_the_failed_rank_sends_its_error_and_raises_too():
    all_gather, sent = gather_of(["boom", ""])
    with pytest.raises(RuntimeError, match="rank\\(s\\) 0: boom"):
        md._agree(all_gather, "boom", "setup")
    assert sent == ["boom"]
