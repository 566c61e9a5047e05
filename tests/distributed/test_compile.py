"""``compile=`` (issue #48): each of this rank's blocks compiled after the parallelisation, at parity with one eager
process (losses, per-parameter gradients, updated parameters, fp32, rtol 1e-5), with ``aot_eager`` (dynamo and
AOTAutograd, no code generation: inductor's C++ compile would take minutes on these cores); and no frame compiled
after the first step (no recompile)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parity import compare_layout

COMPILE = ("--compile", "aot_eager")


def _compiled(tmp: Path, name: str, ranks: int) -> list[dict]:
    return [json.loads((tmp / f"{name}.compile.rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.parametrize(("models", "steps", "extra"), [
    (["hf_llama"], 3, ("--activation-checkpointing",)),
    pytest.param(["llama", "hf_llama"], 5, (), marks=pytest.mark.slow)], ids=["hf_llama-recomputed", "both-5-steps"])
def test_compiled_tp2_at_parity(tmp_path: Path, models: list[str], steps: int, extra: tuple) -> None:
    """Hugging Face Llama (GQA) at tp=2 with activation checkpointing (the block's own forward compiled inside the
    checkpoint), and a hand-written Llama (SDPA, rotary tables; slow) with Hugging Face's without: their
    tensor-parallel blocks compiled after the first step (whose first-call checks run eagerly), each block one graph
    (no graph break); no graph compiled in the steps after the first compiled one."""
    compare_layout(tmp_path, models, tp=2, steps=steps, extra=(*COMPILE, *extra))
    for name in models:
        for info in _compiled(tmp_path, name, 2):
            assert info["compiled"] and info["graphs"] > 0, info
            assert info["breaks"] == 0 and info["recompiles"] == 0, f"{name}: {info}"


@pytest.mark.parametrize("extra", [(), ("--activation-checkpointing",)], ids=["plain", "recomputed"])
def test_compiled_pp2_at_parity(tmp_path: Path, extra: tuple) -> None:
    """Pipeline stages of compiled blocks, 4 micro-batches, ``schedule="auto"``: under compile it takes 1F1B without
    measuring (the zero-bubble family cannot split a compiled backward; a fixed one is refused, test_errors). Each
    block's own forward is one graph with no break (the stage runtime's dispatch around it stays eager), recomputed
    or not; the first-call check of each compiled block runs inside the dispatch (not a call of the step)."""
    compare_layout(tmp_path, ["llama4"], pp=2, steps=3, extra=(*COMPILE, "--schedule", "auto", *extra))
    for info in _compiled(tmp_path, "llama4", 2):
        assert len(info["compiled"]) == 2 and info["recompiles"] == 0, info
        assert info["graphs"] > 0 and info["breaks"] == 0, info


@pytest.mark.slow
def test_compiled_tp2_pp2_and_dp2_at_parity(tmp_path: Path) -> None:
    """tp2 x pp2 (4 processes), and dp=2 with FSDP2 (its hooks outside the compiled graphs)."""
    for sub in ("tp2pp2", "dp2"):
        (tmp_path / sub).mkdir()
    compare_layout(tmp_path / "tp2pp2", ["llama4"], tp=2, pp=2, steps=3, extra=(*COMPILE, "--schedule", "1f1b"))
    compare_layout(tmp_path / "dp2", ["llama", "hf_llama"], dp=2, steps=3, extra=COMPILE)


def test_no_recompile_over_epochs_with_a_short_batch_validation_and_predict(tmp_path: Path) -> None:
    """Two epochs of batches of 6, 6 and 3 samples with a validation pass (6, 3) after each, then ``predict``, at
    tp=2 (no batch size equals a count of heads: a per-head test of the shape would fix it as a constant). Compiled,
    the blocks compile their training graphs in the first compiled step (their first compiled call's check runs the
    training graph, forward and backward: it compiles no graph of its own), their evaluation graphs in the first
    validation batch, and nothing after, the short batches included (the batch and sequence sizes are compiled as
    symbols); every loss, validation loss and prediction equals the eager run's."""
    from launch import ROOT, run_ranks

    run_ranks(ROOT / "tests" / "distributed" / "worker_compile_epoch.py", 2, [str(tmp_path), "2"],
              timeout=400).check()
    for rank in range(2):
        rec = json.loads((tmp_path / f"rank{rank}.json").read_text())
        eager, compiled = rec["eager"], rec["compiled"]
        # the first compiled training step (a training graph per block), the first validation batch (an evaluation
        # graph per block)
        first = {("train", 0, 1), ("val", 0, 0)}
        made = {(phase, epoch, batch): n for phase, epoch, batch, n in compiled["graphs"]}
        assert made[("train", 0, 1)] == made[("val", 0, 0)] == 2, rec
        again = [(phase, epoch, batch, n) for phase, epoch, batch, n in compiled["graphs"]
                 if (phase, epoch, batch) not in first and n]
        assert not again, f"rank {rank}: recompiled in {again}"
        assert compiled["recompiles"] == 0, compiled
        assert len(compiled["graphs"]) == 6 + 4 + 2, compiled["graphs"]
        for what in ("losses", "val"):
            assert torch.allclose(torch.tensor(compiled[what]), torch.tensor(eager[what]), rtol=1e-5, atol=1e-6), \
                (what, compiled[what], eager[what])
        for got, want in zip(compiled["predicted"], eager["predicted"], strict=True):
            assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_compiled_experts_over_ep2_and_bf16(tmp_path: Path) -> None:
    """Mixtral with ep=2 drawn from dp=2 (the experts' all-to-all, of data-dependent sizes, traced inside the
    compiled blocks with functional collectives: no graph break; the dense parameters FSDP2-sharded), and Hugging Face Llama at tp=2 in bf16-mixed (autocast inside the graphs),
    each compiled after the first step against one eager process: fp32 at rtol 1e-5; bf16 against one eager bf16
    process at bf16's tolerance, as the eager tp2 bf16 test compares."""
    from launch import ROOT, run_ranks
    from parity import FP32, assert_parity, load_record, train
    from test_moe_ep import _launch, _reference

    (tmp_path / "ep").mkdir()
    (tmp_path / "bf16").mkdir()
    _launch(tmp_path / "ep", ["hf_mixtral_labels"], ep=2, dp=2, extra=(*COMPILE, "--steps", "3"))
    ref = _reference("hf_mixtral_labels", dp=2, steps=3)
    for rank in range(2):
        assert_parity(load_record(tmp_path / "ep" / f"hf_mixtral_labels.rank{rank}.pt"), ref,
                      where=f"compiled hf_mixtral_labels ep=2 dp=2 rank {rank}", **FP32)
    for info in _compiled(tmp_path / "ep", "hf_mixtral_labels", 2):  # the exchange traced: one graph per block
        assert info["compiled"] and info["graphs"] > 0 and info["breaks"] == 0 and info["recompiles"] == 0, info
    # recomputed blocks (activation checkpointing): the exchange traced too, inside the checkpoint (it was kept eager
    # there while the compiled check, run inside the checkpoint, saved its tensors through the checkpoint's hooks)
    (tmp_path / "ep_recomputed").mkdir()
    _launch(tmp_path / "ep_recomputed", ["hf_mixtral_labels"], ep=2, dp=2,
            extra=(*COMPILE, "--steps", "3", "--activation-checkpointing"))
    for rank in range(2):
        assert_parity(load_record(tmp_path / "ep_recomputed" / f"hf_mixtral_labels.rank{rank}.pt"), ref,
                      where=f"compiled, recomputed hf_mixtral_labels ep=2 dp=2 rank {rank}", **FP32)
    for info in _compiled(tmp_path / "ep_recomputed", "hf_mixtral_labels", 2):
        assert info["compiled"] and info["breaks"] == 0 and info["recompiles"] == 0, info
    run_ranks(ROOT / "tests" / "parity.py", 2, ["--models", "hf_llama", "--tp", "2", "--out", str(tmp_path / "bf16"),
                                                 "--steps", "3", "--precision", "bf16-mixed", *COMPILE],
              timeout=400).check()
    ref = train("hf_llama", precision="bf16-mixed", steps=3)
    for rank in range(2):  # bf16 keeps 8 bits of mantissa; tp sums each matmul in another order (test_tp_parity)
        assert_parity(load_record(tmp_path / "bf16" / f"hf_llama.rank{rank}.pt"), ref, rtol=2e-2, atol=2e-2,
                      where=f"compiled hf_llama tp=2 bf16-mixed rank {rank}")
    for info in _compiled(tmp_path / "bf16", "hf_llama", 2):
        assert info["compiled"] and info["breaks"] == 0 and info["recompiles"] == 0, info


@pytest.mark.parametrize(("models", "extra"), [(["hf_llama", "llama", "hf_mixtral_labels"], ()),
                                                (["hf_llama", "llama"], ("--activation-checkpointing",))],
                         ids=["plain", "recomputed"])
def test_compiled_sequence_parallel_at_parity(tmp_path: Path, models: list[str], extra: tuple) -> None:
    """Sequence parallelism (tp=2) compiled, Hugging Face Llama and a hand-written Llama, at parity with one eager
    process, recomputed or not: each block's own forward one graph (its tensor-parallel blocks' gathers, the column
    layers' alias and the row layers' reduce-scatters traced), what the block does around it eager (inside the
    checkpoint when recomputed); no graph break, no recompile after the first compiled step. Mixtral: its router's
    logits recorded inside the graph (Hugging Face's output collector, held outside its ContextVar for the call)
    reach the load-balancing loss as in one process, and the tokens per expert are counted in the graph."""
    compare_layout(tmp_path, models, tp=2, steps=3, extra=(*COMPILE, "--sequence-parallel", *extra))
    for name in models:
        for info in _compiled(tmp_path, name, 2):
            assert info["compiled"] and info["graphs"] > 0, f"{name}: {info}"
            assert info["breaks"] == 0 and info["recompiles"] == 0, f"{name}: {info}"
