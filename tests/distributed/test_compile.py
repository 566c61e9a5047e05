"""``compile=`` (issue #48): each of this rank's blocks compiled after the parallelisation, at parity with one eager
process (losses, per-parameter gradients, updated parameters, fp32, rtol 1e-5), with ``aot_eager`` (dynamo and
AOTAutograd, no code generation: inductor's C++ compile would take minutes on these cores); and no frame compiled
after the first step (no recompile)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity import compare_layout

COMPILE = ("--compile", "aot_eager")


def _compiled(tmp: Path, name: str, ranks: int) -> list[dict]:
    return [json.loads((tmp / f"{name}.compile.rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.parametrize(("models", "steps"), [(["hf_llama"], 3),
                                               pytest.param(["llama", "hf_llama"], 5, marks=pytest.mark.slow)],
                         ids=["hf_llama", "both-5-steps"])
def test_compiled_tp2_at_parity(tmp_path: Path, models: list[str], steps: int) -> None:
    """Hugging Face Llama (GQA) and a hand-written Llama (SDPA, rotary tables; slow) at tp=2: their tensor-parallel
    blocks compiled after the first step (whose first-call checks run eagerly); no graph compiled in the steps after
    the first compiled one."""
    compare_layout(tmp_path, models, tp=2, steps=steps, extra=COMPILE)
    for name in models:
        for info in _compiled(tmp_path, name, 2):
            assert info["compiled"] and info["graphs"] > 0, info
            assert info["recompiles"] == 0, f"{name}: {info}"


def test_compiled_pp2_at_parity(tmp_path: Path) -> None:
    """Pipeline stages of compiled blocks, 4 micro-batches, ``schedule="auto"``: under compile it takes 1F1B without
    measuring (the zero-bubble family cannot split a compiled backward; a fixed one is refused, test_errors)."""
    compare_layout(tmp_path, ["llama4"], pp=2, steps=3, extra=(*COMPILE, "--schedule", "auto"))
    for info in _compiled(tmp_path, "llama4", 2):
        assert len(info["compiled"]) == 2 and info["recompiles"] == 0, info


@pytest.mark.slow
def test_compiled_tp2_pp2_and_dp2_at_parity(tmp_path: Path) -> None:
    """tp2 x pp2 (4 processes), and dp=2 with FSDP2 (its hooks outside the compiled graphs)."""
    for sub in ("tp2pp2", "dp2"):
        (tmp_path / sub).mkdir()
    compare_layout(tmp_path / "tp2pp2", ["llama4"], tp=2, pp=2, steps=3, extra=(*COMPILE, "--schedule", "1f1b"))
    compare_layout(tmp_path / "dp2", ["llama", "hf_llama"], dp=2, steps=3, extra=COMPILE)
