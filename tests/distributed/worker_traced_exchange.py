"""Ranks of a run of the expert exchange (``experts.dispatch``) alone at ep=2, eagerly and compiled (aot_eager, the
exchange traced in the graph), on the same routed rows for three calls of different sizes, each with gradients and
then without: writes per rank whether outputs (and gradients) agree, the bytes each counted as sent, and dynamo's
graphs and breaks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_tpp._compat import capture_scalar_outputs
from lightning_tpp.core.comm import TPGroup
from lightning_tpp.experts.dispatch import Traffic, dispatch
from lightning_tpp.integration.compile_metrics import dynamo_counts


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ep, tp = TPGroup(dist.group.WORLD, rank, 2), TPGroup(None, 0, 1)
    torch.manual_seed(0)
    weights = torch.randn(2, 4, 4, requires_grad=True)  # this rank's 2 of 4 experts: a matrix and a scale each
    scales = torch.randn(2, 4, requires_grad=True)

    def compute(rows: torch.Tensor, which: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
        return torch.einsum("nh,nhk->nk", rows, weights[which[:, 0]]) * scales[which[:, 0]] * ones

    def routed(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, traffic: Traffic) -> torch.Tensor:
        return dispatch(compute, x, index, weight, experts=4, ep=ep, tp=tp, params=[weights, scales],
                        traffic=traffic)

    capture_scalar_outputs()
    compiled = torch.compile(routed, backend="aot_eager")
    evaluated = torch.compile(routed, backend="aot_eager")  # first traced without gradients, as validation's graphs
    eager_traffic, traced_traffic = Traffic(), Traffic()
    # the strategy's first training step runs eagerly and makes this tensor; compiled steps add to it
    traced_traffic.pending = torch.zeros((), dtype=torch.long)
    agree, sent = [], []
    for call in range(3):
        torch.manual_seed(10 * call + rank)
        tokens = 5 + 2 * call + rank  # the ranks send and receive different numbers of rows
        x = torch.randn(tokens, 4)
        index, weight = torch.randint(0, 4, (tokens, 2)), torch.rand(tokens, 2)
        results = []
        for fn, traffic in ((routed, eager_traffic), (compiled, traced_traffic)):
            leaf = x.clone().requires_grad_(True)
            y = fn(leaf, index, weight, traffic)
            grads = torch.autograd.grad((y * torch.arange(y.numel()).view_as(y)).sum(), [leaf, weights, scales])
            results.append((y.detach(), *grads))
        agree.append(all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*results)))
        sent.append((eager_traffic.bytes, traced_traffic.bytes))
        with torch.no_grad():  # validation, predict: traced too (the experts still require gradients)
            outs = [fn(x, index, weight, traffic) for fn, traffic in ((routed, eager_traffic),
                                                                      (evaluated, traced_traffic))]
        agree.append(torch.allclose(*outs, atol=1e-6))
        sent.append((eager_traffic.bytes, traced_traffic.bytes))
    graphs, breaks, _ = dynamo_counts()
    (out / f"rank{os.environ['LOCAL_RANK']}.json").write_text(
        json.dumps({"agree": agree, "sent": sent, "graphs": graphs, "breaks": breaks}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
