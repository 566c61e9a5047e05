"""PipelineTimeline's files from recorded spans, in one process: the Chrome trace (one track per rank, spans nested
or apart, a wait where a rank idles until its pipeline ends), the picture, and the message without matplotlib."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_tpp import PipelineTimeline
from lightning_tpp.pipeline import timeline
from lightning_tpp.pipeline.timeline import chrome_trace, draw, measured_bubble


def _record() -> dict:
    """GPipe, pp=2, two micro-batches, F = 1 ms and B = 2 ms, rank 1 receiving each forward's activations."""
    ms = 1e-3
    rank0 = {"rank": 0, "coords": {"dp": 0, "pp": 0, "tp": 0},
             "actions": [("F", 0, 0, 0, 1 * ms), ("F", 1, 0, 1 * ms, 2 * ms), ("B", 0, 0, 2 * ms, 6 * ms),
                         ("B", 1, 0, 6 * ms, 8 * ms)],
             "comms": [("send", "activations", 0, 0, 1, 1, 0.9 * ms, 1 * ms),
                       ("receive", "gradients", 0, 1, 0, 1, 2 * ms, 4 * ms)]}
    rank1 = {"rank": 1, "coords": {"dp": 0, "pp": 1, "tp": 0},
             "actions": [("F", 0, 1, 0, 2 * ms), ("F", 1, 1, 2 * ms, 3 * ms), ("B", 0, 1, 3 * ms, 5 * ms),
                         ("B", 1, 1, 5 * ms, 7 * ms)],
             "comms": [("receive", "activations", 0, 0, 1, 0, 0, 1 * ms)]}
    return {"step": 3, "batch": 3, "schedule": "gpipe", "pp": 2, "virtual": 1, "microbatches": 2,
            "ranks": [rank0, rank1]}


def test_chrome_trace_has_one_track_per_rank_and_nested_spans() -> None:
    trace = json.loads(json.dumps(chrome_trace([_record(), _record()])))  # JSON-clean
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "rank 0 (pp 0, tp 0, dp 0)", 1: "rank 1 (pp 1, tp 0, dp 0)"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == {"F", "B", "send", "receive", "wait"}
    f0 = next(e for e in spans if e["tid"] == 1 and e["name"] == "F0")
    assert f0["args"] == {"step": 3, "stage": 1, "microbatch": 0} and f0["dur"] == pytest.approx(2000.0)
    recv = next(e for e in spans if e["tid"] == 1 and e["cat"] == "receive")
    assert recv["name"] == "receive activations 0 from stage 0" and recv["args"]["peer_rank"] == 0
    assert f0["ts"] <= recv["ts"] and recv["ts"] + recv["dur"] <= f0["ts"] + f0["dur"]  # nested in its action
    wait = [e for e in spans if e["cat"] == "wait"]
    assert [(e["tid"], e["dur"]) for e in wait[:1]] == [(1, pytest.approx(1000.0))]  # rank 1 idles 7 -> 8 ms
    second = [e for e in spans if e["tid"] == 0 and e["name"] == "F0"][1]
    assert second["ts"] >= 8000.0  # the second recorded step comes after the first


def test_measured_bubble_counts_blocked_receives_and_the_wait() -> None:
    # rank 0: 8 ms busy, 2 of them blocked: 0.25 idle; rank 1: 7 ms busy, 1 blocked, 1 waiting: 2 / 8 idle
    assert measured_bubble(_record()) == pytest.approx(0.25)


def test_png_is_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    draw([_record()], tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timeline.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install matplotlib \(or PipelineTimeline\(\.\.\., png=False\)"):
        PipelineTimeline("out", steps=[1])
    assert PipelineTimeline("out", steps=[1], png=False).steps == [1]


def test_steps_must_be_given() -> None:
    with pytest.raises(ValueError, match=r"steps=\[\] must name at least one global step >= 0, e.g. steps=\[10\]"):
        PipelineTimeline("out", steps=[])


def test_drawing_without_matplotlib_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # the import inside draw() fails
    with pytest.raises(ModuleNotFoundError, match=r"timeline.png needs matplotlib, which is not installed: pip "
                                                  r"install matplotlib \(or PipelineTimeline\(\.\.\., png=False\)"):
        draw([_record()], tmp_path / "timeline.png")
