"""The sequence-parallel region (:mod:`~lightning_tpp.tensor_parallel.sequence`) as the tensor-parallel blocks and
layers inside a block of the sequence see it: the stream gathered at a block's entry (:func:`block_inputs`), read by
its column layers through an alias whose backward reduce-scatters (:func:`column_input`), kept saved as shards
(:func:`saved_as_shards`), reduce-scattered by its row layers (:func:`row_reduce`) and cut back at its exit
(:func:`block_output`). Outside the region each of them leaves its input as it is."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from lightning_tpp._compat import enclosing_saved_tensors_hooks, tree_map
from lightning_tpp.core.comm import (TPGroup, all_gather_seq, gather_seq, reduce_scatter_seq, scatter_seq,
                                     scatter_tokens, seq_alias, tokens_sharded)
from lightning_tpp.core.walk import Scoped


@dataclass
class _Region:
    """While a block of the sequence runs: the shape of its input shard, and the streams gathered at its
    tensor-parallel blocks' entries ([shard, gathered, the column layers' alias, _Regathered] each). Found again by
    identity (``is``), which ``torch.compile`` traces inside a compiled block (a registry by ``id()`` broke the graph
    and made dynamo guard on each call's tensor: a recompile every step)."""

    group: TPGroup
    shard: torch.Size
    regather: bool = True  # gathered inputs saved for backward as shards (off inside activation checkpointing)
    gathered: list[list[Any]] = field(default_factory=list)  # [shard, whole, alias, _Regathered, dim]

    @property
    def whole(self) -> torch.Size:
        s = list(self.shard)
        s[1] *= self.group.size
        return torch.Size(s)

    @property
    def flat(self) -> torch.Size:
        """The shard's tokens flattened, (batch x sequence shard, features): what a Mixture-of-experts block hands
        its shared expert (Qwen2-MoE), gathered and cut along dim 0 instead."""
        return torch.Size((self.shard[:-1].numel(), self.shard[-1]))

    @property
    def flat_whole(self) -> torch.Size:
        return torch.Size((self.flat[0] * self.group.size, self.flat[1]))

    def dim_of(self, shape: torch.Size, shard: bool) -> Optional[int]:
        """The dim along which a tensor of ``shape`` is the stream's (``shard``: this rank's part, else whole): the
        sequence's, 0 for flattened tokens, or None."""
        if shape == (self.shard if shard else self.whole):
            return 1
        if len(self.shard) == 3 and shape == (self.flat if shard else self.flat_whole):
            return 0
        return None


_REGION: Scoped[Optional[_Region]] = Scoped("lightning_tpp_sp_region", None)


@contextlib.contextmanager
def sequence_region(group: TPGroup, shard: torch.Size, *, regather: bool = True) -> Iterator[None]:
    """While a block of the sequence runs on its input shard of shape ``shard``; ``regather=False`` under activation
    checkpointing (which saves nothing in the forward)."""
    token = _REGION.set(_Region(group, shard, regather=regather))
    try:
        with tokens_sharded(group):  # what takes the tokens flattened gathers them itself (core.comm)
            yield
    finally:
        _REGION.reset(token)


def in_sequence_region() -> bool:
    """Whether a block runs inside the sequence-parallel region (its element checks the gradients there)."""
    return _REGION.get() is not None


class _ShareGrad(torch.autograd.Function):
    """Identity forward; backward divides by tp: a gradient every tp rank computed whole, entering a sum over
    them (the element's side inputs are summed over tp at its entry)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, size: int) -> Tensor:
        ctx.size = size
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        return grad / ctx.size, None


def block_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A tensor-parallel block's call inside the region: the stream (tensors of the input shard's shape) gathered."""
    region = _REGION.get()
    if region is None:
        return args, kwargs

    def fn(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        dim = region.dim_of(t.shape, shard=True)
        if dim is None:  # a side input: replicated inside the block, so its gradient is whole here
            return _ShareGrad.apply(t, region.group.size) if t.requires_grad and torch.is_grad_enabled() else t
        whole = gather_seq(t, region.group, dim)
        region.gathered.append([t, whole, None, None, dim])
        return whole

    return tuple(fn(a) for a in args), {k: fn(v) for k, v in kwargs.items()}


def gathered_mark() -> int:
    """Before a tensor-parallel block's call: how many streams the region holds (its own are let go after it)."""
    region = _REGION.get()
    return len(region.gathered) if region is not None else 0


def release_gathered(mark: int) -> None:
    """After it: the streams it gathered let go (only its own layers read them; backward holds what it needs), so
    that the next block's compiled frame starts from the same region (dynamo guards on its length)."""
    region = _REGION.get()
    if region is not None:
        del region.gathered[mark:]


class _Regathered:
    """A gathered stream that backward needs (the column layers' input, for their weight gradients), kept as this
    rank's shard and gathered again the first time backward asks (Megatron-SP): ``1/tp`` of it stays saved. The
    shard goes through the enclosing saved-tensor hooks (``unpack`` is theirs)."""

    __slots__ = ("packed", "unpack", "group", "dim", "whole")

    def __init__(self, packed: Any, unpack: Any, group: TPGroup, dim: int) -> None:
        self.packed, self.unpack, self.group, self.dim, self.whole = packed, unpack, group, dim, None

    def get(self) -> Tensor:
        if self.whole is None:
            self.whole = all_gather_seq(self.unpack(self.packed), self.group, self.dim)
        return self.whole


def _identity(t: Any) -> Any:
    return t


def saved_as_shards() -> contextlib.AbstractContextManager:
    """Around a tensor-parallel block's forward inside the region: what autograd saves of the gathered stream (or a
    view of it) is kept as the shard (:class:`_Regathered`); everything else goes to the enclosing hooks, if any
    (a user's ``save_on_cpu``, a memory tracker), as without this one."""
    region = _REGION.get()
    if region is None or not region.regather or not region.gathered or not torch.is_grad_enabled() or \
            torch.compiler.is_compiling():  # compiled: what the graph saves is AOTAutograd's choice (docs/compile.md)
        return contextlib.nullcontext()
    outer_pack, outer_unpack = enclosing_saved_tensors_hooks() or (_identity, _identity)
    wholes = {e[1].untyped_storage().data_ptr(): e for e in region.gathered}

    def pack(t: Tensor) -> Any:
        entry = wholes.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if entry is None or t.dtype != entry[1].dtype:
            return False, outer_pack(t)
        if entry[3] is None:
            entry[3] = _Regathered(outer_pack(entry[0].detach()), outer_unpack, region.group, entry[4])
        return True, (entry[3], t.shape, t.stride(), t.storage_offset())

    def unpack(packed: Any) -> Tensor:
        ours, held = packed
        if not ours:
            return outer_unpack(held)
        regathered, shape, stride, offset = held
        return regathered.get().as_strided(shape, stride, offset)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def column_input(x: Tensor) -> Optional[Tensor]:
    """What a column-parallel layer reads when its input is the stream gathered at its block's entry: an alias whose
    backward reduce-scatters the layer's partial input gradient (Megatron-SP's all-gather backward), shared by the
    sibling layers that read it (q, k, v). ``None`` for any other input (the layer's own ``copy_to_tp`` applies)."""
    region = _REGION.get()
    if region is None or not torch.is_grad_enabled():
        return None
    for entry in region.gathered:
        if entry[1] is x:
            if entry[2] is None:
                entry[2] = seq_alias(entry[0], x, region.group, entry[4])
            return entry[2]
    return None


def block_output(out: Any) -> Any:
    """... and its output cut back to this rank's part, where it is still whole (row layers that all-reduced)."""
    region = _REGION.get()
    if region is None:
        return out

    def cut(t: Any) -> Any:
        dim = region.dim_of(t.shape, shard=False) if isinstance(t, Tensor) else None
        return t if dim is None else scatter_seq(t, region.group) if dim == 1 else scatter_tokens(t, region.group)

    return tree_map(cut, out)


def row_reduce(y: Tensor) -> Optional[Tensor]:
    """A row-parallel layer's partial sums reduce-scattered over the sequence, inside the region; ``None`` outside
    it (the layer all-reduces)."""
    region = _REGION.get()
    dim = region.dim_of(y.shape, shard=False) if region is not None else None
    return None if dim is None else reduce_scatter_seq(y, region.group, dim)
