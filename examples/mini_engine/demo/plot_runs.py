#!/usr/bin/env python3
"""Draws the runs of one trace as moebius_demo wrote them: DIR/steps.csv and DIR/requests.csv
(one directory per trace under --out) into DIR/runs.png.

One panel per run, on one time axis: the running batch (sequences a step) as a line, the mode
as background bands (TP green, EP purple), each committed switch as a red line, and every
request's TTFT at its arrival as a dot on a log axis on the right; so a reader sees where each
layout wins, and what a switch cost the requests that waited for it.

Usage: plot_runs.py DIR [DIR ...]   (needs matplotlib; scripts/demo installs it, pinned, in a
venv). The data it draws is read by read_runs() and mode_spans(), which need no matplotlib.
"""

import csv
import os
import sys

TP_COLOR, EP_COLOR = "#dff3df", "#ece0f5"


def read_runs(directory):
    """{run name: {"steps": [...], "requests": [...]}} in the order the runs appear, each row a
    dict of floats (run, mode and config as text: the policy's mode and the configuration the
    step was priced as, e.g. EP and TEP-DCP2)."""
    runs = {}
    with open(os.path.join(directory, "steps.csv"), newline="") as f:
        for row in csv.DictReader(f):
            step = {k: (v if k in ("run", "mode", "config") else float(v)) for k, v in row.items()}
            runs.setdefault(row["run"], {"steps": [], "requests": []})["steps"].append(step)
    with open(os.path.join(directory, "requests.csv"), newline="") as f:
        for row in csv.DictReader(f):
            req = {k: (v if k == "run" else float(v)) for k, v in row.items()}
            runs.setdefault(row["run"], {"steps": [], "requests": []})["requests"].append(req)
    return runs


def mode_spans(steps):
    """[(start_s, end_s, mode)] for each stretch of steps in one mode; a stretch ends where the
    next begins (a switch between them counts to the earlier one), the last at its step's end."""
    spans = []
    for i, s in enumerate(steps):
        end = steps[i + 1]["start_s"] if i + 1 < len(steps) else s["start_s"] + s["step_ms"] * 1e-3
        if spans and spans[-1][2] == s["mode"]:
            spans[-1] = (spans[-1][0], end, s["mode"])
        else:
            spans.append((s["start_s"], end, s["mode"]))
    return spans


def switch_times(steps):
    """Start of every step that follows a committed stop-the-world switch (steps.csv: switched)."""
    return [s["start_s"] for s in steps if s["switched"] > 0]


def ttft_points(requests):
    """(arrival_s, ttft_s) of every request that got a first token."""
    return [(r["arrival_s"], r["first_token_s"] - r["arrival_s"])
            for r in requests if r["first_token_s"] >= 0]


def draw(directory, out_name="runs.png"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = read_runs(directory)
    if not runs:
        raise SystemExit(f"plot_runs: {directory} has no runs")
    end = max(max((s["start_s"] + s["step_ms"] * 1e-3 for s in r["steps"]), default=0)
              for r in runs.values())
    ttfts = [max(p[1], 1e-3) for r in runs.values() for p in ttft_points(r["requests"])]
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.6 * len(runs)), sharex=True,
                             squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], runs.items()):
        for t0, t1, mode in mode_spans(r["steps"]):
            ax.axvspan(t0, t1, color=TP_COLOR if mode == "TP" else EP_COLOR, lw=0)
        for t in switch_times(r["steps"]):
            ax.axvline(t, color="#d02020", lw=0.8)
        ax.plot([s["start_s"] for s in r["steps"]], [s["sequences"] for s in r["steps"]],
                color="#1f5fbf", lw=0.6)
        ax.set_ylabel("batch", color="#1f5fbf")
        ax.set_title(name, loc="left", fontsize=10)
        points = ttft_points(r["requests"])
        if points:
            right = ax.twinx()
            right.scatter([p[0] for p in points], [max(p[1], 1e-3) for p in points], s=1.5,
                          color="#e08020", alpha=0.5, lw=0)
            right.set_yscale("log")
            right.set_ylim(min(ttfts) / 1.2, max(ttfts) * 1.2)  # one scale for every run
            right.set_ylabel("TTFT (s)", color="#e08020")
    axes[-1, 0].set_xlim(0, end)
    axes[-1, 0].set_xlabel("serving clock (s): priced, not measured, on the simulated runtime")
    fig.suptitle(f"{os.path.basename(os.path.normpath(directory))}: batch (blue), TTFT at "
                 "arrival (orange), TP green / EP purple, switches red", fontsize=10)
    fig.tight_layout()
    path = os.path.join(directory, out_name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv):
    if len(argv) < 2:
        print("usage: plot_runs.py DIR [DIR ...]  (a trace's directory under moebius_demo --out)",
              file=sys.stderr)
        return 2
    for directory in argv[1:]:
        print(f"  wrote {draw(directory)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
