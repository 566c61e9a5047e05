"""Evaluation under a pipeline runs micro-batched (the stages work at once) and gives what one process gives with
whole batches: validate, test and predict of one model from the same initial weights, through pp=2 (and interleaved
pp=2 x v=2) with 3 (6) micro-batches, against one process. Batches of 8 (not divisible by 3: micro-batches 3, 3, 2)
and 2 samples (fewer than 3: two micro-batches). Compared: what validate/test/predict return, every step's output
(as the batch-end hooks see it), every row of the CSVLogger (step and epoch values, a torchmetrics object, ``max``
and ``sum`` reductions), and how many micro-batches each step ran in (a result that cannot be put together from
micro-batches, a string and a 0-dim tensor from ``predict_step``, runs whole, and so does a ``test_step`` that logs
a torchmetrics object ``on_step``: its step value is the metric's last forward)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from launch import ROOT, run_ranks

SCRIPT = ROOT / "tests" / "distributed" / "worker_pp_eval.py"


def _run(out: Path, mode: str, tp: int, pp: int, virtual: int, microbatches: int = 3, *, in_order: bool = False
         ) -> list[dict]:
    n = tp * pp if mode == "pipe" else 1
    run_ranks(SCRIPT, n, [str(out), mode, str(tp), str(pp), str(virtual), str(microbatches)], timeout=150,
              env={"IN_ORDER": str(int(in_order))}).check()
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(n)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(tmp_path_factory.mktemp("eval_single"), "single", 1, 1, 1)[0]


def _same(got: Any, want: Any, where: str = "") -> None:
    """Nested results equal: tensors to fp32 tolerance (micro-batches change the products' blocking), the rest
    exactly."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: {m}")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), where
    else:
        assert got == want, where


@pytest.mark.parametrize("virtual, microbatches", [(1, 3), (2, 6)], ids=["pp2", "pp2-interleaved"])
def test_eval_matches_one_process(virtual: int, microbatches: int, reference: dict, tmp_path: Path) -> None:
    """Interleaved: 6 micro-batches (a multiple of pp), of 2 or 1 samples in a batch of 8, and receives posted
    when needed, in order (NCCL's way)."""
    ranks = _run(tmp_path, "pipe", 1, 2, virtual, microbatches, in_order=virtual > 1)
    for rank, r in enumerate(ranks):  # every stage returns and logs the last stage's values
        for key in ("validate", "test", "predict", "predict_odd", "test_step_metric", "outputs"):
            _same(r[key], reference[key], f"rank {rank} {key}")
        # micro-batched: as many as asked for (fewer for the batch of 2); the odd predict_step and the test_step
        # logging a metric on_step (their second runs) whole
        split = [microbatches, microbatches, 2]
        assert r["micro"] == {"validation": split, "test": split + [1, 1, 1], "predict": split + [1, 1, 1]}
        assert r["micro_odd"] == r["micro_step_metric"] == [1, 1, 1]
        assert r["early"] == {not virtual > 1}
    assert set(reference["micro"]["validation"]) == {0}  # one process: no pipeline
    rows = ranks[0]["rows"]  # the logger writes on rank 0, the first stage
    assert len(rows) == len(reference["rows"]) > 0
    for i, (got, want) in enumerate(zip(rows, reference["rows"])):
        assert got.keys() == want.keys(), i
        _same(got, want, f"row {i}")
    assert {"val_loss_step", "val_tokens", "val_worst_step", "val_mean", "test_acc", "test_loss_step",
            "test_acc_s_step"} <= {k for row in rows for k in row}


def test_combining_results_in_one_process() -> None:
    """Which results are put together from micro-batches, how, and the loud failure when a micro-batch's result has
    another structure (one process: the functions of plain data)."""
    from lightning_tpp.pipeline.errors import PipelineError
    from lightning_tpp.pipeline.microbatch import combinable, combine
    from lightning_tpp.pipeline.logging import _reduce

    whole = {"logits": torch.zeros(8, 5), "loss": torch.zeros(()), "top": [torch.zeros(8, dtype=torch.long)]}
    part = {"logits": torch.zeros(3, 5), "loss": torch.zeros(()), "top": [torch.zeros(3, dtype=torch.long)]}
    assert combinable("validation_step", whole, part, 8, 3) == ("cat", "mean", "cat")
    assert combinable("predict_step", whole, part, 8, 3) is None  # a 0-dim prediction: run whole
    assert combinable("predict_step", torch.zeros(5), torch.zeros(5), 8, 3) is None  # not per sample
    assert combinable("predict_step", (torch.zeros(8), "a"), (torch.zeros(3), "a"), 8, 3) is None
    assert combinable("validation_step", None, None, 8, 3) == ("none",)  # a step that only logs
    results = [{"y": torch.full((n, 2), float(i)), "loss": torch.tensor(float(i))} for i, n in enumerate((3, 3, 2))]
    shares = [3 / 8, 3 / 8, 2 / 8]
    combined = combine("validation_step", results, shares, ("cat", "mean"))
    torch.testing.assert_close(combined["y"], torch.tensor([0.0] * 6 + [1.0] * 6 + [2.0] * 4).view(8, 2))
    torch.testing.assert_close(combined["loss"], torch.tensor(3 / 8 + 2 * 2 / 8))
    with pytest.raises(PipelineError, match="different structures for the micro-batches"):
        combine("predict_step", [torch.zeros(3), [torch.zeros(3)]], shares[:2], ("cat",))
    with pytest.raises(PipelineError, match="different structures for the micro-batches"):
        combine("validation_step", [None, torch.zeros(())], shares[:2], ("none",))
    assert _reduce([1.0, 2.0, 4.0], "mean", shares) == pytest.approx((3 + 6 + 8) / 8)  # weighted by share
    assert _reduce([1.0, 2.0, 4.0], "mean", [None] * 3) == pytest.approx(7 / 3)  # training: equal weights
    assert _reduce([1.0, 2.0, 4.0], "sum", shares) == 7.0
