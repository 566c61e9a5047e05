"""Any block stack pipelines without ``blocks=`` (issue #44 item 2), at parity with one process: layers of two
classes in one list (a hand-written hybrid, Hugging Face's Jamba with Mamba, attention and MoE layers), blocks in an
``nn.ModuleDict``, a vision tower and a language model (LLaVA, reading the tower's layer -2 through Hugging Face's
hidden-state hooks), and a middle layer's hidden state of the first stage read on the last (``output_hidden_states``:
before the stand-ins kept the layer's class, its hook was missing there and the loss was silently 7e-3 off)."""

from __future__ import annotations

from pathlib import Path

from launch import ROOT, run_ranks
from parity import assert_parity, load_record, merge_stages, train

STACKS = ["hybrid", "dict_blocks", "hf_jamba", "hf_llava", "hf_mid_layer"]


def _compare(tmp: Path, models: list[str], *, tp: int, pp: int) -> None:
    args = ["--models", ",".join(models), "--tp", str(tp), "--pp", str(pp), "--out", str(tmp), "--steps", "3"]
    run_ranks(ROOT / "tests" / "parity.py", tp * pp, args, timeout=400).check()
    for name in models:
        ref = train(name, steps=3)
        for t in range(tp):
            ranks = [s * tp + t for s in range(pp)]
            got = merge_stages([load_record(tmp / f"{name}.rank{r}.pt") for r in ranks])
            assert_parity(got, ref, where=f"{name} tp={tp} pp={pp} ranks {ranks}")


def test_stacks_pp2(tmp_path: Path) -> None:
    _compare(tmp_path, STACKS, tp=1, pp=2)


def test_stacks_tp2_pp2(tmp_path: Path) -> None:
    _compare(tmp_path, STACKS, tp=2, pp=2)
