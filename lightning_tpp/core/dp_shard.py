"""Parameter utilities for a tensor that may be sharded over the data-parallel ranks (a ``Shard(0)`` DTensor that
FSDP2 made of a tensor-parallel shard): this rank's part, the whole shard gathered over dp, a value cut as another
tensor is, and FSDP2's generated unit classes hidden for a ``deepcopy``. Applying FSDP2 (which units, the vocabulary
matrices computed over dp, where the forward reads each parameter) is ``data_parallel.fsdp``'s."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_tpp._compat import fsdp_state


def is_dp_sharded(t: Any) -> bool:
    return isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """This rank's part of a dp-sharded tensor (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def gather_dp(t: Tensor) -> Tensor:
    """The tensor-parallel shard this dp-sharded tensor is a part of (collective over dp); others as they are."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_dp_like(value: Tensor, like: Tensor) -> Tensor:
    """``value`` (what ``gather_dp(like)`` returns) cut as ``like`` is: this rank's part as a DTensor; no collective."""
    if not isinstance(like, DTensor):
        return value
    return distribute_tensor(value.to(device=like.device), like.device_mesh, like.placements, src_data_rank=None)


@contextlib.contextmanager
def fsdp_classes_hidden(module: nn.Module) -> Iterator[dict[int, Any]]:
    """``fully_shard`` makes each unit an instance of a generated ``FSDP<Class>``, which refuses ``deepcopy``: for
    the duration, the units are instances of their own class again (e.g. to copy a block for a numerical check).
    Yields a ``deepcopy`` memo that shares (does not copy) the units' FSDP states, which hold process groups."""
    from torch.distributed.fsdp import FSDPModule

    swapped, memo = [], {}
    for m in module.modules():
        cls = type(m)
        if isinstance(m, FSDPModule):
            state = fsdp_state(m)
            memo[id(state)] = state
            m.__class__ = next(b for b in cls.__bases__ if b is not FSDPModule)
            swapped.append((m, cls))
    try:
        yield memo
    finally:
        for m, cls in swapped:
            m.__class__ = cls
