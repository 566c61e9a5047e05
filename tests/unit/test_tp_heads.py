"""One-process tests of how per-head parameters and side tensors of an attention are found and cut under tensor
parallelism (``lightning_tpp.tensor_parallel.heads``): by what the forward does with them where it can be traced at
setup, by size otherwise (the first-call check confirms: tests/distributed/test_tp_per_head_parity.py); BLOOM's ALiBi bias
with batch and heads in one dimension cut to this rank's heads."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from models import MODELS
from models_stacks import SinkAttention

from lightning_tpp.core.sharding import ShardSpec
from lightning_tpp.tensor_parallel.heads import to_local_heads
from lightning_tpp.tensor_parallel.plan import detect


def test_sinks_found_by_the_traced_forward_meeting_the_scores() -> None:
    info = detect(SinkAttention(), 2).blocks[""]  # 4 heads, 2 K/V heads
    assert info.kind == "attention" and info.heads == 4 and info.kv_heads == 2
    assert info.cut == {"sinks": ShardSpec(0)} and info.per_head == {"sinks": True}


def test_a_length_heads_vector_not_read_per_head_is_left_whole_when_traced() -> None:
    info = detect(SinkAttention(mix="features"), 2).blocks[""]  # multiplies the output's first 4 features
    assert info.kind == "attention" and info.cut == {} and info.per_head == {}


def test_untraceable_attention_cuts_its_own_length_heads_parameters_by_size() -> None:
    info = detect(SinkAttention(needs_mask=True), 2).blocks[""]
    assert info.cut == {"sinks": ShardSpec(0)} and info.per_head == {"sinks": False}  # the first call confirms


def test_hf_gpt_oss_sinks_cut_per_head_norm_weights_never() -> None:
    plan = detect(MODELS["hf_gpt_oss_labels"](), 2)
    name = "model.model.layers.0.self_attn"
    assert plan.blocks[name].cut == {f"{name}.sinks": ShardSpec(0)}
    plan = detect(MODELS["hf_qwen3"](), 2)  # q_norm / k_norm: children, and of the head size
    assert all(not info.cut for info in plan.blocks.values())


def test_alibi_with_batch_and_heads_merged_cut_to_this_ranks_heads() -> None:
    b, h, s, d = 3, 4, 5, 2
    alibi = torch.arange(b * h, dtype=torch.float32).view(b * h, 1, 1).expand(b * h, 1, s)  # value = seq * h + head
    query = torch.zeros(b * h // 2, s, d)
    with torch.no_grad():
        args, kwargs = to_local_heads(torch.Tensor.baddbmm, (alibi,), {"batch1": query, "batch2": query.mT},
                                      h, SimpleNamespace(size=2, rank=1))
    got = args[0][:, 0, 0].tolist()
    assert got == [seq * h + head for seq in range(b) for head in (2, 3)]
