"""The pipeline metrics' arithmetic and Lightning's logging-step rule, in one process; the SIGUSR1 report's handler
chaining and restoring (the distributed test sends the signal to a rank blocked in a gloo receive)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from lightning_tpp.pipeline.metrics import PREFIX, is_logging_step, simulator_costs, summarize, tokens_in
from lightning_tpp.pipeline.schedule import simulate
from lightning_tpp.reliability.watch import SignalReport, main_thread_location


def _row(pp: int, pipeline: int, span: float, send: float, recv: float, *, counts: bool = False,
         samples: float = 0.0, tokens: float = 0.0, elapsed: float = 1.0, costs: dict | None = None) -> list[float]:
    kinds = [x for kind in "FBIW" for x in (costs or {}).get(kind, (0.0, 0))]
    return [pp, pipeline, float(counts), span, send, recv, samples, tokens, elapsed, *kinds]


def test_summarize_two_pipelines() -> None:
    """Two dp replicas of pp=2: T is each pipeline's longest span; wait is T minus the rank's own span."""
    rows = [_row(0, 0, 10.0, 0.5, 2.0, counts=True, samples=8, tokens=128, elapsed=20.0),
            _row(1, 0, 8.0, 0.5, 1.5),
            _row(0, 1, 12.0, 0.5, 3.5, counts=True, samples=8, tokens=128, elapsed=25.0),
            _row(1, 1, 12.0, 0.5, 1.5)]
    v = summarize(rows, pp=2)
    # idle: (2 + 0) / 10, (1.5 + 2) / 10, 3.5 / 12, 1.5 / 12
    assert v[PREFIX + "bubble"] == pytest.approx((0.2 + 0.35 + 3.5 / 12 + 1.5 / 12) / 4)
    assert v[PREFIX + "step_time"] == pytest.approx(11.0)
    assert v[PREFIX + "pp0/compute"] == pytest.approx((7.5 + 8.0) / 2)
    assert v[PREFIX + "pp1/compute"] == pytest.approx((6.0 + 10.0) / 2)
    assert v[PREFIX + "pp1/wait"] == pytest.approx((2.0 + 0.0) / 2)
    assert v[PREFIX + "pp0/recv"] == pytest.approx(2.75) and v[PREFIX + "pp0/send"] == pytest.approx(0.5)
    assert v[PREFIX + "imbalance"] == pytest.approx(8.0 / 7.875)
    assert v[PREFIX + "samples_per_sec"] == pytest.approx(16 / 25.0)
    assert v[PREFIX + "tokens_per_sec"] == pytest.approx(256 / 25.0)


def test_no_tokens_without_token_ids() -> None:
    assert tokens_in((torch.randn(4, 16), torch.randn(4))) == 0
    assert tokens_in({"x": torch.randn(4, 3), "ids": torch.zeros(4, 16, dtype=torch.long)}) == 64
    assert PREFIX + "tokens_per_sec" not in summarize([_row(0, 0, 1.0, 0.0, 0.0, counts=True, samples=4)], pp=1)


def test_simulator_costs_from_measured_actions() -> None:
    nominal = {"f": 1.0, "b": 2.0, "w_share": 0.5, "split_cost": 0.0}
    assert simulator_costs([_row(0, 0, 1.0, 0.0, 0.0)]) == nominal  # nothing measured
    one_f_one_b = [_row(0, 0, 1, 0, 0, costs={"F": (4.0, 4), "B": (12.0, 4)}),
                   _row(1, 0, 1, 0, 0, costs={"F": (4.0, 4), "B": (12.0, 4)})]
    assert simulator_costs(one_f_one_b) == {**nominal, "b": 3.0}
    # zb-drain: whole backwards of 2, split ones of 1.2 + 1.2 (0.4 beyond a whole one)
    drain = [_row(1, 0, 1, 0, 0, costs={"F": (4.0, 4), "B": (4.0, 2), "I": (2.4, 2), "W": (2.4, 2)})]
    assert simulator_costs(drain) == {"f": 1.0, "b": 2.0, "w_share": 0.5, "split_cost": 0.4}


def test_theory_is_the_simulator() -> None:
    """What ``pipeline/bubble_theory`` logs: (p-1)/(m+p-1) for 1F1B, less for interleaved and zero-bubble."""
    mean = lambda s: sum(s.bubble) / len(s.bubble)  # noqa: E731
    assert mean(simulate("1f1b", 2, 4)) == pytest.approx(1 / 5)
    assert mean(simulate("interleaved-1f1b", 2, 4, 2)) < 1 / 5
    assert mean(simulate("zero-bubble", 2, 4)) < 1 / 5


def _trainer(**kw):
    base = dict(loggers=[object()], log_every_n_steps=5, num_training_batches=100, accumulate_grad_batches=1,
                global_step=4, should_stop=False, fast_dev_run=False)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(("kw", "batch_idx", "expected"), [
    ({}, 4, True),  # the 5th optimizer step: Lightning logs it under step 4
    ({"global_step": 5}, 5, False),
    ({"loggers": []}, 4, False),
    ({"log_every_n_steps": 0}, 4, False),
    ({"accumulate_grad_batches": 2}, 8, False),  # accumulating: nothing logged for this batch
    ({"accumulate_grad_batches": 2}, 9, True),
    ({"global_step": 5, "should_stop": True}, 5, False),  # may differ across ranks: not a collective's trigger
    ({"global_step": 5, "num_training_batches": 11, "accumulate_grad_batches": 4}, 10, False),  # the epoch's last
])
def test_logging_steps_follow_lightning(kw: dict, batch_idx: int, expected: bool) -> None:
    assert is_logging_step(_trainer(**kw), batch_idx) is expected


def test_signal_report_chains_and_restores(capfd: pytest.CaptureFixture[str]) -> None:
    calls: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    try:
        report = SignalReport(lambda: "rank 0: in pipeline stage 0, forward of micro-batch 1")
        assert report.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while "micro-batch 1" not in capfd.readouterr().err and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls == [signal.SIGUSR1]  # the handler it replaced still runs
        report.uninstall()
        assert signal.getsignal(signal.SIGUSR1) is not report._handle
        assert signal.set_wakeup_fd(-1) == -1  # nothing left installed
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_main_thread_location_names_the_blocking_line() -> None:
    seen: list[str] = []
    thread = threading.Thread(target=lambda: (time.sleep(0.3), seen.append(main_thread_location())))
    thread.start()
    time.sleep(1.0)  # the main thread is here when the other one looks
    thread.join()
    assert re.match(r"main thread blocked at test_pp_metrics\.py:\d+ in "
                    r"test_main_thread_location_names_the_blocking_line: time\.sleep\(1\.0\)", seen[0]), seen
