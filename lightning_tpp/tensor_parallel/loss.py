"""Loss parallelism: ``F.cross_entropy`` on the vocabulary shards of a tensor-parallel LM head, whole logits elsewhere.

An LM head the plan cuts along the vocabulary (``colwise_gather``) all-gathers its logits, because the user's code
may read them whole (argmax, sampling, metrics). When those logits only feed ``F.cross_entropy`` (what a
``training_step`` or a Hugging Face model's own loss does), whole logits cost memory for nothing: the cross-entropy
saves its log-softmax over the whole vocabulary for backward, and backward makes a gradient of the whole logits
before keeping this rank's slice of it.

So the gathered logits come back as :class:`VocabShardedLogits`, an ordinary tensor (same values, same autograd
history; every other use sees whole logits) that remembers this rank's shard. Shape operations that keep the
vocabulary as the last dimension (``view``/``reshape``/``flatten`` of the leading dimensions, slicing them, ``float``,
``to``, ``contiguous``) keep that link; ``F.cross_entropy`` of such a tensor with class-index targets is computed
from the shards (Megatron's vocab-parallel cross-entropy: a max, a sum of exponentials and the target's logit
all-reduced over tp), so backward flows into the head's shard directly. This is torch's ``loss_parallel`` without
the context manager: nothing in the user's code changes. A ``weight``, probabilities as targets or a class dimension
other than the last fall back to the whole-logits cross-entropy.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_tpp.core.comm import TPGroup

_SHAPE_METHODS = {Tensor.view, Tensor.reshape, Tensor.flatten, Tensor.contiguous, Tensor.float, Tensor.to,
                  Tensor.__getitem__, torch.reshape, torch.flatten}


class VocabShardedLogits(Tensor):
    """Whole logits of a vocabulary-parallel head that remember this rank's shard (see the module docstring)."""

    _tpp_local: Tensor
    _tpp_group: TPGroup
    _tpp_start: int

    @staticmethod
    def wrap(whole: Tensor, local: Tensor, group: TPGroup, start: int) -> "VocabShardedLogits":
        out = whole.as_subclass(VocabShardedLogits)
        out._tpp_local, out._tpp_group, out._tpp_start = local, group, start
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save`` of a prediction, a tensor sent to another process) as the plain tensor it is: the
        link to this rank's shard and process group means nothing elsewhere."""
        return self.as_subclass(Tensor).__reduce_ex__(protocol)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func is F.cross_entropy:
                loss = _sharded_cross_entropy(*args, **kwargs)
                if loss is not None:
                    return loss
            out = func(*args, **kwargs)
            src = args[0] if args and isinstance(args[0], VocabShardedLogits) else None
            if src is not None and func in _SHAPE_METHODS and isinstance(out, Tensor):
                local = _follow(func, src, args, kwargs, out)
                if local is not None:
                    return VocabShardedLogits.wrap(out, local, src._tpp_group, src._tpp_start)
        return out


def _keeps_last_dim(index: Any, ndim: int) -> bool:
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


def _follow(func: Any, src: VocabShardedLogits, args: tuple, kwargs: dict, out: Tensor) -> Optional[Tensor]:
    """The same shape operation on the shard, or None where it does not keep the vocabulary as the last dim."""
    if out.dim() == 0 or out.shape[-1] != src.shape[-1]:
        return None
    local = src._tpp_local
    if func in (Tensor.view, Tensor.reshape, Tensor.flatten, torch.reshape, torch.flatten):
        local = local.reshape(*out.shape[:-1], local.shape[-1])
    elif func is Tensor.__getitem__:
        if not _keeps_last_dim(args[1], src.dim()):
            return None
        local = local[args[1]]
    else:  # contiguous, float, to
        local = func(local, *args[1:], **kwargs)
    return local if local.shape[:-1] == out.shape[:-1] else None


def _sharded_cross_entropy(input: Tensor, target: Tensor, weight: Optional[Tensor] = None,
                           size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
                           reduction: str = "mean", label_smoothing: float = 0.0) -> Optional[Tensor]:
    """``F.cross_entropy`` from the shards, or None where that does not apply (the caller falls back)."""
    if not isinstance(input, VocabShardedLogits) or isinstance(target, VocabShardedLogits):
        return None
    if (input.dim() != 2 or target.dim() != 1 or target.dtype.is_floating_point or weight is not None
            or size_average is not None or reduce is not None or reduction not in ("mean", "sum", "none")):
        return None
    local = input._tpp_local
    rows = _VocabParallelCrossEntropy.apply(local, target, input._tpp_group, input._tpp_start, input.shape[-1],
                                            ignore_index, float(label_smoothing))
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / (target != ignore_index).sum()


def _reduce(t: Tensor, group: TPGroup, op: Any = torch.distributed.ReduceOp.SUM) -> None:
    if not t.is_meta:  # the memory planner runs on the meta device: shapes only
        torch.distributed.all_reduce(t, op=op, group=group.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of logits cut along the vocabulary (this rank: ids ``start .. start + local width``).
    Forward: global max, sum of exponentials and the target's logit all-reduced over tp; saves this rank's softmax
    (its shard's size, not the whole vocabulary's). Backward: ``softmax - one-hot`` on the shard, no communication."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, target: Tensor, group: TPGroup, start: int, vocab: int,
                ignore_index: int, smoothing: float) -> Tensor:
        x = local.float()
        x = x - _max_over(x, group).unsqueeze(-1)
        width = x.shape[-1]
        valid = target != ignore_index
        own = (target >= start) & (target < start + width) & valid
        column = (target - start).clamp(0, width - 1)
        picked = x.gather(-1, column.unsqueeze(-1)).squeeze(-1) * own
        _reduce(picked, group)
        mean_logit = None
        if smoothing:
            mean_logit = x.sum(-1) / vocab
            _reduce(mean_logit, group)
        x = x.exp_()
        total = x.sum(-1)
        _reduce(total, group)
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


def _max_over(x: Tensor, group: TPGroup) -> Tensor:
    m = x.detach().max(dim=-1).values
    _reduce(m, group, torch.distributed.ReduceOp.MAX)
    return m
