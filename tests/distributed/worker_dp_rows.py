"""A rank of the dp-rows check (3 ranks, gloo): embeddings and linear layers cut by rows over dp compute what the
whole layer computes on each rank's tokens, and their gradients are the dp average of every rank's (accumulated over
two backward passes), for uneven row splits (7 rows: 3, 3, 1; 2 rows: 1, 1, 0), uneven token counts, a padding id, a
bias and a subclass's own forward."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_tpp.data_parallel import shard_rows_over_dp


class ScaledEmbedding(nn.Embedding):  # Gemma's: the subclass's forward scales the lookup
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 3.0


class Misuse(nn.Linear):  # uses its weight outside F.linear
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class ForeignBias(nn.Linear):  # F.linear on its weight with a bias that is not its own
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, torch.zeros(self.out_features))


class RenormedLookup(nn.Embedding):  # F.embedding on its weight with max_norm (renormalises rows in place)
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight, max_norm=1.0)


def tokens(rank: int, n_of: list[int], vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n_of[rank], 2), generator=torch.Generator().manual_seed(10 + rank))


def check(make, inputs, size: int, rank: int, mesh, name: str) -> dict:
    torch.manual_seed(0)
    ref = make()
    got = make()
    got.load_state_dict(ref.state_dict())
    holder = nn.Module()
    holder.layer = got
    shard_rows_over_dp(holder, ["layer"], mesh)
    outs, weight_grads = [], {k: torch.zeros_like(v) for k, v in ref.named_parameters()}
    for r in range(size):  # the reference: every rank's tokens through the whole layer, gradients averaged over dp
        ref.zero_grad()
        x = inputs(r)
        out = ref(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        for k, v in ref.named_parameters():
            weight_grads[k] += v.grad / size
        outs.append(out.detach())
    x = inputs(rank)
    for _ in range(2):  # two micro-batches: the second adds into the gradients the first left
        out = got(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    result = {"out": torch.allclose(out, outs[rank], rtol=1e-5, atol=1e-6)}
    for k, p in got.named_parameters():
        rows = p.to_local().shape[0]
        start = sum(p.shape[0] // size + (1 if p.shape[0] % size else 0) for _ in range(rank))
        want = 2 * weight_grads[k][start:start + rows]
        result[k] = bool(torch.allclose(p.grad.to_local(), want, rtol=1e-5, atol=1e-6))
        result[f"{k}.rows"] = rows
    if x.is_floating_point():
        x_ref = inputs(rank).requires_grad_(True)
        o = ref(x_ref)
        (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum().backward()
        result["input_grad"] = bool(torch.allclose(x.grad, 2 * x_ref.grad, rtol=1e-5, atol=1e-6))
    return result


def main() -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,))
    n_of = [4, 1, 3]  # tokens per rank differ
    out = {
        "embedding": check(lambda: nn.Embedding(7, 5, padding_idx=2), lambda r: tokens(r, n_of, 7), size, rank, mesh,
                           "embedding"),
        "scaled": check(lambda: ScaledEmbedding(2, 4), lambda r: tokens(r, n_of, 2), size, rank, mesh, "scaled"),
        "linear": check(lambda: nn.Linear(5, 7), lambda r: torch.randn(n_of[r], 2, 5, requires_grad=True,
                                                                       generator=torch.Generator().manual_seed(r)),
                        size, rank, mesh, "linear"),
    }
    # the tensor-parallel all-gather along the last dim, received in pieces when large (core.comm._GatherFromTP)
    from lightning_tpp.core.comm import TPGroup, gather_from_tp

    parts = [torch.randn(3, 100, 2000, generator=torch.Generator().manual_seed(100 + r)) for r in range(size)]
    x = parts[rank].clone().requires_grad_(True)
    whole = gather_from_tp(x, TPGroup(dist.group.WORLD, rank, size))
    (whole * 2).sum().backward()
    out["gather"] = {"out": bool(torch.equal(whole, torch.cat(parts, dim=-1))),
                     "grad": bool(torch.equal(x.grad, torch.full_like(x, 2.0))),
                     "pieces_needed": whole.numel() * 4 > 4 * 2 ** 20}
    for key, layer, x in (("misuse", Misuse(3, 6), torch.randn(2, 3)),
                          ("foreign_bias", ForeignBias(3, 6, bias=False), torch.randn(2, 3)),
                          ("max_norm", RenormedLookup(6, 3), torch.tensor([0, 5]))):
        holder = nn.Module()
        holder.layer = layer
        shard_rows_over_dp(holder, ["layer"], mesh)
        try:
            holder.layer(x)
            out[key] = "no error"
        except RuntimeError as err:
            out[key] = str(err)
    with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
