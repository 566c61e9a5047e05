"""Vocabulary matrices cut by rows over dp and computed where they lie: tokens cross the dp group, the matrix never
does.

FSDP2 gathers a unit's parameters whole for its forward and again for its backward, where the gathered matrix and
its unsharded gradient are alive together. For a model's vocabulary matrices (the token embedding, the LM head),
each larger than a block, that transient sets the rank's peak. Here such a matrix stays cut by rows over dp, held as
the same ``Shard(0)`` DTensor FSDP2 would hold (checkpoints, the optimizer and the global gradient norm see no
difference), and each rank computes with its own rows on the tokens of every dp rank::

    LM head     y = x W^T     x_all = all-gather(x) over dp            (tokens x hidden)
                              y_r   = x_all W_r^T + b_r                (every rank's tokens, this rank's rows)
                              y     = all-to-all(y_r)                  (this rank's tokens, every rank's rows)
                backward: the same in reverse (all-to-all of dy, dx summed over dp); dW_r = dy_r^T x_all

    embedding   e = E[ids]    ids_all = all-gather(ids) over dp
                              e_r = E_r[ids_all] where an id is among this rank's rows, zeros elsewhere
                              e   = sum over dp of e_r, this rank's tokens
                backward: all-gather of de; dE_r from every rank's tokens

A rank's rows get their gradient from the whole global batch where they lie (averaged over dp, as FSDP2's
reduce-scatter would): no gradient reduction is left for them. Per call this moves tokens x (hidden + rows / dp)
instead of FSDP2's gathers of rows x hidden (twice a step) and reduce-scatter; its memory is the activations the
layer holds anyway. Token counts may differ between dp ranks (one small all-gather per call says them).

Inside the module's forward (a pre-hook enters :class:`_RowsMode`, a forward hook leaves it) ``F.linear`` and
``F.embedding`` on the weight run as above, so a subclass's own forward (Gemma's scaled embedding) and the
tensor-parallel layers (whose vocab-parallel lookup and column-parallel product call those) keep working unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode

from lightning_tpp.core.swap import original_class


def row_counts(rows: int, parts: int) -> list[int]:
    """Rows of each dp rank under ``Shard(0)`` (``torch.chunk``'s rule, as DTensor and FSDP2 cut)."""
    each = math.ceil(rows / parts) if rows else 0
    return [max(0, min(each, rows - r * each)) for r in range(parts)]


@dataclass
class RowsOverDP:
    """One module whose ``weight`` (and ``bias``) stays cut by rows over dp; what its calls need."""

    name: str
    weight: nn.Parameter  # a Shard(0) DTensor over the dp mesh
    bias: Optional[nn.Parameter]
    group: ProcessGroup
    rank: int
    rows: list[int]  # rows of each dp rank
    modes: list[TorchFunctionMode] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def start(self) -> int:
        return sum(self.rows[:self.rank])

    def linear(self, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        if bias is not None and bias is not self.bias:
            raise RuntimeError(f"{self.name}: F.linear on its dp-row-sharded weight with a bias that is not its own "
                               f"(shape {tuple(bias.shape)}); construct the strategy with vocab_exchange=False")
        lead, hidden = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, hidden)
        sizes = _token_counts(flat.shape[0], self.group, self.size, x.device)
        x_all = _GatherRows.apply(flat, self, sizes)
        return _Head.apply(x_all, self.weight, bias, self, sizes).reshape(*lead, -1)

    def embedding(self, ids: Tensor, padding_idx: Optional[int]) -> Tensor:
        flat = ids.reshape(-1)
        sizes = _token_counts(flat.shape[0], self.group, self.size, ids.device)
        ids_all = _gather_rows(flat, sizes, self.group)
        local = ids_all - self.start
        outside = (local < 0) | (local >= self.rows[self.rank])
        pad = None
        if padding_idx is not None:
            padding_idx = padding_idx + sum(self.rows) if padding_idx < 0 else padding_idx
            pad = padding_idx - self.start if 0 <= padding_idx - self.start < self.rows[self.rank] else None
        e_all = _Lookup.apply(local.masked_fill(outside, 0), outside, self.weight, pad)
        return _SumRows.apply(e_all, self, sizes).reshape(*ids.shape, -1)


def _token_counts(n: int, group: ProcessGroup, size: int, device: torch.device) -> list[int]:
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    out = torch.empty(size, dtype=torch.int64, device=device)
    dist.all_gather_single(out, mine, group=group)
    return out.tolist()


def _gather_rows(x: Tensor, sizes: Sequence[int], group: ProcessGroup) -> Tensor:
    """Every dp rank's rows of ``x`` (``sizes[r]`` of them on rank r), in rank order."""
    most = max(sizes)
    padded = x if x.shape[0] == most else torch.cat([x, x.new_zeros(most - x.shape[0], *x.shape[1:])])
    out = x.new_empty(len(sizes) * most, *x.shape[1:])
    dist.all_gather_single(out, padded.contiguous(), group=group)
    if all(s == most for s in sizes):
        return out
    return torch.cat([out[r * most:r * most + s] for r, s in enumerate(sizes)])


def _sum_rows(y: Tensor, sizes: Sequence[int], rank: int, group: ProcessGroup) -> Tensor:
    """This rank's rows of the sum over dp of ``y`` (every rank's rows; small: tokens x hidden)."""
    y = y.contiguous().clone()
    dist.all_reduce(y, group=group)
    start = sum(sizes[:rank])
    return y[start:start + sizes[rank]]


def _all_to_all(send: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group: ProcessGroup
                ) -> Tensor:
    """``send`` (flat, its consecutive pieces of ``send_counts`` elements going to dp ranks 0, 1, ...) exchanged
    for what each rank sent here (flat, ``recv_counts`` elements from each, in rank order)."""
    out = send.new_empty(sum(recv_counts))
    dist.all_to_all_single(out, send, list(recv_counts), list(send_counts), group=group)
    return out


class _GatherRows(torch.autograd.Function):
    """(this rank's tokens, k) -> (every rank's tokens, k); backward: the gradient summed over dp, this rank's part,
    times dp (:class:`_Head` hands back its gradients divided by dp, for the weight's sake)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, layer: RowsOverDP, sizes: list[int]) -> Tensor:
        ctx.layer, ctx.sizes = layer, sizes
        return _gather_rows(x, sizes, layer.group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _sum_rows(grad, ctx.sizes, ctx.layer.rank, ctx.layer.group).mul_(ctx.layer.size), None, None


class _SumRows(torch.autograd.Function):
    """(every rank's tokens, k), partial -> (this rank's tokens, k) summed over dp; backward: an all-gather, divided
    by dp (a :class:`_Lookup` is all it flows into: the weight's gradient is the average over dp, as FSDP2's)."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, layer: RowsOverDP, sizes: list[int]) -> Tensor:
        ctx.layer, ctx.sizes = layer, sizes
        return _sum_rows(y, sizes, layer.rank, layer.group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _gather_rows(grad.contiguous(), ctx.sizes, ctx.layer.group).div_(ctx.layer.size), None, None


def _add_grad(param: Tensor, a: Tensor, b: Optional[Tensor] = None) -> None:
    """``param.grad += a @ b`` (``+= a`` without ``b``) on this rank's rows, in place where the dtypes allow: no
    gradient-sized temporary beside the gradient (autograd's accumulation would make one per micro-batch)."""
    if param.grad is None:
        grad = (a @ b if b is not None else a).to(param.dtype)
        param.grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False,
                                        shape=param.shape, stride=param.stride())
        return
    local = param.grad.to_local()  # shares the gradient's storage
    if b is not None and a.dtype == b.dtype == local.dtype:
        local.addmm_(a, b)
    else:
        local.add_(a @ b if b is not None else a)


class _Head(torch.autograd.Function):
    """(every rank's tokens, hidden) -> (this rank's tokens, every rank's rows): the product with this rank's rows,
    then one all-to-all; the rows of one rank's tokens are consecutive, so only the received side is rearranged.
    One function, so that neither the product nor the received pieces outlive it.

    Backward: the all-to-all back (the sending side rearranged), divided by dp in place, so that the weight's (and
    bias's) gradient is the average over dp as FSDP2's reduce-scatter makes it (:class:`_GatherRows` multiplies the
    input's gradient back); the weight's gradient is added into ``.grad`` in place (``_add_grad``). Under autocast
    the product runs in its dtype, as ``F.linear`` would."""

    @staticmethod
    def forward(ctx: Any, x_all: Tensor, weight: Tensor, bias: Optional[Tensor], layer: RowsOverDP,
                sizes: list[int]) -> Tensor:
        w, b = weight.to_local(), bias.to_local() if bias is not None else None
        device = x_all.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x_all, w, b = (t.to(dtype) if t is not None and t.is_floating_point() else t for t in (x_all, w, b))
        with torch.autocast(device, enabled=False):
            y_all = F.linear(x_all, w, b)
        ctx.save_for_backward(x_all, w)
        ctx.weight, ctx.bias, ctx.layer, ctx.sizes = weight, bias, layer, sizes
        n, mine = sizes[layer.rank], layer.rows[layer.rank]
        got = _all_to_all(y_all.view(-1), [s * mine for s in sizes], [n * r for r in layer.rows], layer.group)
        del y_all
        return torch.cat([part.view(n, r) for part, r in zip(got.split([n * r for r in layer.rows]), layer.rows)],
                         dim=1)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None, None]:
        x_all, w = ctx.saved_tensors
        layer, sizes = ctx.layer, ctx.sizes
        n, mine = sizes[layer.rank], layer.rows[layer.rank]
        send = torch.cat([part.reshape(-1) for part in grad.to(w.dtype).split(layer.rows, dim=1)])
        dy = _all_to_all(send, [n * r for r in layer.rows], [s * mine for s in sizes], layer.group)
        del send
        dy = dy.div_(layer.size).view(sum(sizes), mine)
        if ctx.needs_input_grad[1]:
            _add_grad(ctx.weight, dy.t(), x_all)
        if ctx.bias is not None and ctx.needs_input_grad[2]:
            _add_grad(ctx.bias, dy.sum(0))
        return (dy @ w if ctx.needs_input_grad[0] else None), None, None, None, None


class _Lookup(torch.autograd.Function):
    """This rank's rows looked up for every rank's ids (``ids`` local, ``outside`` where an id is not among them:
    zeros). Backward: the rows' gradient added into ``.grad`` in place (``index_add_``); the padding row gets none."""

    @staticmethod
    def forward(ctx: Any, ids: Tensor, outside: Tensor, weight: Tensor, pad: Optional[int]) -> Tensor:
        w = weight.to_local()
        out = F.embedding(ids, w) if w.shape[0] else w.new_zeros(len(ids), w.shape[1])
        ctx.save_for_backward(ids, outside)
        ctx.weight, ctx.pad = weight, pad
        return out.masked_fill_(outside.unsqueeze(-1), 0.0)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None, None]:
        ids, outside = ctx.saved_tensors
        param = ctx.weight
        if ctx.needs_input_grad[2]:
            if param.grad is None:  # (an empty one on a rank without rows, as FSDP2 gives)
                _add_grad(param, torch.zeros_like(param.to_local()))
            if param.to_local().shape[0]:
                skip = outside if ctx.pad is None else outside | (ids == ctx.pad)
                param.grad.to_local().index_add_(0, ids, grad.to(param.dtype).masked_fill(skip.unsqueeze(-1), 0.0))
        return None, None, None, None


_LINEAR = ("input", "weight", "bias")
_EMBEDDING = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")


class _RowsMode(TorchFunctionMode):
    """While the module's forward runs: ``F.linear``/``F.embedding`` on its weight computed over dp (see above)."""

    def __init__(self, layer: RowsOverDP) -> None:
        super().__init__()
        self.layer = layer

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        layer = self.layer
        if func is F.linear:
            given = {**dict(zip(_LINEAR, args)), **kwargs}
            if given.get("weight") is layer.weight:
                return layer.linear(given["input"], given.get("bias"))
        elif func is F.embedding:
            given = {**dict(zip(_EMBEDDING, args)), **kwargs}
            if given.get("weight") is layer.weight:
                if given.get("max_norm") is not None or given.get("scale_grad_by_freq") or given.get("sparse"):
                    raise RuntimeError(f"{layer.name}: F.embedding with max_norm, scale_grad_by_freq or sparse on "
                                       f"a dp-row-sharded weight; construct the strategy with vocab_exchange=False")
                return layer.embedding(given["input"], given.get("padding_idx"))
        try:
            return func(*args, **kwargs)
        except RuntimeError as err:
            if not any(isinstance(a, DTensor) for a in (*args, *kwargs.values())):  # the weight, or made from it
                raise
            raise RuntimeError(f"{layer.name}: its forward uses its weight in {getattr(func, '__name__', func)}, "
                               f"which is only computed over dp in F.linear and F.embedding; construct the strategy "
                               f"with vocab_exchange=False (FSDP2 gathers the weight instead)") from err


def candidates(module: nn.Module, blocks: Sequence[str], tp_blocks: Sequence[str] = ()) -> list[str]:
    """Names of the modules whose weight is computed over dp, the vocabulary matrices: ``nn.Embedding`` and
    ``nn.Linear`` (their subclasses and tensor-parallel versions) outside the blocks and outside the tensor-parallel
    blocks (``tp_blocks``), holding only a weight (and a linear's bias) with at least as many rows as columns
    (vocabulary >= hidden; a rank's tensor-parallel share). A weight tied to another module qualifies only if every module holding it does.
    None without blocks (a model without a block sequence keeps FSDP2's units)."""
    if not blocks:
        return []
    outside = [*tp_blocks, *blocks]
    holders: dict[int, list[str]] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None:
                holders.setdefault(id(p), []).append(name)
    modules = dict(module.named_modules())
    return [name for name, m in modules.items()
            if _qualifies(m, name, outside) and all(_qualifies(modules[h], h, outside) for h in holders[id(m.weight)])]


def _qualifies(m: nn.Module, name: str, outside: Iterable[str]) -> bool:
    if any(name == b or name.startswith(b + ".") for b in outside):
        return False
    cls = original_class(m)
    if issubclass(cls, nn.Embedding):
        ok = m.max_norm is None and not m.scale_grad_by_freq and not m.sparse and set(m._parameters) == {"weight"}
    elif issubclass(cls, nn.Linear):
        ok = {k for k, v in m._parameters.items() if v is not None} <= {"weight", "bias"}
    else:
        return False
    weight = m._parameters.get("weight")
    return ok and isinstance(weight, nn.Parameter) and weight.dim() == 2 and weight.shape[0] >= weight.shape[1]


def _cut(p: nn.Parameter, mesh: DeviceMesh, rank: int, rows: list[int]) -> nn.Parameter:
    start = sum(rows[:rank])
    mine = p.detach()[start:start + rows[rank]].clone()  # a copy: the whole matrix is freed with ``p``
    dt = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
    return nn.Parameter(dt, requires_grad=p.requires_grad)


def shard_rows_over_dp(module: nn.Module, names: Sequence[str], mesh: DeviceMesh) -> tuple[list[RowsOverDP],
                                                                                           dict[int, nn.Parameter]]:
    """Cut the weights (and biases) of ``names`` by rows over the 1-d dp ``mesh`` and make their calls compute over
    dp. Returns the layers and old parameter id -> new parameter (a tied weight is cut once)."""
    group, rank = mesh.get_group(), mesh.get_local_rank()
    replaced: dict[int, nn.Parameter] = {}
    layers = []
    for name in names:
        m = module.get_submodule(name)
        for attr in ("weight", "bias"):
            p = m._parameters.get(attr)
            if p is None:
                continue
            if id(p) not in replaced:
                replaced[id(p)] = _cut(p, mesh, rank, row_counts(p.shape[0], mesh.size()))
            m._parameters[attr] = replaced[id(p)]
        layer = RowsOverDP(name, m._parameters["weight"], m._parameters.get("bias"), group, rank,
                           row_counts(m.weight.shape[0], mesh.size()))
        m.register_forward_pre_hook(_enter(layer), prepend=True)
        m.register_forward_hook(_leave(layer), always_call=True)
        layers.append(layer)
    return layers, replaced


def _enter(layer: RowsOverDP) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        mode = _RowsMode(layer)
        mode.__enter__()
        layer.modes.append(mode)
    return hook


def _leave(layer: RowsOverDP) -> Any:
    def hook(module: nn.Module, args: Any, out: Any) -> None:
        if layer.modes:
            layer.modes.pop().__exit__(None, None, None)
    return hook
