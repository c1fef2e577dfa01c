"""plot_runs.py: the data it draws, against values worked by hand, and a figure written."""

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import plot_runs  # noqa: E402

STEPS_HEADER = ("run,step,start_s,mode,sequences,decode_tokens,prefill_tokens,context_tokens,"
                "running,waiting,stalled,preempted,kv_used_pages,step_ms,measured_ms,switched,"
                "switch_ms,config,decodes_held\n")
REQUESTS_HEADER = ("run,id,arrival_s,admitted_s,first_token_s,finish_s,prompt_tokens,"
                   "output_tokens,preemptions,failed\n")


def write_trace_dir(tmp_path, steps, requests):
    (tmp_path / "steps.csv").write_text(STEPS_HEADER + "".join(steps))
    (tmp_path / "requests.csv").write_text(REQUESTS_HEADER + "".join(requests))
    return str(tmp_path)


def step_line(run, k, start, mode, seqs, ms, switched=0, config=None):
    return (f"{run},{k},{start:.6f},{mode},{seqs},{seqs},0,{seqs},{seqs},0,0,0,1,{ms:.4f},0.1,"
            f"{switched},0,{config or mode},0\n")


def test_spans_switches_and_ttft_worked_by_hand(tmp_path):
    # static: TP, TP (0.0, 0.1); switching: TP, then a switch, EP, EP, then TP.
    d = write_trace_dir(tmp_path, [
        step_line("static", 0, 0.0, "TP", 2, 50),
        step_line("static", 1, 0.05, "TP", 2, 50),
        step_line("switching", 0, 0.0, "TP", 3, 40),
        step_line("switching", 1, 0.2, "EP", 5, 30, switched=1),
        step_line("switching", 2, 0.23, "EP", 5, 30, config="TEP-DCP2"),
        step_line("switching", 3, 0.4, "TP", 1, 20, switched=1),
    ], [
        "static,0,0.000000,0.000000,0.050000,0.100000,4,2,0,0\n",
        "switching,0,0.010000,0.010000,0.240000,0.420000,4,3,1,0\n",
        "switching,1,0.020000,-1.000000,-1.000000,-1.000000,4,3,0,1\n",
    ])
    runs = plot_runs.read_runs(d)
    assert list(runs) == ["static", "switching"]
    assert plot_runs.mode_spans(runs["static"]["steps"]) == [(0.0, pytest.approx(0.1), "TP")]
    assert plot_runs.mode_spans(runs["switching"]["steps"]) == [
        (0.0, 0.2, "TP"), (0.2, 0.4, "EP"), (0.4, pytest.approx(0.42), "TP")]
    assert plot_runs.switch_times(runs["switching"]["steps"]) == [0.2, 0.4]
    assert runs["switching"]["steps"][2]["config"] == "TEP-DCP2"  # text, as the mode
    # The failed request has no first token: no point.
    assert plot_runs.ttft_points(runs["switching"]["requests"]) == [(0.01, pytest.approx(0.23))]


def test_random_runs_spans_cover_the_run(tmp_path):
    rng = random.Random(os.environ.get("MOEBIUS_TEST_SEED", random.randrange(1 << 30)))
    steps, t = [], 0.0
    modes = []
    for k in range(rng.randrange(1, 300)):
        mode = rng.choice(["TP", "EP"]) if k == 0 or rng.random() < 0.05 else modes[-1]
        modes.append(mode)
        ms = rng.uniform(1, 100)
        steps.append(step_line("r", k, t, mode, rng.randrange(1, 2048), ms))
        t += ms * 1e-3 + (rng.uniform(0, 0.2) if rng.random() < 0.02 else 0)
    d = write_trace_dir(tmp_path, steps, [])
    spans = plot_runs.mode_spans(plot_runs.read_runs(d)["r"]["steps"])
    # Adjacent, alternating, from the first step's start to the last step's end.
    assert spans[0][0] == 0.0
    assert spans[-1][1] == pytest.approx(t, abs=0.2)
    for a, b in zip(spans, spans[1:]):
        assert a[1] == b[0] and a[2] != b[2]
    changes = sum(1 for a, b in zip(modes, modes[1:]) if a != b)
    assert len(spans) == changes + 1


def test_draws_a_png(tmp_path):
    d = write_trace_dir(tmp_path, [
        step_line("static", 0, 0.0, "TP", 2, 50),
        step_line("switching", 0, 0.0, "EP", 3, 40),
    ], ["static,0,0.000000,0.000000,0.050000,0.100000,4,2,0,0\n"])
    path = plot_runs.draw(d)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10000
