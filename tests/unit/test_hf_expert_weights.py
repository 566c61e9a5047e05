"""Hugging Face mixture-of-experts files (one tensor per expert and projection, as transformers 5 writes them and the
Hub holds them) read into the model's 3-D banks by ``weights=``'s loader: every parameter equals what
``from_pretrained`` (transformers' own conversion) gives; a rank's box of a bank reads only its experts' tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_tpp.checkpoint.hf_experts import StackedExperts, stack_experts
from lightning_tpp.checkpoint.weights import load_weights, open_source
from lightning_tpp.core.params import ParamNames, ShardIndex
from models import MODELS


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "deepseek_v3", "granitemoe"])
def test_per_expert_files_load_as_banks(tmp_path: Path, kind: str) -> None:
    """GraniteMoE: its files hold the banks whole, under the names of its former layers (``input_linear``), which
    transformers renames at load time with its conversion mapping's regular expressions."""
    import transformers

    torch.manual_seed(123)
    saved = MODELS[f"hf_{kind}_labels"]()
    saved.model.save_pretrained(tmp_path)
    source = open_source(tmp_path)
    if kind == "granitemoe":
        assert any(k.endswith("block_sparse_moe.input_linear.weight") for k in source.shapes)
    else:
        assert any(".experts.0." in k for k in source.shapes)  # the file holds one tensor per expert
    fresh = MODELS[f"hf_{kind}_labels"]()
    load_weights(fresh, tmp_path, names=ParamNames.of(fresh), shards=ShardIndex(), tp_rank=0, tp_size=1)
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    got = fresh.model.state_dict()
    assert want.keys() == got.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_a_box_of_a_bank_reads_its_experts_only(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MODELS["hf_mixtral_labels"]()
    model.model.save_pretrained(tmp_path)
    source = stack_experts(open_source(tmp_path), model)
    assert isinstance(source, StackedExperts)
    bank = "model.layers.0.mlp.experts.gate_up_proj"
    assert source.shapes[bank] == tuple(model.model.model.layers[0].mlp.experts.gate_up_proj.shape)
    read: list[str] = []
    inner = source.inner.read
    source.inner.read = lambda wanted: (read.extend(wanted), inner(wanted))[1]  # type: ignore[method-assign]
    dest = torch.empty(2, 128, 32)  # experts 2 and 3 (ep rank 1 of 2), every row
    source.read({bank: [((2, 0, 0), (2, 128, 32), dest)]})
    assert sorted(read) == sorted(f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in (2, 3)
                                  for w in ("w1", "w3"))
    torch.testing.assert_close(dest, model.model.model.layers[0].mlp.experts.gate_up_proj[2:].detach())
