"""A rank of the point-to-point collectives check (4 ranks, gloo; ``core.collectives``): all-gather and reduce-scatter
against what is computed here from every rank's input, over the world and over two 2-rank subgroups (group ranks are
not global ranks), float32 and bfloat16, and sizes that do not divide refused by name. Then FSDP2 units given the
strategy's gloo collectives (``data_parallel.fsdp``): gradients and updated parameters equal to FSDP2's own
collectives', and none of gloo's collectives called in the step."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_tpp.core.collectives import all_gather_into, reduce_scatter_into
from lightning_tpp.data_parallel.fsdp import _gloo_collectives


RING = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def data(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def check_collectives(group: dist.ProcessGroup, members: list[int]) -> list[str]:
    rank = dist.get_rank()
    me, n = members.index(rank), len(members)
    problems = []
    for dtype in (torch.float32, torch.bfloat16):
        tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
        for numel in (n * 5, n):
            inputs = [data(r, numel, dtype) for r in members]
            total = torch.stack([x.float() for x in inputs]).sum(0)
            out = torch.empty(numel // n, dtype=dtype)
            reduce_scatter_into(out, inputs[me].clone(), group)
            if not torch.allclose(out.float(), total.chunk(n)[me], **tol):
                problems.append(f"reduce_scatter_into {dtype} {numel} over {members}")
            gathered = torch.empty(numel * n, dtype=dtype)
            all_gather_into(gathered, inputs[me], group)
            if not torch.equal(gathered, torch.cat(inputs)):
                problems.append(f"all_gather_into {dtype} {numel} over {members}")
    for call, whole in ((all_gather_into, torch.empty(n * 3 + 1)), (reduce_scatter_into, torch.empty(n * 3 + 1))):
        try:
            call(whole, torch.empty(3), group) if call is all_gather_into else call(torch.empty(3), whole, group)
            problems.append(f"{call.__name__}: sizes {n * 3 + 1} and 3 accepted over {n} ranks")
        except ValueError as e:
            if f"{n * 3 + 1} elements are not {n} ranks x 3" not in str(e):
                problems.append(f"{call.__name__}: {e}")
    return problems


def fsdp_step(custom: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, int]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 5))  # 12 x 8 + 12: not a multiple of 4
    for unit in (model[0], model[2]):
        fully_shard(unit, mesh=mesh)
        if custom:
            _gloo_collectives(unit)
    fully_shard(model, mesh=mesh)  # the root, holding no parameter of its own (as the strategy's)
    calls = dict.fromkeys(RING, 0)
    real = {name: getattr(dist, name) for name in calls}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return real[name](*args, **kwargs)
        return call

    for name in calls:
        setattr(dist, name, counting(name))
    try:
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
        model(x).square().mean().backward()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    grads = [p.grad.full_tensor() for p in model.parameters()]
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return grads, [p.full_tensor() for p in model.parameters()], calls


def main() -> None:
    dist.init_process_group("gloo")
    problems = check_collectives(dist.group.WORLD, [0, 1, 2, 3])
    pairs = [[0, 2], [1, 3]]
    groups = [dist.new_group(p) for p in pairs]
    mine = next(i for i, p in enumerate(pairs) if dist.get_rank() in p)
    problems += check_collectives(groups[mine], pairs[mine])
    grads, params, calls = fsdp_step(custom=True)
    ref_grads, ref_params, ref_calls = fsdp_step(custom=False)
    for what, got, want in (("gradient", grads, ref_grads), ("parameter", params, ref_params)):
        for i, (a, b) in enumerate(zip(got, want)):
            if not torch.allclose(a, b, rtol=1e-6, atol=1e-7):
                problems.append(f"FSDP2 {what} {i}: max abs difference {(a - b).abs().max().item():.3g}")
    json.dump({"problems": problems, "calls": calls, "ref_calls": ref_calls},
              open(f"{sys.argv[1]}/rank{dist.get_rank()}.json", "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
