"""Logits cut along the vocabulary, and the cross-entropy computed from the cuts.

Two ways of cutting an LM head's output columns share this module:

- tensor parallelism's vocabulary-parallel head gathers its logits whole and remembers this rank's shard
  (``tensor_parallel.loss.VocabShardedLogits``);
- context parallelism's head never makes them whole: every cp rank holds the whole sequence at the head and computes
  ``1 / cp`` of the vocabulary's columns (:class:`VocabCut`, a tensor that has the whole logits' shape and holds
  only this rank's columns).

``F.cross_entropy`` of either, with class-index targets, is Megatron's vocab-parallel cross-entropy
(:func:`cut_cross_entropy`): a max, a sum of exponentials and the target's logit all-reduced over the groups that
cut the columns; backward ``softmax - one-hot`` on this rank's columns, no communication.

A :class:`VocabCut` keeps its cut through what a loss does to logits: ``view``/``reshape``/``flatten`` of the leading
dimensions, slicing them (the label shift ``logits[:, :-1]``), ``float``/``to``/``contiguous``/``detach``,
arithmetic with a Python number and ``tanh`` (Gemma's final soft-capping), metadata (``shape``, ``size(-1)``,
``dtype``). Any other use gets the whole logits, gathered once (a warning names the operation: at long sequences
this is the memory context parallelism exists to save). Every rank of the groups must then make the same call: the
gather is a collective, as every other step of a cp rank's forward.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_tpp._compat import tree_flatten, tree_unflatten
from lightning_tpp.core.comm import TPGroup, gather_from_tp


def keeps_last_dim(index: Any, ndim: int) -> bool:
    """Whether ``tensor[index]`` leaves the last dimension whole (basic indexing of the leading ones only)."""
    index = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, (int, slice)) or i is None or i is Ellipsis for i in index):
        return False  # advanced indexing
    full = slice(None)
    if Ellipsis in index:
        return index[-1] == full
    consumed = sum(1 for i in index if i is not None)
    last = [i for i in index if i is not None]
    return consumed < ndim or (consumed == ndim and last[-1] == full)


RESHAPES = (Tensor.view, Tensor.reshape, Tensor.flatten, torch.reshape, torch.flatten)
_PASS = {Tensor.contiguous, Tensor.float, Tensor.to, Tensor.detach, Tensor.clone, torch.clone, torch.detach}
_POINTWISE = {Tensor.__mul__, Tensor.__rmul__, Tensor.__truediv__, Tensor.__add__, Tensor.__radd__, Tensor.__sub__,
              Tensor.__neg__, Tensor.mul, Tensor.div, Tensor.add, Tensor.sub, torch.mul, torch.div, torch.add,
              torch.sub, Tensor.tanh, torch.tanh, F.tanh}


def follow(func: Any, args: tuple, kwargs: dict, local: Tensor, whole_shape: Sequence[int]) -> Optional[Tensor]:
    """``func(logits, *args[1:])`` on this rank's columns ``local`` of logits shaped ``whole_shape``, or None where it
    does not keep the vocabulary as the last dimension whole."""
    if func in _PASS:
        out = func(local, *args[1:], **kwargs)
        # to another device: leaving the step (Lightning moving predictions to the CPU on every rank), gathered there
        return out if out.device == local.device else None
    if func in _POINTWISE:
        if all(isinstance(a, (int, float, bool)) for a in (*args[1:], *kwargs.values())):
            return func(local, *args[1:], **kwargs)
        return None
    stand_in = torch.empty(tuple(whole_shape), device="meta")
    if func is Tensor.__getitem__:
        if not keeps_last_dim(args[1], len(whole_shape)):
            return None
        out = stand_in[args[1]]
        return local[args[1]] if out.dim() and out.shape[-1] == whole_shape[-1] else None
    if func in RESHAPES:
        out = func(stand_in, *args[1:], **kwargs)
        if out.dim() == 0 or out.shape[-1] != whole_shape[-1]:
            return None
        return local.reshape(*out.shape[:-1], local.shape[-1])
    return None


@dataclass(frozen=True)
class Cut:
    """How a rank's columns sit in the vocabulary: the groups that cut them (innermost first) with each group's
    widths by rank; this rank's first column."""

    levels: tuple[tuple[TPGroup, tuple[int, ...]], ...]
    start: int

    @property
    def groups(self) -> tuple[TPGroup, ...]:
        return tuple(g for g, _ in self.levels)

    def joined(self, group: TPGroup, width: int) -> "Cut":
        """Cut again by ``group`` into equal parts of ``width`` columns (a tensor-parallel head's shards)."""
        return Cut((*self.levels, (group, (width,) * group.size)), self.start + group.rank * width)


_WARNED: set[str] = set()


class VocabCut(Tensor):
    """Logits of the whole shape holding only this rank's columns (``_tpp_local``, with its autograd history); see
    the module docstring for what keeps the cut and what gathers them whole."""

    _tpp_local: Tensor
    _tpp_cut: Cut
    _tpp_name: str

    @staticmethod
    def __new__(cls, local: Tensor, shape: Sequence[int], cut: Cut, name: str) -> "VocabCut":
        out = Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=local.dtype, device=local.device,
                                            requires_grad=local.requires_grad)
        out._tpp_local, out._tpp_cut, out._tpp_name = local, cut, name
        return out

    def like(self, local: Tensor) -> "VocabCut":
        """The same cut holding ``local`` (zeros of a pipeline's route trace)."""
        return VocabCut(local, self.shape, self._tpp_cut, self._tpp_name)

    def joined(self, group: TPGroup) -> "VocabCut":
        """The same columns as part of a head cut again over ``group`` (tensor parallelism's vocabulary shards)."""
        shape = (*self.shape[:-1], self.shape[-1] * group.size)
        return VocabCut(self._tpp_local, shape, self._tpp_cut.joined(group, self.shape[-1]), self._tpp_name)

    def whole(self) -> Tensor:
        """The whole logits (a collective over the cut's groups), differentiable into this rank's columns."""
        out = self._tpp_local
        for group, widths in self._tpp_cut.levels:
            out = gather_columns(out, group, widths)
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.whole().detach().__reduce_ex__(protocol)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (f"VocabCut(shape={tuple(self.shape)}, columns {self._tpp_cut.start}.."
                f"{self._tpp_cut.start + self._tpp_local.shape[-1]} of {self.shape[-1]} on this rank)")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        src = args[0] if args and isinstance(args[0], VocabCut) else None
        with torch._C.DisableTorchFunctionSubclass():
            if func is F.cross_entropy and src is not None:
                loss = cut_cross_entropy(src._tpp_local, src._tpp_cut, src.shape[-1], *args[1:], **kwargs)
                if loss is not None:
                    return loss
            if src is not None and func is Tensor.register_hook:  # FSDP2's pre-backward hook on a unit's output
                return src._tpp_local.register_hook(args[1])
            if src is not None and not any(isinstance(a, VocabCut) for a in (*args[1:], *kwargs.values())):
                local = follow(func, args, kwargs, src._tpp_local, src.shape)
                if local is not None:
                    return VocabCut(local, (*local.shape[:-1], src.shape[-1]), src._tpp_cut, src._tpp_name)
            try:
                return func(*args, **kwargs)  # metadata (shape, dtype, device) reads the wrapper itself
            except _NeedsData:
                pass
            name = getattr(func, "__name__", str(func))
            if name not in _WARNED:
                _WARNED.add(name)
                warnings.warn(f"context parallelism: the logits of '{src._tpp_name if src is not None else 'the head'}'"
                              f" were gathered whole on every cp rank for {name}; F.cross_entropy and shape "
                              f"operations keep them cut over the vocabulary (at long sequences whole logits are "
                              f"the memory cp saves)", stacklevel=3)
            flat, spec = tree_flatten((args, kwargs))
            flat = [a.whole() if isinstance(a, VocabCut) else a for a in flat]
            args, kwargs = tree_unflatten(flat, spec)
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        raise _NeedsData(func)  # it holds no whole values: __torch_function__ gathers them


class _NeedsData(Exception):
    """An operation reached the values of a :class:`VocabCut` (which has none of its own)."""


def gather_columns(local: Tensor, group: TPGroup, widths: Sequence[int]) -> Tensor:
    """The ranks' columns side by side (``widths[r]`` on rank r, which may differ by one): padded to the widest,
    all-gathered, the padding dropped. Backward keeps this rank's columns of the gradient."""
    most = max(widths)
    padded = F.pad(local, (0, most - local.shape[-1])) if local.shape[-1] < most else local
    out = gather_from_tp(padded, group)
    if all(w == most for w in widths):
        return out
    return torch.cat([out[..., r * most:r * most + w] for r, w in enumerate(widths)], dim=-1)


def cut_cross_entropy(local: Tensor, cut: Cut, vocab: int, target: Tensor, weight: Optional[Tensor] = None,
                      size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
                      reduction: str = "mean", label_smoothing: float = 0.0) -> Optional[Tensor]:
    """``F.cross_entropy`` of logits of which this rank holds the columns ``local``, or None where that does not
    apply (the caller falls back to whole logits): a 2-d input with class-index targets, no ``weight``."""
    if isinstance(target, VocabCut) or not isinstance(target, Tensor):
        return None
    if (local.dim() != 2 or target.dim() != 1 or target.dtype.is_floating_point or weight is not None
            or size_average is not None or reduce is not None or reduction not in ("mean", "sum", "none")):
        return None
    rows = _VocabParallelCrossEntropy.apply(local, target, cut.groups, cut.start, vocab, ignore_index,
                                            float(label_smoothing))
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / (target != ignore_index).sum()


def _reduce(t: Tensor, groups: Sequence[TPGroup], op: Any = torch.distributed.ReduceOp.SUM) -> None:
    if t.is_meta:  # the memory planner runs on the meta device: shapes only
        return
    for group in groups:
        if group.size > 1:
            torch.distributed.all_reduce(t, op=op, group=group.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of logits cut along the vocabulary (this rank: ids ``start .. start + local width``).
    Forward: global max, sum of exponentials and the target's logit all-reduced over the groups; saves this rank's
    softmax (its columns' size, not the whole vocabulary's). Backward: ``softmax - one-hot`` on the columns, no
    communication."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, target: Tensor, groups: Sequence[TPGroup], start: int, vocab: int,
                ignore_index: int, smoothing: float) -> Tensor:
        x = local.float()
        m = x.detach().max(dim=-1).values
        _reduce(m, groups, torch.distributed.ReduceOp.MAX)
        x = x - m.unsqueeze(-1)
        width = x.shape[-1]
        valid = target != ignore_index
        own = (target >= start) & (target < start + width) & valid
        column = (target - start).clamp(0, width - 1)
        picked = x.gather(-1, column.unsqueeze(-1)).squeeze(-1) * own
        _reduce(picked, groups)
        mean_logit = None
        if smoothing:
            mean_logit = x.sum(-1) / vocab
            _reduce(mean_logit, groups)
        x = x.exp_()
        total = x.sum(-1)
        _reduce(total, groups)
        log_z = total.log()
        rows = log_z - picked
        if smoothing:
            rows = (1 - smoothing) * rows + smoothing * (log_z - mean_logit)
        rows = rows * valid
        softmax = x.div_(total.unsqueeze(-1))
        ctx.save_for_backward(softmax, column, own, valid)
        ctx.smoothing, ctx.vocab, ctx.dtype = smoothing, vocab, local.dtype
        return rows.to(local.dtype)

    @staticmethod
    def backward(ctx: Any, grad_rows: Tensor) -> tuple:
        softmax, column, own, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, column.unsqueeze(-1), -(1 - ctx.smoothing) * own.unsqueeze(-1).to(grad.dtype))
        if ctx.smoothing:
            grad.sub_(ctx.smoothing / ctx.vocab)
        grad.mul_((grad_rows.float() * valid).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None, None, None
