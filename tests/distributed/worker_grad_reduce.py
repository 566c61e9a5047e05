"""A rank of the gradient reduction check (3 ranks, gloo): ``core.grads.reduce_gradients`` / ``average_gradients``
against the mean computed from every rank's gradients (to float rounding: the ring sums in its own order), for a gradient on every rank, on one rank only (zeros
elsewhere, as DDP), on none (stays ``None``), a non-contiguous gradient and a second dtype; and the collectives it
issues (one all-reduce per flat bucket, nothing else)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from lightning_tpp.core import grads as grads_module


def grad_of(rank: int, shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed * 10 + rank)).to(dtype)


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    every = nn.Parameter(torch.zeros(4, 3))
    only_first = nn.Parameter(torch.zeros(5))
    nowhere = nn.Parameter(torch.zeros(2, 2))
    strided = nn.Parameter(torch.zeros(3, 4))
    double = nn.Parameter(torch.zeros(6, dtype=torch.float64))
    params = [every, only_first, nowhere, strided, double]
    every.grad = grad_of(rank, (4, 3), torch.float32, 1)
    if rank == 0:
        only_first.grad = grad_of(rank, (5,), torch.float32, 2)
    strided.grad = grad_of(rank, (4, 3), torch.float32, 3).t()  # a transposed (non-contiguous) gradient
    double.grad = grad_of(rank, (6,), torch.float64, 4)
    expected = {
        "every": sum(grad_of(r, (4, 3), torch.float32, 1) for r in range(world)) / world,
        "only_first": grad_of(0, (5,), torch.float32, 2) / world,
        "strided": sum(grad_of(r, (4, 3), torch.float32, 3) for r in range(world)).t() / world,
        "double": sum(grad_of(r, (6,), torch.float64, 4) for r in range(world)) / world,
    }
    calls: list[str] = []
    original = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast", "all_gather_object")}

    def counting(name: str):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return original[name](*args, **kwargs)
        return wrapper

    for name in original:
        setattr(grads_module.dist, name, counting(name))
    grads_module.average_gradients(params, dist.group.WORLD)
    for name, fn in original.items():
        setattr(grads_module.dist, name, fn)
    result = {
        "values": {name: bool(torch.allclose(locals_p.grad, expected[name], rtol=1e-6, atol=1e-7)) for name, locals_p in
                   (("every", every), ("only_first", only_first), ("strided", strided), ("double", double))},
        "nowhere_none": nowhere.grad is None,
        "strided_layout": list(strided.grad.stride()) == [1, 3],
        "calls": calls,
    }
    summed = nn.Parameter(torch.zeros(3))
    summed.grad = torch.full((3,), float(rank + 1))
    grads_module.reduce_gradients([summed], dist.group.WORLD, divisor=2)
    result["divisor"] = summed.grad.tolist()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
