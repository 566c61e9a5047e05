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
from lightning_tpp.core.vocab_cut import RESHAPES, Cut, cut_cross_entropy, keeps_last_dim

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


def _follow(func: Any, src: VocabShardedLogits, args: tuple, kwargs: dict, out: Tensor) -> Optional[Tensor]:
    """The same shape operation on the shard, or None where it does not keep the vocabulary as the last dim."""
    if out.dim() == 0 or out.shape[-1] != src.shape[-1]:
        return None
    local = src._tpp_local
    if func in RESHAPES:
        local = local.reshape(*out.shape[:-1], local.shape[-1])
    elif func is Tensor.__getitem__:
        if not keeps_last_dim(args[1], src.dim()):
            return None
        local = local[args[1]]
    else:  # contiguous, float, to
        local = func(local, *args[1:], **kwargs)
    return local if local.shape[:-1] == out.shape[:-1] else None


def _sharded_cross_entropy(input: Tensor, target: Tensor, *args: Any, **kwargs: Any) -> Optional[Tensor]:
    """``F.cross_entropy`` from the shards, or None where that does not apply (the caller falls back)."""
    if not isinstance(input, VocabShardedLogits):
        return None
    if isinstance(target, VocabShardedLogits):
        return None
    group = input._tpp_group
    cut = Cut(((group, (input._tpp_local.shape[-1],) * group.size),), input._tpp_start)
    return cut_cross_entropy(input._tpp_local, cut, input.shape[-1], target, *args, **kwargs)
