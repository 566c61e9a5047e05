"""Seeing the pipeline: ``pipeline/`` metrics in a CSVLogger's file (pp=2 with every schedule, tp=2 x pp=2), the
measured bubble against the simulator on stages of controlled cost, PipelineTimeline's files, and the hang report
of a rank blocked in a gloo receive (on SIGUSR1, and when the failure watch stops it).

Two runs: 2 ranks (five schedules, then the hang and the stop, which ends the processes) and 4 ranks (tp2 x pp2)."""

from __future__ import annotations

import csv
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from launch import ROOT, RunResult, run_ranks

SCRIPT = ROOT / "tests" / "distributed" / "worker_pipeline_metrics.py"
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zb-drain", "zb-lead")
STEPS = 4
KEYS = {"pipeline/bubble", "pipeline/bubble_theory", "pipeline/imbalance", "pipeline/step_time",
        "pipeline/samples_per_sec", *(f"pipeline/pp{r}/{k}" for r in (0, 1) for k in ("compute", "send", "recv",
                                                                                       "wait"))}


@pytest.fixture(scope="module")
def schedules_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RunResult]:
    out = tmp_path_factory.mktemp("pipeline_metrics")
    result = run_ranks(SCRIPT, 2, ["schedules", str(out), "--steps", str(STEPS), "--faults"], timeout=240,
                       env={"TPP_PID0": str(out / "pid0")})
    assert not result.timed_out, result.outputs[0][-3000:]
    assert "injected failure before a send" in result.outputs[1], result.outputs[1][-3000:]  # the last scenario
    return out, result


@pytest.fixture(scope="module")
def tp2pp2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pipeline_metrics_tp2pp2")
    run_ranks(SCRIPT, 4, ["tp2pp2", str(out), "--steps", str(STEPS)], timeout=240).check()
    return out


def _rows(path: Path) -> list[dict[str, float]]:
    with open(path / "version_0" / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]
    return [r for r in rows if "pipeline/bubble" in r]


def _check_metrics(rows: list[dict[str, float]], *, one_pipeline: bool = True) -> None:
    assert [int(r["step"]) for r in rows] == list(range(STEPS))  # every step (log_every_n_steps=1)
    for r in rows:
        assert KEYS <= set(r), KEYS - set(r)
        assert 0.0 < r["pipeline/bubble"] < 1.0 and r["pipeline/imbalance"] >= 1.0
        assert r["pipeline/samples_per_sec"] > 0 and r["train_loss"] >= 0  # the user's value in the same row
        t = r["pipeline/step_time"]
        parts = {p: {k: r[f"pipeline/pp{p}/{k}"] for k in ("compute", "send", "recv", "wait")} for p in (0, 1)}
        for p in (0, 1):
            assert min(parts[p].values()) >= 0 and sum(parts[p].values()) == pytest.approx(t, rel=1e-3)
        computes = [parts[p]["compute"] for p in (0, 1)]
        assert r["pipeline/imbalance"] == pytest.approx(max(computes) / statistics.mean(computes), rel=1e-4)
        if one_pipeline:  # the bubble: each rank's idle time (receiving, or waiting for the longest rank) / the step
            idle = statistics.mean((parts[p]["recv"] + parts[p]["wait"]) / t for p in (0, 1))
            assert r["pipeline/bubble"] == pytest.approx(idle, rel=1e-4, abs=1e-6), (r, idle)


def test_metrics_in_csv_pp2_every_schedule(schedules_run) -> None:
    out, _ = schedules_run
    for schedule in SCHEDULES:
        _check_metrics(_rows(out / schedule))


def test_metrics_in_csv_tp2pp2(tp2pp2_run: Path) -> None:
    rows = _rows(tp2pp2_run / "tp2pp2")
    _check_metrics(rows, one_pipeline=False)  # two pipelines (tp): the bubble is a mean over their ranks' steps
    assert all(r["pipeline/tokens_per_sec"] == pytest.approx(r["pipeline/samples_per_sec"] * 16) for r in rows)
    tracks = _spans(json.loads((tp2pp2_run / "tp2pp2" / "timeline.json").read_text()))
    assert sorted(tracks) == [0, 1, 2, 3]
    assert (tp2pp2_run / "tp2pp2" / "timeline.png").read_bytes()[:4] == b"\x89PNG"


VIRTUAL = {"interleaved-1f1b": 2}


def test_bubble_theory_is_the_simulators_and_bounds_the_measured(schedules_run) -> None:
    """pipeline/bubble_theory is the schedule simulator's mean idle fraction for the schedule that ran (pp=2, 4
    micro-batches, its virtual stages) on the costs the step measured: the test runs the simulator itself on the
    costs the metric was given (recorded by the worker), and for GPipe, 1F1B and interleaved 1F1B, whose bubble does
    not depend on the costs, it is (p - 1) / (m v + p - 1) = 1/5, 1/5, 1/9. Those costs are the stages' controlled
    ones (sleeps: B = I + W = 2 F, W half of it), within what busy cores can add to a 50 ms sleep.

    The measured bubble (median over the steps), bounded on this machine without timing its noise: at least 0.7 x
    the theory (idle time comes from the schedule's dependencies, which no load shortens; 0.7 leaves room for the
    untimed work between actions, counted as compute), at most the theory + 0.15 (a quiet machine measured within
    0.015; +0.15 of a ~1.4 s step is 200 ms of stalls in most steps), and ordered as the theories are, 0.12 apart:
    GPipe and 1F1B (1/5) idle more than each zero-bubble schedule (~0.08). The 10% check is
    test_measured_bubble_matches_the_simulator (slow)."""
    from lightning_tpp.pipeline.schedule import simulate

    out, _ = schedules_run
    measured, theory = {}, {}
    for schedule in SCHEDULES:
        rows = _rows(out / schedule)
        costs = json.loads((out / schedule / "simulator_costs.json").read_text())
        assert len(costs) == len(rows) == STEPS, (schedule, costs)  # computed on every logging step
        virtual = VIRTUAL.get(schedule, 1)
        for row, c in zip(rows, costs):
            assert c["f"] == 1.0 and 1.5 <= c["b"] <= 2.6, (schedule, c)
            if schedule.startswith("z"):  # split backwards: I and W measured (under load: split_cost 0.17 seen)
                assert 0.3 <= c["w_share"] <= 0.7 and 0.0 <= c["split_cost"] <= 0.5, (schedule, c)
            else:
                assert c["w_share"] == 0.5 and c["split_cost"] == 0.0, (schedule, c)
            want = statistics.mean(simulate(schedule, 2, 4, virtual, **c).bubble)
            assert row["pipeline/bubble_theory"] == pytest.approx(want, rel=1e-5), (schedule, row, c)
            if not schedule.startswith("z"):
                assert row["pipeline/bubble_theory"] == pytest.approx(1 / (4 * virtual + 1), rel=1e-5), schedule
        measured[schedule] = statistics.median(r["pipeline/bubble"] for r in rows)
        theory[schedule] = statistics.median(r["pipeline/bubble_theory"] for r in rows)
    for schedule in SCHEDULES:
        assert 0.7 * theory[schedule] <= measured[schedule] <= theory[schedule] + 0.15, (schedule, measured, theory)
    for schedule in ("zero-bubble", "zb-drain", "zb-lead"):
        assert measured[schedule] < min(measured["gpipe"], measured["1f1b"]), (schedule, measured, theory)


# slow: a timing check that needs a quiet machine. In CI on 2 shared cores the bubble measured 0.015 above the
# simulator's for zero-bubble (0.093 against 0.078, where 10% is 0.008): noise of the machine, not of the metric,
# whose parts are checked exactly (they add up to the step) by test_metrics_in_csv_pp2_every_schedule.
@pytest.mark.slow
def test_measured_bubble_matches_the_simulator(schedules_run) -> None:
    """Stages of controlled cost (F = I = W = 100 ms per micro-batch and rank, sleeps): the measured bubble (median
    over the steps) is at least 0.9 x the simulator's for the step's measured action costs, and at most 1.1 x it
    plus the step's own message time, which the simulator leaves out (module docstring of pipeline/metrics.py): each
    message costs its sender the measured send time and its receiver about as much, hidden in its receive; on gloo
    that is about 1 ms, 1-2% of an interleaved step of 2 x 8 messages a rank, as much as 10% of its 0.11 bubble. The
    simulator's theory is (p-1)/(m*v+p-1) for 1F1B, GPipe and interleaved; interleaving and zero-bubble measure below
    1F1B."""
    out, _ = schedules_run
    measured, theory, messages = {}, {}, {}
    for schedule in SCHEDULES:
        rows = _rows(out / schedule)
        measured[schedule] = statistics.median(r["pipeline/bubble"] for r in rows)
        theory[schedule] = statistics.median(r["pipeline/bubble_theory"] for r in rows)
        messages[schedule] = statistics.median(
            2 * statistics.mean(r[f"pipeline/pp{p}/send"] for p in (0, 1)) / r["pipeline/step_time"] for r in rows)
    for schedule in SCHEDULES:
        low, high = 0.9 * theory[schedule], 1.1 * theory[schedule] + messages[schedule]
        assert low <= measured[schedule] <= high, (schedule, low, high, measured, theory, messages)
        assert messages[schedule] < 0.03, (schedule, messages)  # a message of ~1 ms, not a stalled transport
    for schedule, p, m, v in (("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1), ("interleaved-1f1b", 2, 4, 2)):
        assert theory[schedule] == pytest.approx((p - 1) / (m * v + p - 1), rel=0.01)
    assert measured["interleaved-1f1b"] < measured["1f1b"] and measured["zero-bubble"] < measured["1f1b"]


def _spans(trace: dict) -> dict[int, list[dict]]:
    tracks = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            tracks[e["tid"]].append(e)
    return tracks


def test_timeline_files(schedules_run) -> None:
    out, _ = schedules_run
    for schedule in SCHEDULES:
        trace = json.loads((out / schedule / "timeline.json").read_text())
        assert (out / schedule / "timeline.png").exists() == (schedule == "1f1b")  # the worker draws one
        tracks = _spans(trace)
        assert sorted(tracks) == [0, 1], schedule
        virtual = 2 if schedule == "interleaved-1f1b" else 1
        for rank, spans in tracks.items():
            actions = sorted((e for e in spans if e["cat"] in "FBIW"), key=lambda e: e["ts"])
            top = sorted(actions + [e for e in spans if e["cat"] == "wait"], key=lambda e: e["ts"])
            for a, b in zip(top, top[1:]):  # actions and waits never overlap on a rank
                assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (schedule, rank, a, b)
            for c in (e for e in spans if e["cat"] in ("send", "receive")):  # messages: inside an action or apart
                for a in actions:
                    inside = a["ts"] <= c["ts"] and c["ts"] + c["dur"] <= a["ts"] + a["dur"] + 1e-3
                    apart = c["ts"] >= a["ts"] + a["dur"] - 1e-3 or c["ts"] + c["dur"] <= a["ts"] + 1e-3
                    assert inside or apart, (schedule, rank, c, a)
            first = {}
            for a in actions:  # F before B (or I, then W) for each micro-batch and stage
                key = (a["args"]["stage"], a["args"]["microbatch"])
                assert (a["cat"] == "F") == (key not in first), (schedule, rank, a)
                first.setdefault(key, a["ts"])
            assert len(first) == 4 * virtual  # 4 micro-batches on each of the rank's stages
            assert {a["args"]["stage"] % 2 for a in actions} == {rank}


def test_a_blocked_rank_reports_its_action(schedules_run) -> None:
    """Rank 1 stops before its first send of a step; rank 0 waits for that micro-batch's gradients in a gloo
    receive. On SIGUSR1 it says so; when rank 1 fails there, the failure watch stops rank 0 with the same report
    (or, where rank 1's closed connection ended the wait first, the wait it was in and where it raised)."""
    _, result = schedules_run
    rank0 = result.outputs[0]
    report = (r"\[lightning_tpp rank 0 \{'dp': 0, 'pp': 0, 'tp': 0\}\] in pipeline stage 0, backward of "
              r"micro-batch 0; waiting \d+\.\d s to receive the gradients of micro-batch 0 from stage 1 \(rank 1\) "
              r"for stage 0(, until the wait raised)?\n\[lightning_tpp rank 0 \{'dp': 0, 'pp': 0, 'tp': 0\}\] main "
              r"thread blocked at "
              r"lightning_tpp/pipeline/transport\.py:\d+ in wait: work\.wait\(\) <- lightning_tpp/pipeline/"
              r"executor\.py:\d+ in _roots")
    hang, stop = rank0.split("[lightning_tpp rank 0] stopping: ")  # the SIGUSR1 report comes first
    assert re.search(report, hang), hang[-3000:]
    assert stop.startswith("rank 1 {'dp': 0, 'pp': 1, 'tp': 0} failed during train in pipeline stage 1, forward "
                           "of micro-batch 0: RuntimeError: injected failure before a send"), stop[:2000]
    assert re.search(report, stop), stop[:3000]
    assert result.returncodes[0] == 1
