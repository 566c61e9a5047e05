"""Dropout inside tensor-parallel blocks: independent masks across tp ranks where the activation is sharded, the same
mask where it is replicated (Megatron's RNG contract), without drawing from or reseeding the user's generators.

Every tp rank holds the same global random state (the user's: one seed, the same draws in the same order). A
replicated activation (a block's input, a row-parallel output) is dropped with the global stream as it is: the same
mask on every tp rank, the replicas stay equal, and the numbers are those one process draws there. A sharded
activation (a column-parallel output, attention heads, and what is computed from them until the row-parallel layer)
is dropped with the strategy's own stream (``core.seeding.OwnStream``): a generator seeded by (the run's seed, the
training batch, the block, where the global generators stood when it was entered, the call, the draw, the tp rank).
Each rank draws the mask of its own part, as one device draws different numbers for different features, and the
global stream is left where it was. A block recomputed in backward (which restores the global state it was entered
with) draws the same masks, and checkpoints need nothing beyond the generator states and the Trainer's progress they
already carry::

    column-parallel output ----> sharded (marked) --(every op)--> sharded ... --> row-parallel output: replicated
    dropout(sharded x)        -> own stream: seed = (run seed, batch, block, global state at entry, call, draw, rank)
    dropout(replicated x)     -> the global stream, as without tensor parallelism

Which values are sharded is followed by a ``TorchFunctionMode`` in the block's training forward, only for blocks
whose first training forward drew dropout at all (``p > 0``): blocks without dropout pay nothing after that call.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_tpp._compat import in_backward
from lightning_tpp.core.seeding import OwnStream, derived_seed, seeded
from lightning_tpp.core.walk import Scoped, tensors_in

# functions that draw a mask over their first argument: (position, keyword, default) of the probability and of the
# training flag (None: always drawing)
_DROPOUTS: dict[Any, tuple[tuple[int, str, float], Optional[tuple[int, str, bool]]]] = {
    **{f: ((1, "p", 0.5), (2, "training", True)) for f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d)},
    **{f: ((1, "p", 0.5), (2, "training", False)) for f in (F.alpha_dropout, F.feature_alpha_dropout)},
    torch.dropout: ((1, "p", 0.5), (2, "train", True)),
    F.scaled_dot_product_attention: ((4, "dropout_p", 0.0), None),
}


def _argument(args: tuple, kwargs: dict, where: tuple[int, str, Any]) -> Any:
    pos, key, default = where
    return args[pos] if len(args) > pos else kwargs.get(key, default)


def _draws(func: Any, args: tuple, kwargs: dict) -> bool:
    p, training = _DROPOUTS[func]
    return float(_argument(args, kwargs, p)) > 0 and (training is None or bool(_argument(args, kwargs, training)))


def _stream_device() -> torch.device:
    """The GPU whose generator dropout over GPU tensors draws from (the CPU alone where CUDA is not in use)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ShardedDraws(TorchFunctionMode):
    """Follows which values of a block's forward are sharded (marked by the column-parallel layers, unmarked by the
    row-parallel ones) and draws dropout over them from this tp rank's stream (see the module docstring)."""

    def __init__(self, tp_rank: int, key: tuple[Any, ...]) -> None:
        super().__init__()
        self.tp_rank, self.key = tp_rank, key  # key: this block call's in the strategy's stream
        self.draws = 0  # sharded draws so far in this call
        self.sharded: dict[int, Tensor] = {}
        self.dropped = False  # a dropout with p > 0 ran (over any value)

    def mark(self, t: Tensor) -> None:
        self.sharded[id(t)] = t

    def unmark(self, t: Tensor) -> None:
        self.sharded.pop(id(t), None)

    def _is_sharded(self, obj: Any) -> bool:
        return any(self.sharded.get(id(t)) is t for t in tensors_in(obj, set()))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUTS and _draws(func, args, kwargs):
            self.dropped = True
            first = args[0] if args else next(iter(kwargs.values()))
            if self._is_sharded(first):
                device = first.device if isinstance(first, Tensor) else torch.device("cpu")
                self.draws += 1
                with seeded(derived_seed(*self.key, self.draws, self.tp_rank), device):
                    out = func(*args, **kwargs)
                for t in tensors_in(out, set()):
                    self.mark(t)
                return out
        out = func(*args, **kwargs)
        if self.sharded and self._is_sharded((args, kwargs)):
            for t in tensors_in(out, set()):
                self.mark(t)
            if args and isinstance(args[0], Tensor) and (out is None or getattr(func, "__name__", "")[-1:] == "_"):
                self.mark(args[0])  # in place
        return out


ACTIVE: Scoped[Optional[ShardedDraws]] = Scoped("lightning_tpp_sharded_draws", None)


@contextlib.contextmanager
def following(tp_rank: int, stream: OwnStream, block: str) -> Iterator[ShardedDraws]:
    """Follow sharded values for the duration of one forward of ``block`` (its name), drawing dropout over them from
    ``stream``."""
    mode = ShardedDraws(tp_rank, stream.enter(block, _stream_device(), recomputing=in_backward()))
    token = ACTIVE.set(mode)
    try:
        with mode:
            yield mode
    finally:
        ACTIVE.reset(token)
        mode.sharded.clear()


def mark_sharded(t: Tensor) -> None:
    mode = ACTIVE.get()
    if mode is not None:
        mode.mark(t)


def mark_replicated(t: Tensor) -> None:
    mode = ACTIVE.get()
    if mode is not None:
        mode.unmark(t)
