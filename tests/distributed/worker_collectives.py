"""A rank of the collective-count check: one transformer block at tp=2, collectives counted per pass; with
sequence parallelism, the block in the middle of a sequence (its input and output are sequence shards)."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_tpp.core.comm import TPGroup
from lightning_tpp.tensor_parallel.apply import apply_plan
from lightning_tpp.tensor_parallel.plan import detect
from lightning_tpp.tensor_parallel.sequence import apply_sequence_parallel
from models import Block, LlamaBlock

BLOCKS = {
    "nanogpt_block": lambda: (Block(32, 4, 16), ()),
    "llama_block": lambda: (LlamaBlock(32, 4, 2), (torch.ones(16, 8), torch.zeros(16, 8))),
    "encoder_layer": lambda: (nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), ()),
}


def main() -> None:
    dist.init_process_group("gloo")
    counts: dict[str, dict[str, int]] = {}
    calls = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    functions = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter_single"}
    real = {name: getattr(dist, functions[name]) for name in calls}

    def counting(name):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real[name](*args, **kwargs)
        return wrapper

    def reset() -> None:
        calls.update({k: 0 for k in calls})

    for name, make in [*BLOCKS.items(), *((f"{n}_sp", m) for n, m in BLOCKS.items())]:
        torch.manual_seed(0)
        block, extra = make()
        group = TPGroup(dist.group.WORLD, dist.get_rank(), 2)
        shards = apply_plan(block, detect(block, 2), group)
        seq = 16
        if name.endswith("_sp"):  # the middle one of three blocks: sequence shards in and out
            holder = nn.ModuleList([nn.Identity(), block, nn.Identity()])
            apply_sequence_parallel(holder, [["0", "1", "2"]], group, shards)
            seq = 8
        x = torch.randn(2, seq, 32, requires_grad=True)
        block(x, *extra).sum().backward()  # first call runs the numerical check; not counted
        for k in calls:
            setattr(dist, functions[k], counting(k))
        reset()
        y = block(x, *extra)
        fwd = dict(calls)
        reset()
        y.sum().backward()
        counts[name] = {**{f"forward_{k}": v for k, v in fwd.items()}, **{f"backward_{k}": v for k, v in calls.items()}}
        for k in calls:
            setattr(dist, functions[k], real[k])
    counts["uneven_head"] = uneven_head()
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(counts, f)
    dist.barrier()
    dist.destroy_process_group()  # gloo may abort a process that exits with the group alive


def uneven_head() -> dict[str, float]:
    """Context parallelism's LM head over 2 ranks with a vocabulary of 7 (4 + 3 columns): the loss from the columns,
    the gathered logits and the gradients against the plain head (largest absolute differences)."""
    from lightning_tpp.context_parallel.head import HeadSlot, cut_linear

    torch.manual_seed(0)
    head = nn.Linear(8, 7)
    x = torch.randn(2, 5, 8, requires_grad=True)
    target = torch.tensor([0, 6, 3, -100, 4, 5, 1, 2, 6, 0])
    plain = F.cross_entropy(head(x).view(-1, 7), target, label_smoothing=0.1)
    plain.backward()
    expected = (plain.detach(), head(x).detach(), x.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    head.zero_grad()
    x.grad = None
    group = TPGroup(dist.group.WORLD, dist.get_rank(), 2)
    logits = cut_linear(x, head.weight, head.bias, HeadSlot("head", group))
    loss = F.cross_entropy(logits.view(-1, 7), target, label_smoothing=0.1)
    loss.backward()
    grads = [head.weight.grad.clone(), head.bias.grad.clone()]
    for g in grads:  # the strategy averages over the cp ranks, which hold the same weights
        dist.all_reduce(g)
        g /= 2
    got = (loss.detach(), logits.whole().detach(), x.grad, *grads)
    names = ("loss", "logits", "input_grad", "weight_grad", "bias_grad")
    return {n: float((a - b).abs().max()) for n, a, b in zip(names, got, expected)} | {
        "columns": logits._tpp_local.shape[-1]}


if __name__ == "__main__":
    main()
