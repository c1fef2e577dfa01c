"""Every switch reported: the C++ observer forwards each ended switch to Python's logging
(level by outcome) and to the engine's listeners as a SwitchEvent, with the report switch_to
returned and its flat Prometheus-style metrics; progressive switches once each; a broken
listener never fails a switch nor silences the others."""

import logging

import pytest

import moebius
from test_switcher import deployment

EP, TP = moebius.Mode.EP, moebius.Mode.TP
Outcome = moebius.SwitchOutcome


@pytest.fixture
def events():
    seen = []
    listener = moebius.add_switch_listener(seen.append)
    yield seen
    moebius.remove_switch_listener(listener)


def switcher(rng):
    arena, kv, full, ranks, state = deployment(rng)
    return moebius.Switcher(arena, kv, moebius.HostTransport(ranks), state)



def test_each_switch_is_logged_and_heard_once(rng, events, caplog):
    sw = switcher(rng)
    caplog.set_level(logging.DEBUG, logger="moebius")
    committed = sw.switch_to(TP)
    there = sw.switch_to(TP)
    sw.inject_fault(moebius.SwitchStage.weights, 1, 0)
    rolled = sw.switch_to(EP)
    assert [committed.outcome, there.outcome, rolled.outcome] == \
        [Outcome.committed, Outcome.already_there, Outcome.rolled_back]
    assert [e.report for e in events] == [committed, there, rolled]
    assert [e.style for e in events] == [moebius.SwitchStyle.whole] * 3
    seq = [e.sequence for e in events]
    assert seq == list(range(seq[0], seq[0] + 3))

    records = [r for r in caplog.records if r.name == "moebius"]
    assert [r.levelno for r in records] == [logging.INFO, logging.DEBUG, logging.WARNING]
    for record, event in zip(records, events):
        assert record.moebius_switch.report == event.report
        assert record.getMessage() == moebius.format_switch_event(event)
    assert records[0].getMessage().startswith(f"switch #{seq[0]} EP->TP (whole): committed in ")
    assert "error: " in records[2].getMessage() and "injected" in records[2].getMessage()


def test_metrics_are_the_reports_numbers(rng, events):
    sw = switcher(rng)
    report = sw.switch_to(TP)
    m = events[-1].report.metrics
    assert m == report.metrics
    assert all(k.startswith("moebius_switch_") and isinstance(v, float) for k, v in m.items())
    assert m["moebius_switch_weights_bytes"] == sum(report.weight_bytes_sent) > 0
    assert m["moebius_switch_kv_bytes"] == sum(report.kv_bytes_sent)
    assert m["moebius_switch_total_ms"] == report.total_ms
    assert m["moebius_switch_weights_ms"] == report.weights_ms
    assert m["moebius_switch_kv_rounds"] == report.kv_rounds
    assert m["moebius_switch_kv_rounds_completed"] == report.kv_rounds_completed
    assert m["moebius_switch_weight_phases_completed"] == report.weight_phases_completed == 2
    assert m["moebius_switch_kv_pages_moved"] == report.kv_stats.pages_moved
    assert (m["moebius_switch_committed"], m["moebius_switch_rolled_back"],
            m["moebius_switch_inconsistent"], m["moebius_switch_refused_capacity"],
            m["moebius_switch_already_there"]) == (1.0, 0.0, 0.0, 0.0, 0.0)


def test_progressive_switches_reported_once_at_their_end(rng, events):
    sw = switcher(rng)
    with sw.begin(TP) as p:
        p.advance(1)
        assert events == []  # in flight: nothing yet
        done = p.finish()
    assert [e.report for e in events] == [done]
    assert events[0].style == moebius.SwitchStyle.progressive
    with sw.begin(EP) as p:
        p.advance(1)
    # Leaving the block aborted it: reported by the abort, once.
    assert len(events) == 2 and events[1].report.outcome == Outcome.rolled_back
    assert events[1].report == sw.last_report


def test_a_broken_listener_is_logged_and_the_switch_goes_on(rng, events, caplog):
    sw = switcher(rng)

    def broken(event):
        raise RuntimeError("exporter is down")

    moebius.add_switch_listener(broken)
    after = []
    moebius.add_switch_listener(after.append)
    try:
        with caplog.at_level(logging.ERROR, logger="moebius"):
            report = sw.switch_to(TP)
        assert report.outcome == Outcome.committed and sw.mode == TP
        assert len(events) == len(after) == 1  # listeners before and after it both heard it
        failures = [r for r in caplog.records if "listener" in r.getMessage()]
        assert len(failures) == 1 and "exporter is down" in failures[0].exc_text
    finally:
        moebius.remove_switch_listener(broken)
        moebius.remove_switch_listener(after.append)
    sw.switch_to(EP)
    assert len(events) == 2 and len(after) == 1
    with pytest.raises(ValueError):
        moebius.remove_switch_listener(broken)
