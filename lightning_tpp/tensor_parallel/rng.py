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

Under ``compile=`` the same masks are drawn inside the block's graph, with no graph break: the call's key and each
mask come from custom operators (``lightning_tpp::stream_key``, ``lightning_tpp::sharded_noise``), which dynamo
keeps as they are and which run eagerly inside the graph. A dropout is the product of its input with the noise the
same function draws over ones from the same seed (the very numbers the eager draw multiplies by); a
``scaled_dot_product_attention`` with dropout over this rank's heads is one operator whose backward computes the
attention again from the same seed (``lightning_tpp::sharded_attention``), so it saves its inputs, not the
probabilities."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_tpp._compat import in_backward
from lightning_tpp.core.seeding import OwnStream, calls_kept, derived_seed, seeded, stream_by_handle
from lightning_tpp.core.walk import CONTEXT_ATTENTION, Scoped

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


@torch.library.custom_op("lightning_tpp::stream_key", mutates_args=("keyed",))
def _stream_key(keyed: Tensor, stream: int, block: str, device: str) -> Tensor:
    """The key of this call of ``block`` in the strategy's stream (``OwnStream.enter``, which reads where the global
    generators stand and counts the call), as a seed in a tensor. ``keyed`` counts the keys: an operator that changes
    a tensor is neither merged with another call's nor recomputed by the compiler."""
    keyed.add_(1)
    key = stream_by_handle(stream).enter(block, torch.device(device), recomputing=in_backward())
    return torch.tensor(derived_seed(*key), dtype=torch.int64)


@_stream_key.register_fake
def _(keyed: Tensor, stream: int, block: str, device: str) -> Tensor:
    return torch.empty((), dtype=torch.int64)


def _draw_seed(key: Tensor, draw: int, rank: int) -> int:
    return derived_seed(int(key), draw, rank)


# the dropouts drawn inside a compiled graph: each one's noise is its function applied to ones
_NOISE = {"dropout": F.dropout, "dropout1d": F.dropout1d, "dropout2d": F.dropout2d, "dropout3d": F.dropout3d}
_NOISE_OF = {F.dropout: "dropout", torch.dropout: "dropout", F.dropout1d: "dropout1d", F.dropout2d: "dropout2d",
             F.dropout3d: "dropout3d"}


@torch.library.custom_op("lightning_tpp::sharded_noise", mutates_args=())
def _sharded_noise(x: Tensor, key: Tensor, draw: int, rank: int, kind: str, p: float) -> Tensor:
    """What dropout ``kind`` multiplies ``x`` by (0 or 1 / (1 - p)), drawn from this tp rank's seed for the draw: the
    eager draw under that seed multiplies by the same numbers."""
    with seeded(_draw_seed(key, draw, rank), x.device):
        return _NOISE[kind](torch.ones_like(x), p, True)


@_sharded_noise.register_fake
def _(x: Tensor, key: Tensor, draw: int, rank: int, kind: str, p: float) -> Tensor:
    return torch.empty_like(x)


def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], dropout_p: float, is_causal: bool,
               scale: Optional[float], enable_gqa: bool) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=enable_gqa)


@torch.library.custom_op("lightning_tpp::sharded_attention", mutates_args=())
def _sharded_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], dropout_p: float, is_causal: bool,
                       scale: Optional[float], enable_gqa: bool, key: Tensor, draw: int, rank: int) -> Tensor:
    """``scaled_dot_product_attention`` with its dropout drawn from this tp rank's seed for the draw."""
    with seeded(_draw_seed(key, draw, rank), q.device):  # (contiguous, as its fake: the graph reads its strides)
        return _attention(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa).contiguous()


@_sharded_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], dropout_p: float, is_causal: bool,
      scale: Optional[float], enable_gqa: bool, key: Tensor, draw: int, rank: int) -> Tensor:
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.custom_op("lightning_tpp::sharded_attention_backward", mutates_args=())
def _sharded_attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                                dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool,
                                key: Tensor, draw: int, rank: int, mask_grad: bool) -> list[Tensor]:
    """The gradients of q, k, v (and of the mask where it needs one): the attention computed again from the same
    seed, so with the same dropout mask, and differentiated."""
    def attention(*inputs: Tensor) -> Tensor:
        return _attention(*inputs[:3], inputs[3] if mask_grad else mask, dropout_p, is_causal, scale, enable_gqa)

    with seeded(_draw_seed(key, draw, rank), q.device):  # (an operator runs below autograd: torch.func's vjp)
        _, vjp = torch.func.vjp(attention, q, k, v, *((mask,) if mask_grad else ()))
        return [g.contiguous() for g in vjp(grad)]


@_sharded_attention_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], dropout_p: float, is_causal: bool,
      scale: Optional[float], enable_gqa: bool, key: Tensor, draw: int, rank: int, mask_grad: bool) -> list[Tensor]:
    return [t.new_empty(t.shape) for t in (q, k, v, *((mask,) if mask_grad else ()))]


def _attention_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
    q, k, v, mask, *rest = inputs
    ctx.save_for_backward(q, k, v, mask, rest[-3])
    ctx.rest = rest[:-3]
    ctx.where = rest[-2:]
    ctx.mask_grad = mask is not None and ctx.needs_input_grad[3]


def _attention_backward(ctx: Any, grad: Tensor) -> tuple:
    q, k, v, mask, key = ctx.saved_tensors
    grads = torch.ops.lightning_tpp.sharded_attention_backward(grad, q, k, v, mask, *ctx.rest, key, *ctx.where,
                                                                ctx.mask_grad)
    return (*grads[:3], grads[3] if ctx.mask_grad else None, *(None,) * 7)


_sharded_attention.register_autograd(_attention_backward, setup_context=_attention_context)


def _traced_draw(func: Any, args: tuple, kwargs: dict, key: Tensor, draw: int, rank: int) -> Any:
    """A dropout over shards inside a graph being compiled (``compile=``): the masks the eager draw gets, from the
    operators above. None for a function they do not cover (an alpha dropout), which then draws eagerly."""
    if func is F.scaled_dot_product_attention:
        if CONTEXT_ATTENTION.get() is not None:  # context parallelism takes the call (and runs it eagerly)
            return None
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        given = {**dict(zip(names, args)), **kwargs}
        return torch.ops.lightning_tpp.sharded_attention(
            given["query"], given["key"], given["value"], given.get("attn_mask"), float(given["dropout_p"]),
            bool(given.get("is_causal", False)), given.get("scale"), bool(given.get("enable_gqa", False)), key, draw,
            rank)
    kind = _NOISE_OF.get(func)
    if kind is None:
        return None
    x = args[0] if args else kwargs["input"]
    noise = torch.ops.lightning_tpp.sharded_noise(x.detach(), key, draw, rank, kind, float(_argument(
        args, kwargs, _DROPOUTS[func][0])))
    return x.mul_(noise) if func is not torch.dropout and _argument(args, kwargs, (3, "inplace", False)) else x * noise


@torch.compiler.disable  # compile=: a dropout the operators above do not cover draws eagerly, between graphs
def _eager_draw(func: Any, args: tuple, kwargs: dict, key: Tensor, draw: int, rank: int, device: torch.device) -> Any:
    token = _DRAWING.set(True)  # a mode further out (sequence parallelism's, around a tp block's) draws nothing more
    try:
        with seeded(_draw_seed(key, draw, rank), device):
            return func(*args, **kwargs)
    finally:
        _DRAWING.reset(token)


_DRAWING: Scoped[bool] = Scoped("lightning_tpp_drawing", False)


class ShardedDraws(TorchFunctionMode):
    """Follows which values of a block's forward are sharded (marked by the column-parallel layers, unmarked by the
    row-parallel ones) and draws dropout over them from this tp rank's stream (see the module docstring)."""

    def __init__(self, tp_rank: int, key: Tensor, outer: Optional["ShardedDraws"] = None) -> None:
        super().__init__()
        self.tp_rank, self.key = tp_rank, key  # key: this block call's seed in the strategy's stream
        self.outer = outer  # the block call followed around this one (sequence parallelism's, around a tp block's)
        self.draws = 0  # sharded draws so far in this call
        # the sharded values: by id eagerly, in a list compared by identity inside a graph being compiled (an id
        # there is a guard on the object, or a made-up one that cannot cross a graph break)
        self.sharded: dict[int, Tensor] = {}
        self.traced: list[Tensor] = []
        self.dropped = False  # a dropout with p > 0 ran (over any value)

    def mark(self, t: Tensor) -> None:
        if torch.compiler.is_compiling():
            # an autograd.Function's forward (run without gradients; a subgraph of its own to dynamo, which refuses
            # what it makes to be kept outside it): its output is marked where it is used, by the layer that called it
            if torch.is_grad_enabled():
                self.traced.append(t)
        else:
            self.sharded[id(t)] = t

    def mark_input(self, t: Tensor) -> None:
        """``t``, an input of the call followed (marked before it, outside any graph), is sharded: kept in the list a
        compiled call compares by identity, which then guards on the list's length, not on an id."""
        self.traced.append(t)

    def unmark(self, t: Tensor) -> None:
        if self.traced:
            self.traced = [s for s in self.traced if s is not t]
        if not torch.compiler.is_compiling():
            self.sharded.pop(id(t), None)

    def _following(self) -> bool:
        """Whether anything is marked (inside a graph, in the list alone: the graph reads nothing of the dict, which
        eager calls around it fill with their own ids)."""
        return bool(self.traced) or (not torch.compiler.is_compiling() and bool(self.sharded))

    def _is_sharded(self, obj: Any) -> bool:
        found = _tensors(obj)
        if any(t is s for t in found for s in self.traced):
            return True
        return not torch.compiler.is_compiling() and any(self.sharded.get(id(t)) is t for t in found)

    def clear(self) -> None:
        self.sharded.clear()
        self.traced = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUTS and not _DRAWING.get() and _draws(func, args, kwargs):
            self.dropped = True
            first = args[0] if args else next(iter(kwargs.values()))
            if self._is_sharded(first):
                device = first.device if isinstance(first, Tensor) else torch.device("cpu")
                self.draws += 1
                out = _traced_draw(func, args, kwargs, self.key, self.draws, self.tp_rank) \
                    if torch.compiler.is_compiling() else None
                if out is None:
                    out = _eager_draw(func, args, kwargs, self.key, self.draws, self.tp_rank, device)
                for t in _tensors(out):
                    self.mark(t)
                return out
        out = func(*args, **kwargs)
        if self._following() and self._is_sharded((args, kwargs)):
            for t in _tensors(out):
                self.mark(t)
            if args and isinstance(args[0], Tensor) and (out is None or getattr(func, "__name__", "")[-1:] == "_"):
                self.mark(args[0])  # in place
        return out


def _tensors(obj: Any, depth: int = 0) -> list[Tensor]:
    """The tensors of a torch function's arguments or result: in tuples, lists and dicts (no object is walked, and no
    id taken: ``torch.compile`` traces this for every call inside a block)."""
    if isinstance(obj, Tensor):
        return [obj]
    if depth > 4:
        return []
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v, depth + 1)]
    return []


ACTIVE: Scoped[Optional[ShardedDraws]] = Scoped("lightning_tpp_sharded_draws", None)


@contextlib.contextmanager
def following(tp_rank: int, stream: OwnStream, block: str) -> Iterator[ShardedDraws]:
    """Follow sharded values for the duration of one forward of ``block`` (its name), drawing dropout over them from
    ``stream``."""
    if not stream.device:  # (at the first call, eager: a compiled one then reads a string, not CUDA's state)
        stream.device = str(_stream_device())
    key = torch.ops.lightning_tpp.stream_key(stream.keyed, stream.handle, block, stream.device)
    mode = ShardedDraws(tp_rank, key, ACTIVE.get())
    token = ACTIVE.set(mode)
    try:
        with mode:
            yield mode
    finally:
        ACTIVE.reset(token)
        mode.clear()


def _followed() -> list[ShardedDraws]:
    """The block calls being followed, innermost first (a tp block's, then the sequence-parallel block's around it)."""
    modes, mode = [], ACTIVE.get()
    while mode is not None:
        modes.append(mode)
        mode = mode.outer
    return modes


@contextlib.contextmanager
def own_draws_kept() -> Iterator[Callable[[], None]]:
    """The strategy's own draws as they were after (and in between, by the function given): every stream's count of
    calls, and the draws and marks of the block calls being followed. A check's extra calls of a block then draw the
    masks the step's call draws, and leave it nothing of theirs (a compiled call would guard on them)."""
    modes = [(mode, mode.draws, dict(mode.sharded), list(mode.traced)) for mode in _followed()]
    with calls_kept() as recount:
        def restore() -> None:
            recount()
            for mode, draws, sharded, traced in modes:
                mode.draws, mode.sharded, mode.traced = draws, dict(sharded), list(traced)

        try:
            yield restore
        finally:
            restore()


def copies_followed(originals: list, copies: list) -> None:
    """A check's copies of a call's inputs (``copies``, each in the place of its original in ``originals``) stand
    for them in the block calls being followed: a marked input's copy is sharded too. (:func:`own_draws_kept` puts
    the originals back.)"""
    swap = [(o, c) for o, c in zip(originals, copies)
            if isinstance(o, Tensor) and isinstance(c, Tensor) and o.shape == c.shape]
    for mode in _followed():
        mode.traced = [next((c for o, c in swap if o is t), t) for t in mode.traced]
        for o, c in swap:
            if mode.sharded.get(id(o)) is o:
                del mode.sharded[id(o)]
                mode.sharded[id(c)] = c


def mark_sharded(t: Tensor) -> None:
    """``t`` is this rank's part (a column-parallel output, this rank's heads, its part of the sequence), for every
    block call being followed: a tensor-parallel block's and the sequence-parallel block around it. (Each also
    follows what every operation computes from its marks, but not through an autograd.Function under ``compile=``:
    a row layer's reduce-scatter is one.)"""
    for mode in _followed():
        mode.mark(t)


def mark_replicated(t: Tensor) -> None:
    for mode in _followed():
        mode.unmark(t)
