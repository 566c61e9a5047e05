"""Context parallelism on an unmodified model's block sequence: each block runs on this rank's positions.

The blocks are the ones the pipeline cuts (``model.layers``, ``transformer.h``; an encoder's and a decoder's stack
each a run). Each block's class is swapped (:class:`_ContextBlock`)::

    first block of a run   its input (the whole sequence, dim 1) cut to this rank's positions (split.SeqLayout)
    every block            its other inputs that carry the sequence cut the same way: rotary tables and position
                           ids (the sequence on dim 1, or dim 0 of a table without batch), a mask's or bias's
                           rows (the sequence on dim -2 of a 4-d tensor; its columns stay every key's), an encoder
                           output of the same length (its keys gathered back in each attention); a 2-d key mask
                           (boolean, or an argument named ``*mask*``) stays whole
                           the block's attention calls run on the whole sequence's keys (attention.ContextAttention)
    last block of a run    its output gathered over cp (backward: summed over cp, see split)

so the embeddings, the head, the user's label shift and loss run on the whole sequence, as in one process, and the
blocks (where the activations are) hold ``1/cp`` of them. A sequence whose length ``2 * cp`` does not divide is
padded at the first block (zeros; padded keys are never read, padded rows are dropped at the gather); under a
pipeline, whose later stages only see a part, it must divide.

What the block's layers record for the model (Hugging Face's output collector: the routers' logits its
load-balancing loss reads) is gathered over cp in each block, so a mixture of experts' loss sees every position.

Refused at setup, naming the module: a layer that mixes positions outside attention (a convolution over the
sequence, as in Mamba's mixer, a recurrent layer, batch normalisation or pooling over it). The first call of each
block checks its output (the stream, and every other tensor it returns) against the original block on the whole
sequence, on every rank, so that what the static look cannot see (attention written as ``matmul -> softmax ->
matmul``, a block that builds its own mask from its input's length, a load-balancing loss computed over the block's
positions and returned beside the stream) fails with its name instead of training on the wrong values.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_tpp._compat import in_backward, tree_flatten, tree_unflatten
from lightning_tpp.context_parallel.attention import ContextAttention, Traffic
from lightning_tpp.context_parallel.hf import route_eager
from lightning_tpp.context_parallel.split import SeqLayout, gather_positions, local_positions
from lightning_tpp.core.comm import TPGroup, all_gather_seq, all_reduce_flag
from lightning_tpp.core.reference import (_records_kept, _verifying, evaluating, first_difference, hidden_state_whole,
                                          isolated, records_gathered)
from lightning_tpp.core.seeding import OwnStream
from lightning_tpp.core.swap import swap_class
from lightning_tpp.core.walk import VERIFYING, ancestors, get_arg, map_first_tensor, replace_arg, stream_index


class ContextParallelError(RuntimeError):
    """A block does not compute on this rank's positions what it computes on the whole sequence."""


@dataclass
class ContextState:
    """What the blocks of one model share: the cp group, the layout of the sequence in flight, the traffic."""

    group: TPGroup
    pipelined: bool  # under a pipeline: later stages see only parts, so the length must divide
    sp: Optional[TPGroup] = None  # sequence parallelism inside: between blocks the stream is cut over tp too
    draws: Optional[OwnStream] = None  # the strategy's own random stream: dropout drawn per cp rank
    eager: list[Any] = field(default_factory=list)  # Hugging Face configs routed to cp's eager attention (hf.py)
    heads: list[str] = field(default_factory=list)  # LM heads computing this rank's vocabulary columns (head.py)
    a2a: bool = False  # cp_mode="a2a": positions exchanged for heads around each SDPA call (attention.py)
    layout: Optional[SeqLayout] = None
    traffic: Traffic = field(default_factory=Traffic)
    _cut: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # side inputs already cut, by identity

    def describe(self, blocks: Optional[int] = None) -> str:
        """The plan table's line."""
        cp = self.group.size
        what = f"{blocks} blocks of this rank" if blocks is not None else "the blocks"
        extra = "; sequence parallelism cuts each part again over tp" if self.sp is not None else ""
        eager = "; Hugging Face eager attention routed to its own function on the whole keys" if self.eager else ""
        heads = (f"; {', '.join(self.heads)}: 1/{cp} of the vocabulary's columns per rank, the logits never whole"
                 if self.heads else "")
        attention = ("every attention on 1/{cp} of the heads over the whole sequence (cp_mode='a2a': all-to-all "
                     "before and after)" if self.a2a else "every attention on the whole sequence's keys (all-gathered, "
                     "gathered again in backward)").format(cp=cp)
        return (f"Context parallelism: cp={cp}: {what} run on 1/{cp} of each sequence's positions (chunks r and "
                f"{2 * cp}-1-r of {2 * cp}: causal work equal on every rank), {attention}{extra}{eager}{heads}")

    def attention(self, layout: SeqLayout) -> ContextAttention:
        """The function mode a block's attention runs under while the block runs on this rank's ``layout``."""
        return ContextAttention(self.group, layout, self.traffic, self.a2a, self.whole_of)

    def begin(self, length: int) -> SeqLayout:
        """The first block of a run sees the whole sequence: its layout."""
        layout = SeqLayout.of(length, self.group.size, self.group.rank)
        if layout.padded != length and self.pipelined:
            works = [length - length % (2 * self.group.size), layout.padded]
            raise ContextParallelError(
                f"context parallelism: a sequence of {length} positions over cp={self.group.size} needs padding to "
                f"{layout.padded} (two chunks per rank: a multiple of 2 * cp = {2 * self.group.size}), and under a "
                f"pipeline the later stages see only parts of it; use a length that 2 * cp divides (e.g. "
                f"{' or '.join(str(w) for w in works if w > 0)})")
        self.layout = layout
        self._cut.clear()
        return layout

    def current(self, held: int) -> SeqLayout:
        """The layout of a later block's input of ``held`` positions (this rank's, or under sequence parallelism
        this tp rank's share of them)."""
        local = held * (self.sp.size if self.sp is not None else 1)
        if self.layout is not None and self.layout.local == local:
            return self.layout
        self.layout = SeqLayout.of(local * self.group.size, self.group.size, self.group.rank)
        return self.layout

    def holds(self, t: Tensor, layout: SeqLayout) -> bool:
        """Whether ``t`` is a block's input or output on this rank's positions (or its tp rank's share of them)."""
        return t.shape[1] == layout.local or self.sp is not None and t.shape[1] * self.sp.size == layout.local

    def whole(self, t: Tensor, layout: SeqLayout) -> Tensor:
        """The whole sequence from every rank's part of a block's input or output (a check: no gradient)."""
        if self.sp is not None and t.shape[1] * self.sp.size == layout.local:
            t = all_gather_seq(t, self.sp, 1)
        return gather_positions(t, 1, layout, self.group)

    def whole_of(self, cut: Tensor) -> Optional[Tensor]:
        """The input a tensor :meth:`cut` returned was cut from (a mask's rows, for ``cp_mode="a2a"``), or None."""
        return next((t for t, out in self._cut.values() if out is cut), None)

    def cut(self, t: Tensor, dim: int, layout: SeqLayout) -> Tensor:
        """``t`` at this rank's positions along ``dim``; the same input of every block cut once per forward."""
        key = id(t)
        hit = self._cut.get(key)
        if hit is not None and hit[0] is t and hit[1].shape[dim] == layout.local:
            return hit[1]
        if len(self._cut) > 64:
            self._cut.clear()
        out = local_positions(t, dim, layout)
        self._cut[key] = (t, out)
        return out


@dataclass
class BlockSlot:
    """The one slot (``_tpp_cp``) a block of the run carries."""

    name: str
    shared: ContextState
    first: bool
    last: bool
    check_pending: bool = True
    compiled: Optional[Callable[..., Any]] = None  # compile=: the block's own forward, compiled (compile_positions)


def _sequence_dim(t: Tensor, length: int, name: str) -> Optional[int]:
    """Where a block's other input carries the sequence of ``length`` (see the module docstring), or None."""
    if t.dim() == 0:
        return None
    key_mask = t.dim() <= 2 and (t.dtype == torch.bool or "mask" in name.lower())
    if t.dim() == 4 and t.shape[-2] == length:
        return 2  # a mask's or bias's rows
    if t.dim() == 2 and t.shape == (length, length):
        return 0  # a (queries, keys) mask or bias without batch: its rows
    if t.dim() >= 2 and t.shape[1] == length and not key_mask:
        return 1
    if t.dim() in (1, 2) and t.shape[0] == length and not key_mask and (t.dim() == 1 or t.shape[1] != length):
        return 0  # a table without batch (rotary frequencies), 1-d positions
    return None


def _cut_inputs(shared: ContextState, args: tuple, kwargs: dict, where: tuple[str, Any], layout: SeqLayout
                ) -> tuple[tuple, dict]:
    def cut(name: str, a: Any) -> Any:
        leaves, spec = tree_flatten(a)
        changed = False
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor):
                dim = _sequence_dim(leaf, layout.length, name)
                if dim is not None:
                    leaves[i] = shared.cut(leaf, dim, layout)
                    changed = True
        return tree_unflatten(leaves, spec) if changed else a

    args = tuple(a if ("arg", i) == where else cut(f"arg{i}", a) for i, a in enumerate(args))
    kwargs = {k: v if ("kw", k) == where else cut(k, v) for k, v in kwargs.items()}
    return args, kwargs


def _private_state(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's arguments for the check's extra forwards (:func:`~lightning_tpp.core.reference.isolated`: its
    containers and stateful objects copied, its tensors shared), each cache among them emptied: what earlier blocks
    put in a key/value cache holds this rank's positions only, which the whole sequence's reference must not read,
    and the real call's cache is left as it was."""
    args, kwargs = isolated(args, kwargs)
    for a in (*args, *kwargs.values()):
        if not isinstance(a, (Tensor, nn.Module)) and callable(getattr(a, "reset", None)):
            a.reset()
    return args, kwargs


def _get_stream(args: tuple, kwargs: dict) -> Optional[Tensor]:
    where = stream_index(args, kwargs)
    return get_arg(args, kwargs, where) if where is not None else None


@contextlib.contextmanager
def _own_draws(block: nn.Module, stream: Optional[Tensor]) -> Iterator[None]:
    """Dropout in a training forward drawn per cp rank: every rank enters a block from the same random state, so
    without this its positions would get the masks another rank's positions get (correlated across the sequence).
    The draws come from a generator seeded by the strategy's own stream (the run's seed, the batch, the block, where
    the global generators stood, this rank): a block recomputed in backward draws the same; the user's generators
    are left where they were (one process would have advanced them by its draws inside the blocks)."""
    slot: BlockSlot = block._tpp_cp  # type: ignore[assignment]
    shared = slot.shared
    if not (block.training and torch.is_grad_enabled() and shared.draws is not None and stream is not None):
        yield
        return
    key = shared.draws.enter(f"cp:{slot.name}", stream.device, recomputing=in_backward())
    seed = int.from_bytes(hashlib.sha256(repr((key, shared.group.rank)).encode()).digest()[:8], "little") >> 1
    devices = [stream.device] if stream.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=stream.device.type if devices else None):
        torch.manual_seed(seed)
        yield


class _ContextBlock:
    """Mixin for each block of a run: on this rank's positions (see the module docstring)."""

    _tpp_cp: BlockSlot

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        slot = self._tpp_cp
        shared = slot.shared
        if VERIFYING.get():  # a check's forward on the whole sequence (a tensor-parallel block checking itself)
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        where = stream_index(args, kwargs)
        if where is None:
            raise ContextParallelError(f"context parallelism: block {slot.name!r} ({type(self).__name__}) was called "
                                       f"without a tensor, so there is no sequence to cut; train it with cp=1")
        stream = get_arg(args, kwargs, where)
        if stream.dim() < 2:
            raise ContextParallelError(f"context parallelism: block {slot.name!r} takes a {stream.dim()}-d input; "
                                       f"it cuts (batch, sequence, ...) along dim 1. Train it with cp=1")
        whole = (args, kwargs)
        if slot.first:
            layout = shared.begin(stream.shape[1])
            args, kwargs = replace_arg(args, kwargs, where, local_positions(stream, 1, layout))
        else:
            layout = shared.current(stream.shape[1])
            hidden_state_whole(stream, lambda t: gather_positions(t, 1, layout, shared.group))
        args, kwargs = _cut_inputs(shared, args, kwargs, where, layout)
        if slot.check_pending and not stream.is_meta:  # not in a shapes-only forward
            slot.check_pending = False
            self._cp_check(whole, args, kwargs, where, layout)  # type: ignore[attr-defined]
        out = self._cp_forward(args, kwargs, layout)
        if slot.last:
            out = map_first_tensor(out, lambda t: gather_positions(t, 1, layout, shared.group))
        return out

    def _cp_forward(self, args: tuple, kwargs: dict, layout: SeqLayout, mode: Optional[ContextAttention] = None
                    ) -> Any:
        shared = self._tpp_cp.shared
        stream = _get_stream(args, kwargs)
        with mode or shared.attention(layout), \
                _own_draws(self, stream), records_gathered(  # type: ignore[arg-type]
                    None if stream is None else stream.shape[0], layout.local, layout.length,
                    lambda t: gather_positions(t, 1, layout, shared.group)):
            out = (self._tpp_cp.compiled or super().forward)(*args, **kwargs)  # type: ignore[misc]
        return out

    @torch.compiler.disable  # compile=: runs eagerly, outside the block's graph
    def _cp_check(self, whole: tuple[tuple, dict], args: tuple, kwargs: dict, where: tuple[str, Any],
                  layout: SeqLayout) -> None:
        """This block on this rank's positions against the original block on the whole sequence (eval mode, no
        gradient), agreed over cp; raises on every cp rank when any differs. The block's own forward runs as in
        training (what it holds checks itself there); only the reference is a verifying forward."""
        slot = self._tpp_cp
        group = slot.shared.group
        stream = get_arg(args, kwargs, where)
        problem, raised, beside = None, False, False
        mode = slot.shared.attention(layout)  # kept after a raise: what it took over says why
        try:  # what the layers record for the model (router logits) is dropped after: the real call records its own
            with torch.no_grad(), evaluating(self), _records_kept():  # type: ignore[arg-type]
                w_args, w_kwargs = _private_state(*whole)
                args, kwargs = _private_state(args, kwargs)
                if not slot.first:  # the whole sequence from every rank's part
                    w_args, w_kwargs = _whole_rows(*replace_arg(w_args, w_kwargs, where,
                                                                slot.shared.whole(stream, layout)), layout, group)
                with _verifying():
                    want = super().forward(*w_args, **w_kwargs)  # type: ignore[misc]
                got = self._cp_forward(args, kwargs, layout, mode)
                problem, beside = _compare(slot.shared, got, want, layout)
        except ContextParallelError:
            raise
        except Exception as err:  # noqa: BLE001 - reported on every rank below, with the block's name
            problem, raised = f"{type(err).__name__}: {err}", True
        if all_reduce_flag(problem is None, group.group):
            return
        if mode.products:
            hint = ("its attention (matmul -> softmax -> matmul) was given every position's keys and values, but "
                    "a mask or bias it builds from its input's length (a causal buffer cut to [:T, :T]) covers this "
                    "rank's positions only: pass the mask in from outside the block, or call "
                    "F.scaled_dot_product_attention(is_causal=True)")
        elif raised:
            hint = "it raised on this rank's positions, where it ran on the whole sequence"
        elif beside:
            hint = ("besides its output stream it returns a value computed over all of its positions (a router's "
                    "load-balancing loss, a statistic over the tokens), which this rank computes over its own "
                    "positions only; compute it outside the blocks from per-position values (Hugging Face's recorded "
                    "router logits are gathered over cp for its loss), or record it as transformers records router "
                    "logits")
        elif mode.taken == 0:
            hint = ("no attention call that cp takes over ran in it (scaled_dot_product_attention, "
                    "nn.MultiheadAttention, Hugging Face's sdpa or eager, or a matmul of this rank's rows with its "
                    "keys), so its attention saw this rank's keys only: load the model with "
                    "attn_implementation='sdpa', or call F.scaled_dot_product_attention")
        else:
            hint = ("its own code probably mixes positions outside its attention (a scan, a convolution or a pooling "
                    "over the sequence) or builds a mask or a position bias from its input's length")
        raise ContextParallelError(
            f"context parallelism: block {slot.name!r} ({type(self).__name__}) does not compute on this rank's "
            f"{layout.local} of {layout.length} positions what it computes on the whole sequence "
            f"({problem or 'on another cp rank'}): {hint}. Train it with cp=1")


def compile_positions(block: nn.Module, compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """``compile=`` on a block that runs on this rank's positions: its own forward compiled, run inside what the
    block does around it (the inputs cut, the attention's function mode entered, dropout drawn per rank, the
    records gathered), which stays eager, outside the graph (traced, each of those broke it: about 55 breaks for
    two Llama blocks). Returns whether ``block`` is such a block."""
    if not isinstance(block, _ContextBlock):
        return False
    block._tpp_cp.compiled = compile_fn(super(_ContextBlock, block).forward)
    return True


def _whole_rows(args: tuple, kwargs: dict, layout: SeqLayout, group: TPGroup) -> tuple[tuple, dict]:
    """A later block's inputs for its check's reference: a bias an earlier block of the run made for this rank's rows
    against every key (T5's relative position bias, passed on from its first block) with every rank's rows."""
    def whole(a: Any) -> Any:
        leaves, spec = tree_flatten(a)
        return tree_unflatten([gather_positions(t, 2, layout, group) if isinstance(t, Tensor) and t.dim() == 4 and
                               t.shape[-2:] == (layout.local, layout.length) else t for t in leaves], spec)

    return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}


def _compare(shared: ContextState, got: Any, want: Any, layout: SeqLayout) -> tuple[Optional[str], bool]:
    """The first difference between a block's output on this rank's positions and the original's on the whole
    sequence (None when alike), and whether it is in a tensor beside the stream. The stream (the first tensor) is
    compared whole; each other tensor whole when it carries this rank's positions (dim 1), as it is when its shape is
    the original's (a scalar such as a load-balancing loss carried from block to block); others are not compared."""
    got_t = [t for t in tree_flatten(got)[0] if isinstance(t, Tensor)]
    want_t = [t for t in tree_flatten(want)[0] if isinstance(t, Tensor)]
    if not got_t or not want_t:
        return "its output holds no tensor", False
    if got_t[0].dim() < 2 or not shared.holds(got_t[0], layout):
        return f"its output has shape {tuple(got_t[0].shape)}, not this rank's {layout.local} positions", False
    problem = first_difference(shared.whole(got_t[0], layout), want_t[0], shared.group)
    if problem is not None:
        return problem, False
    for i, (g, w) in enumerate(zip(got_t[1:], want_t[1:]), 1):
        if g.dim() >= 2 and w.dim() >= 2 and g.shape != w.shape and shared.holds(g, layout) \
                and w.shape[1] == layout.length:
            g = shared.whole(g, layout)
        if g.shape == w.shape:
            problem = first_difference(g, w, shared.group, f"the tensor {i} of its output (shape {tuple(w.shape)})")
            if problem is not None:
                return problem, True
    return None, False


class _ContextTwin:
    """Mixin for the meta twin of a block another pipeline rank holds: the shapes of the real block in the run
    (a part in, a part out; the whole sequence into the first block and out of the last)."""

    _tpp_cp_twin: tuple[int, bool, bool]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        cp, first, last = self._tpp_cp_twin
        where = stream_index(args, kwargs)
        if where is None:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        if not first:
            x = get_arg(args, kwargs, where)
            args, kwargs = replace_arg(args, kwargs, where, torch.cat([x] * cp, dim=1))
        out = super().forward(*args, **kwargs)  # type: ignore[misc]
        if not last:
            out = map_first_tensor(out, lambda t: t.narrow(1, 0, t.shape[1] // cp))
        return out


_SEQUENCE_MIXERS: tuple[tuple[type, str], ...] = (
    (nn.Conv1d, "a convolution over the sequence"),
    (nn.RNNBase, "a recurrent layer over the sequence"),
    (nn.modules.batchnorm._BatchNorm, "batch normalisation (statistics over the sequence)"),
    (nn.modules.pooling._MaxPoolNd, "pooling over the sequence"),
    (nn.modules.pooling._AvgPoolNd, "pooling over the sequence"),
)


def mixing_layers(module: nn.Module, blocks: Sequence[str]) -> list[str]:
    """The layers of ``blocks`` that mix positions outside attention, each as ``name (Class): what it does``."""
    found = []
    for block in blocks:
        for name, m in module.get_submodule(block).named_modules():
            what = next((w for kind, w in _SEQUENCE_MIXERS if isinstance(m, kind)), None)
            if what is None:
                continue
            owner = module.get_submodule(block + ("." + name.rpartition(".")[0] if "." in name else ""))
            if isinstance(m, nn.Conv1d) and any(n in dict(owner.named_parameters(recurse=False))
                                                 for n in ("A_log", "A", "dt_bias")):
                what += " and a state-space scan (a Mamba-style mixer)"
            found.append(f"{block}.{name} ({type(m).__name__}): {what}")
    return found


def apply_context_parallel(module: nn.Module, runs: list[list[str]], group: TPGroup, *, pipelined: bool,
                           local_names: Optional[set[str]] = None, twins: Optional[dict[str, nn.Module]] = None,
                           verify: bool = True, sp: Optional[TPGroup] = None, draws: Optional[OwnStream] = None,
                           a2a: bool = False) -> ContextState:
    """Put the blocks of each run (block names in forward order) on this rank's positions; ``local_names``: the
    blocks this pipeline rank holds (the others are stand-ins whose meta ``twins`` get the run's shapes); ``sp``:
    the tp group when sequence parallelism cuts this rank's positions again inside the blocks; ``draws``: the
    strategy's own random stream (dropout per cp rank); ``a2a``: ``cp_mode="a2a"``."""
    shared = ContextState(group, pipelined, sp, draws, a2a=a2a)
    modules = dict(module.named_modules())
    here = [n for names in runs for n in names if n in modules and (local_names is None or any(
        a in local_names for a in ancestors(n) + [n]))]
    shared.eager = route_eager(module, here)  # Hugging Face eager attention: its own function on the whole keys
    for names in runs:
        for i, name in enumerate(names):
            first, last = i == 0, i == len(names) - 1
            twin_of = next((n for n in reversed(ancestors(name) + [name]) if n in (twins or {})), None)
            if twin_of is not None:
                twin = twins[twin_of].get_submodule(name[len(twin_of) + 1:]) if name != twin_of else twins[twin_of]
                twin._tpp_cp_twin = (group.size, first, last)
                swap_class(twin, _ContextTwin)
            owner = next((n for n in reversed(ancestors(name) + [name]) if n in (local_names or ())), None)
            if local_names is not None and owner is None:
                continue
            block = modules[name]
            block._tpp_cp = BlockSlot(name, shared, first, last, check_pending=verify)
            swap_class(block, _ContextBlock)
    return shared
