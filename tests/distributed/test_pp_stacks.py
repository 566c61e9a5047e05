"""Any block stack pipelines without ``blocks=`` (issue #44 item 2), at parity with one process: layers of two
classes in one list (a hand-written hybrid, Hugging Face's Jamba with Mamba, attention and MoE layers), blocks in an
``nn.ModuleDict``, a vision tower and a language model (LLaVA, reading the tower's layer -2 through Hugging Face's
hidden-state hooks), and a middle layer's hidden state of the first stage read on the last (``output_hidden_states``:
before the stand-ins kept the layer's class, its hook was missing there and the loss was silently 7e-3 off)."""

from __future__ import annotations

from pathlib import Path

from parity import compare_layout

STACKS = ["hybrid", "dict_blocks", "hf_jamba", "hf_llava", "hf_mid_layer"]


def test_stacks_pp2(tmp_path: Path) -> None:
    compare_layout(tmp_path, STACKS, pp=2)


def test_stacks_tp2_pp2(tmp_path: Path) -> None:
    compare_layout(tmp_path, STACKS, tp=2, pp=2)
