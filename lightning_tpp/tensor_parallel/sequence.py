"""Sequence parallelism (``sequence_parallel=True``): Megatron-SP on an unmodified model's block sequence.

Between tensor-parallel blocks the residual stream is replicated on every tp rank, so norms, dropout and residual
adds store ``tp`` copies of the same activations. Here the blocks of the model's block sequence (the same one the
pipeline cuts: ``transformer.h``, ``model.layers``) run on sequence shards instead, cut along dim 1::

    first block's input      scatter_seq            (B, S, D) -> (B, S/tp, D)      backward: all-gather
    tensor-parallel block    gather_seq its inputs  (B, S/tp, D) -> (B, S, D)      backward: reduce-scatter *
      ... its row layers     reduce_scatter_seq     instead of the all-reduce       backward: all-gather
    last block's output      gather_seq             (B, S/tp, D) -> (B, S, D)      backward: keep this part

(*) of what the column-parallel layers read straight from the gathered input; other uses of it inside the block
(a residual there) ran replicated and keep their part of the gradient.
So a block costs what tensor parallelism costs (an all-gather and a reduce-scatter move the bytes of one all-reduce)
and everything outside the tensor-parallel blocks holds ``1/tp`` of the activations. Which inputs of a
tensor-parallel block are the stream: the tensors of exactly the shape of the block's input shard (masks and rotary
tables, computed by the model from the whole sequence, are left alone).

A block whose own forward holds its projections (no attention or MLP submodule) is gathered at its entry and cut at
its exit; its row layers all-reduce. Parameters used on shards (norms, the biases added after a reduce-scatter) get a
partial gradient on each tp rank: :func:`sum_partial_gradients` adds them up before the optimizer steps. A block's
other inputs that need a gradient (a conditioning vector) are summed over tp at its entry; what its tensor-parallel
blocks compute from them whole (the same on every rank) enters that sum divided by tp.

The first call of each block checks it numerically: its sequence-parallel output against the original block (whole
weights, whole sequence) on the same inputs, so that a block whose own code reads the sequence length, or an
attention left whole, fails with a message instead of training on the wrong values; its first training call
checks the gradients of its inputs and parameters the same way. A parameter inside a tensor-parallel block whose
gradient there is each rank's part of the original's (a norm after an MLP's row layer, which runs on the
reduce-scattered shard; a per-head norm) is added to the element's ``partial`` parameters, summed over tp like the
rest; one that matches neither way is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_tpp.core.comm import TPGroup, copy_to_tp, gather_seq, scatter_seq
from lightning_tpp.core.dp_shard import local
from lightning_tpp.core.grads import all_reduce_coalesced
from lightning_tpp.core.params import ShardIndex
from lightning_tpp.core.reference import (
    Mismatch,
    check_forward,
    check_gradients,
    first_difference,
    hidden_state_whole,
    records_gathered,
    summed,
    whole_or_part,
)
from lightning_tpp.core.swap import swap_class
from lightning_tpp.core.walk import VERIFYING, ancestors, get_arg, map_first_tensor, replace_arg, stream_index
from lightning_tpp.tensor_parallel.layers import _RowParallel
from lightning_tpp.tensor_parallel.rng import following
from lightning_tpp.tensor_parallel.sequence_region import sequence_region


class SequenceParallelError(RuntimeError):
    """A block does not compute on sequence shards what it computes on the whole sequence."""


@dataclass
class ElementState:
    """The one slot (``_tpp_sp``) a block of the sequence carries."""

    name: str
    group: TPGroup
    shards: ShardIndex
    first: bool  # its input is the whole sequence: cut it
    last: bool  # its output leaves the region: gather it
    flat: bool  # it is itself a tensor-parallel block (its projections are its own children)
    recomputed: bool = False  # under activation checkpointing (which saves nothing in its forward)
    draws: Optional[bool] = None  # whether its training forward drew dropout (None: not run in training yet)
    verify_pending: bool = True
    grads_pending: bool = True  # the gradient check, at the first call that trains (not under a no-grad sanity check)
    partial: list[tuple[nn.Module, str]] = field(default_factory=list)  # parameters with per-rank partial grads
    ran: bool = False  # has run on shards (a block never called, whose submodules are, would not)
    warned: bool = False
    compiled: Optional[Callable[..., Any]] = None  # compile=: the block's own forward, compiled (compile_sequence)


def _side_inputs(args: tuple, kwargs: dict, where: Optional[tuple[str, Any]], fn: Any) -> tuple[tuple, dict]:
    """``fn`` on the tensors of a call that need a gradient, except the stream at ``where``."""

    def apply(key: tuple[str, Any], a: Any) -> Any:
        if key == where or not isinstance(a, Tensor) or not a.requires_grad or not torch.is_grad_enabled():
            return a
        return fn(a)

    return (tuple(apply(("arg", i), a) for i, a in enumerate(args)),
            {k: apply(("kw", k), v) for k, v in kwargs.items()})


class _SequenceElement:
    """Mixin for each block of the sequence: in the sequence-parallel region (see the module docstring)."""

    _tpp_sp: ElementState

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        st = self._tpp_sp
        where = stream_index(args, kwargs)
        if VERIFYING.get():  # a tensor-parallel block checking itself on the whole sequence
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        if where is None and not torch.is_grad_enabled():
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        if where is None:
            raise SequenceParallelError(
                f"sequence parallelism: block {st.name!r} ({type(self).__name__}) was called without a tensor, so "
                f"there is no residual stream to cut along the sequence; train it with sequence_parallel=False")
        st.ran = True
        if not st.flat:  # the gradient of a side input (a conditioning vector) is this rank's shard's part
            args, kwargs = _side_inputs(args, kwargs, where, lambda t: copy_to_tp(t, st.group))
        if st.first:
            args, kwargs = replace_arg(args, kwargs, where, scatter_seq(get_arg(args, kwargs, where), st.group))
        else:
            hidden_state_whole(get_arg(args, kwargs, where), lambda t: gather_seq(t, st.group))
        if st.verify_pending:
            st.verify_pending = False
            _verify(self, args, kwargs, where)  # type: ignore[arg-type]
        if st.grads_pending and self.training and torch.is_grad_enabled() and not st.flat:  # type: ignore[attr-defined]
            st.grads_pending = False
            _verify_gradients(self, args, kwargs, where)  # type: ignore[arg-type]
        return self._sp_forward(args, kwargs, where)

    def _sp_forward(self, args: tuple, kwargs: dict, where: tuple[str, Any]) -> Any:
        st = self._tpp_sp
        forward = st.compiled or super().forward  # type: ignore[misc]
        stream = get_arg(args, kwargs, where)
        if st.flat:  # its projections are its own: the whole block runs on the whole sequence
            args, kwargs = replace_arg(args, kwargs, where, gather_seq(stream, st.group))
            out = forward(*args, **kwargs)
            return out if st.last else map_first_tensor(out, lambda t: scatter_seq(t, st.group))
        with sequence_region(st.group, stream.shape, regather=not st.recomputed), records_gathered(
                stream.shape[0], stream.shape[1], stream.shape[1] * st.group.size, lambda t: gather_seq(t, st.group)):
            if not (self.training and st.draws is not False):  # type: ignore[attr-defined]
                out = forward(*args, **kwargs)
            else:  # dropout over the shards draws per tp rank, as over a column layer's output
                with following(st.group.rank, st.group.stream, f"sequence:{st.name}") as draws:
                    draws.mark_input(stream)
                    out = forward(*args, **kwargs)
                st.draws = st.draws or draws.dropped
        return map_first_tensor(out, lambda t: gather_seq(t, st.group)) if st.last else out


def compile_sequence(element: nn.Module, compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """``compile=`` on a block of the sequence: its own forward compiled (the tensor-parallel blocks inside it, their
    gathers, alias and reduce-scatters traced), run inside what the block does around it (the stream cut or gathered,
    the region entered, dropout drawn per rank, Hugging Face's records gathered), which stays eager: traced, the
    output collector's ``ContextVar`` broke the graph. Returns whether ``element`` is such a block."""
    if not isinstance(element, _SequenceElement):
        return False
    element._tpp_sp.compiled = compile_fn(super(_SequenceElement, element).forward)
    return True


def _mismatch(element: nn.Module, st: ElementState, claim: str, cause: str) -> Mismatch:
    return Mismatch("sequence parallelism: block", st.name, type(element).__name__, cause, claim=claim,
                    fix="train it with sequence_parallel=False", error=SequenceParallelError)


def _whole(where: tuple[str, Any], group: TPGroup) -> Any:
    """A call on this rank's shard of the stream as the original block takes it: on the whole sequence."""
    return lambda a, k: replace_arg(a, k, where, gather_seq(get_arg(a, k, where), group))


def _called(ref: nn.Module, args: tuple, kwargs: dict) -> Any:
    return ref(*args, **kwargs)


def _verify(element: nn.Module, args: tuple, kwargs: dict, where: tuple[str, Any]) -> None:
    """The block's sequence-parallel output against the original block on the whole sequence (the tensor-parallel
    blocks inside check themselves on their first call in it)."""
    st: ElementState = element._tpp_sp  # type: ignore[assignment]
    check_forward(element, args, kwargs, group=st.group, shards=st.shards, reference=_called,
                  parallel=lambda a, k: element._sp_forward(a, k, where),  # type: ignore[operator]
                  whole=_whole(where, st.group), mark_parallel=False, mismatch=_mismatch(
                      element, st, "does not compute on sequence shards what it computes on the whole sequence",
                      "Its own code probably reads the sequence length or mixes positions outside its attention (or "
                      "an attention in it is left whole)"))


def _verify_gradients(element: nn.Module, args: tuple, kwargs: dict, where: tuple[str, Any]) -> None:
    """The gradients of the block's inputs and parameters on sequence shards (summed over tp where each rank holds
    a part: the partial parameters and side inputs, as training sums them) against the original block's on the whole
    sequence (:func:`~lightning_tpp.core.reference.check_gradients`). Catches what the forward check cannot: a
    replicated value used on shards inside an attention or MLP block whose gradient would not be summed."""
    st: ElementState = element._tpp_sp  # type: ignore[assignment]
    group = st.group
    declared = [e for b in element.modules() if (bs := getattr(b, "_tpp_block", None)) is not None
                for e in bs.partial]  # its tp blocks' (a Hugging Face plan's, summed by sum_block_partials)
    partial = {id(getattr(m, attr)) for m, attr in st.partial + declared if getattr(m, attr, None) is not None}

    def replicated(name: str, q: Tensor, g: Tensor, w: Tensor) -> Optional[str]:
        if id(q) in partial or id(st.shards.stored(q)) in partial:
            return first_difference(summed(g, group), w, group, f"gradient of {name!r}")
        if whole_or_part(g, w, group) == "part":  # inside a tensor-parallel block, used on this rank's heads (a
            owner, _, attr = name.rpartition(".")  # per-head norm) or sequence shard only
            st.partial.append((element.get_submodule(owner), attr))
            return None
        return first_difference(g, w, group, f"gradient of {name!r}")

    stream = get_arg(args, kwargs, where).detach()  # a leaf of its own, its gradient compared with the original's
    args, kwargs = replace_arg(args, kwargs, where, stream.requires_grad_(stream.is_floating_point()))
    check_gradients(element, args, kwargs, group=group, shards=st.shards, reference=_called,
                    parallel=lambda a, k: element._sp_forward(a, k, where),  # type: ignore[operator]
                    whole=_whole(where, group), replicated=replicated, input_parts=lambda key: key != where,
                    output_dim=1, mark_parallel=False, mismatch=_mismatch(
                        element, st,
                        "does not compute on sequence shards the gradients it computes on the whole sequence",
                        "A value shared by all positions (a parameter, a conditioning input) is probably used on "
                        "shards inside an attention or MLP block, after its output projection"))


def sequence_runs(module: nn.Module, containers: Sequence[str], members: Sequence[Sequence[str]]) -> list[list[str]]:
    """What runs on sequence shards, from the model's block sequence (its ``containers`` and the ``members`` of each
    block): one run of module names per stack (an encoder's, then a decoder's), each block or the entries of a list
    of layers that the model's loop unpacks and calls one by one. Blocks of several members (entries of sibling lists
    zipped in one loop, whose stream the model's loop holds) are refused."""
    zipped = [m for m in members if len({n.rpartition(".")[0] for n in m}) > 1]
    if zipped:
        raise ValueError(f"sequence_parallel=True passes the residual stream from block to block on sequence shards; "
                         f"the blocks {tuple(zipped[0])} are entries of sibling lists run in one loop, whose stream "
                         f"the model's own loop holds. Use sequence_parallel=False")
    runs: list[list[str]] = []
    container = lambda name: next((c for c in containers if name == c or name.startswith(f"{c}.")), None)  # noqa
    for member in (n for block in members for n in block):
        for name in _called_blocks(module, member):
            if not runs or container(name) != container(runs[-1][0]):
                runs.append([])
            runs[-1].append(name)
    return runs


def _called_blocks(module: nn.Module, name: str) -> list[str]:
    """The modules the model calls for block ``name``: the block, or the entries of a list of layers that its loop
    unpacks and calls one by one (``for attn, ff in self.layers``), in order."""
    block = module.get_submodule(name)
    if not isinstance(block, (nn.ModuleList, nn.ModuleDict)):
        return [name]
    return [n for child, _ in block.named_children() for n in _called_blocks(module, f"{name}.{child}")]


def apply_sequence_parallel(module: nn.Module, containers: list[list[str]], group: TPGroup, shards: ShardIndex, *,
                            local_names: Optional[set[str]] = None, twins: Optional[dict[str, nn.Module]] = None,
                            verify: bool = True) -> list[ElementState]:
    """Put the blocks of each container (a list of block names in forward order) in the region; ``local_names``:
    the blocks this pipeline rank holds (the others are stand-ins whose meta ``twins`` get the region's shapes)."""
    modules = dict(module.named_modules())
    states = []
    for names in containers:
        for i, name in enumerate(names):
            first, last = i == 0, i == len(names) - 1
            # a block of the partition, or an entry of one (a list of layers the model's loop unpacks)
            owner = next((n for n in reversed(ancestors(name) + [name]) if n in (local_names or ())), None)
            twin_of = next((n for n in reversed(ancestors(name) + [name]) if n in (twins or {})), None)
            if twin_of is not None:  # another stage's block, or this rank's run for another chunk
                twin = twins[twin_of].get_submodule(name[len(twin_of) + 1:]) if name != twin_of else twins[twin_of]
                twin._tpp_sp_twin = (group.size, first, last)
                swap_class(twin, _SequenceTwin)
            if local_names is not None and owner is None:
                continue
            element = modules[name]
            outer = next((n for n in ancestors(name) if getattr(modules.get(n), "_tpp_block", None) is not None), None)
            if outer is not None:
                raise ValueError(f"sequence_parallel=True: the blocks of {names[0].rpartition('.')[0] or 'the model'} "
                                 f"are layers of the tensor-parallel block {outer!r}, so there is no stream between "
                                 f"tensor-parallel blocks to cut along the sequence; use sequence_parallel=False")
            flat = _runs_whole(element)
            st = ElementState(name, group, shards, first, last, flat, verify_pending=verify,
                              partial=_partial_params(element, shards) if group.size > 1 and not flat else [])
            element._tpp_sp = st
            swap_class(element, _SequenceElement)
            states.append(st)
    return states


def _runs_whole(element: nn.Module) -> bool:
    """Whether ``element`` runs on the whole sequence (gathered at entry, cut at exit): it is one tensor-parallel
    block itself (its projections are its own), or holds parallel layers outside any tensor-parallel block in it
    (a Hugging Face plan's gathered fused qkv, Phi-3's, read by code that slices features, not the sequence)."""
    if getattr(element, "_tpp_block", None) is not None:
        return True
    inside = {id(m) for b in element.modules() if getattr(b, "_tpp_block", None) is not None for m in b.modules()}
    return any(getattr(m, "_tpp_layer", None) is not None and id(m) not in inside for m in element.modules())


def _partial_params(element: nn.Module, shards: ShardIndex) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of the replicated parameters that see sequence shards: those outside the element's
    tensor-parallel blocks, and the biases its row layers add after reduce-scattering."""
    blocks = [m for m in element.modules() if getattr(m, "_tpp_block", None) is not None]
    inside = {id(m) for b in blocks for m in b.modules()}
    out = []
    for m in element.modules():
        for attr, p in m.named_parameters(recurse=False):
            if shards.get(p) is not None:
                continue
            row_bias = attr == "bias" and isinstance(m, _RowParallel)
            if id(m) not in inside or row_bias:
                out.append((m, attr))
    return out


def sum_partial_gradients(states: list[ElementState]) -> None:
    """Add up over the tp group the gradients of the parameters each rank used on its shard of the sequence."""
    if not states or states[0].group.size == 1:
        return
    grads = []
    for st in states:
        if not st.ran and any(getattr(m, attr, None) is not None and getattr(m, attr).grad is not None
                              for m, attr in st.partial):
            raise SequenceParallelError(
                f"sequence parallelism: block {st.name!r} was never called with the residual stream, yet its "
                f"parameters have gradients: the model's loop calls the block's submodules itself, so nothing cut "
                f"the stream along the sequence there; use sequence_parallel=False")
        if not st.ran and not st.warned:
            st.warned = True
            rank_zero_warn(f"sequence_parallel=True: block {st.name!r} was not called during the first step, so it "
                           f"holds no sequence shards (the model may call its submodules itself)")
        for m, attr in st.partial:
            p = getattr(m, attr, None)
            if p is not None and p.grad is not None:
                grads.append(local(p.grad))
    if grads:
        all_reduce_coalesced(grads, states[0].group.group, average=False)


class _SequenceTwin:
    """Mixin for the meta twin of a block another pipeline rank holds: shapes as the real block has them inside the
    region (input shard in, output shard out; the whole sequence in the first block and out of the last)."""

    _tpp_sp_twin: tuple[int, bool, bool]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tp, first, last = self._tpp_sp_twin
        where = stream_index(args, kwargs)
        if where is None:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        if not first:
            x = get_arg(args, kwargs, where)
            args, kwargs = replace_arg(args, kwargs, where, torch.cat([x] * tp, dim=1))
        out = super().forward(*args, **kwargs)  # type: ignore[misc]
        if not last:
            out = map_first_tensor(out, lambda t: t.narrow(1, 0, t.shape[1] // tp))
        return out
