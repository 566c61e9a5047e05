"""Apply a :class:`~lightning_tpp.tensor_parallel.plan.TPPlan` to a model in place, and rebuild full tensors from
shards.

Order inside a block's forward (the block is the attention / MLP module that owns the parallel layers)::

    first call only:  gather full weights -> original-class copy -> compare outputs (eval, no grad) -> free copy
    every call:       open the block's copy_to_tp scope; run the user's forward under _LocalShapes; close the scope

Head-count attributes that the forward reads (``n_head``, ``num_heads``, ``split_size``, ...) are made local;
``_LocalShapes`` repairs ``view``/``reshape``/``split`` calls whose sizes were computed from the *input* width
(nanoGPT's ``y.view(B, T, C)``): such a call asks for exactly ``tp`` times the local elements, and the dimension
equal to a global width or head count is divided by ``tp``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_tpp._compat import MHA_FAST_PATH_FLAG
from lightning_tpp.core.dp_shard import local, shard_dp_like
from lightning_tpp.core.comm import TPGroup, TPScope, copy_to_tp, gather_summed, gather_with_spec, tokens_sharded
from lightning_tpp.core.grads import all_reduce_coalesced
from lightning_tpp.core.params import ShardIndex, ShardInfo
from lightning_tpp.core.sharding import ShardSpec, shard_tensor
from lightning_tpp.core.swap import original_class, set_local_attr, swap_class
from lightning_tpp.core.reference import (
    Mismatch,
    check_forward,
    check_gradients,
    first_difference,
    whole_or_part,
)
from lightning_tpp.core.walk import VERIFYING
from lightning_tpp.tensor_parallel.layers import (
    _ColumnParallel,
    _ParallelMultiheadAttention,
    _RowParallel,
    LayerTP,
    _VocabParallelEmbedding,
    is_transposed_linear,
)
from lightning_tpp.tensor_parallel.heads import WholeHeads, to_local_heads
from lightning_tpp.tensor_parallel.rng import following, mark_sharded
from lightning_tpp.tensor_parallel.sequence_region import (
    block_inputs,
    block_output,
    gathered_mark,
    in_sequence_region,
    release_gathered,
    saved_as_shards,
)
from lightning_tpp.tensor_parallel.plan_types import (
    GROUP_NAMES,
    HEAD_DIM_NAMES,
    HEAD_NAMES,
    KV_NAMES,
    WIDTH_HINTS,
    BlockInfo,
    TPPlan,
)


# ----------------------------------------------------------------------------------------------------------------
# shards <-> full tensors


def _set_shard(module: nn.Module, attr: str, spec: ShardSpec, group: TPGroup,
               done: dict[int, tuple[nn.Parameter, nn.Parameter]],
               shards: ShardIndex) -> None:
    old = getattr(module, attr)
    if old is None:
        return
    if id(old) in done:
        new = done[id(old)][1]
        if shards.spec(new) != spec:
            raise ValueError(f"parameter {attr} of {type(module).__name__} is shared with another layer that is split "
                             f"differently ({shards.spec(new)} vs {spec}); replicate one of them in tp_plan")
    else:
        spec.check(old.shape[spec.dim], group.size, f"{type(module).__name__}.{attr}")
        new = nn.Parameter(shard_tensor(old.data, spec, group.rank, group.size), requires_grad=old.requires_grad)
        shards.add(new, ShardInfo(spec, tuple(old.shape)))
        done[id(old)] = (old, new)  # the old one kept alive: its id is not reused while ``done`` is consulted
    setattr(module, attr, new)


def _shared_infos(layer: nn.Module, shards: ShardIndex) -> dict[str, ShardInfo]:
    """The layer's parameters some of whose rows other ranks hold too (K/V heads fewer than tp), by attribute."""
    out = {}
    for attr in ("weight", "bias"):
        p = getattr(layer, attr, None)
        info = shards.get(p) if p is not None else None
        if info is not None:
            out[attr] = info
    return out


# ----------------------------------------------------------------------------------------------------------------
# blocks


class _LocalShapes(TorchFunctionMode):
    replay_in_recompute = True  # context parallelism's attention, recomputed in backward, reads per-head biases

    def __init__(self, tp: int, global_sizes: frozenset[int], heads: int = 0, group: Optional[TPGroup] = None) -> None:
        super().__init__()
        self.tp, self.sizes, self.heads, self.group = tp, global_sizes, heads, group

    def _local(self, shape: tuple[int, ...], numel: int) -> tuple[int, ...]:
        if -1 in shape or math.prod(shape) != numel * self.tp:
            return shape
        for i in reversed(range(len(shape))):
            if shape[i] in self.sizes and shape[i] % self.tp == 0:
                return shape[:i] + (shape[i] // self.tp,) + shape[i + 1:]
        return shape

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in (Tensor.view, Tensor.reshape, torch.reshape) and len(args) >= 2 and isinstance(args[0], Tensor):
            x, shape = args[0], args[1:]
            if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
                shape = tuple(shape[0])
            if all(type(s) is int for s in shape):
                args = (x, self._local(tuple(shape), x.numel()))
        elif func in (Tensor.split, torch.split) and len(args) >= 2 and isinstance(args[1], (list, tuple)):
            x, sizes = args[0], list(args[1])
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
            if sum(sizes) == x.shape[dim] * self.tp and all(s % self.tp == 0 for s in sizes):
                args = (x, [s // self.tp for s in sizes], *args[2:])
        elif self.group is not None:  # a whole per-head side tensor (a position bias) meets this rank's heads
            args, kwargs = to_local_heads(func, args, kwargs, self.heads, self.group)
        return func(*args, **kwargs)


@dataclass
class BlockState:
    name: str
    info: BlockInfo
    scope: TPScope
    layers: dict[str, nn.Module]
    verify_pending: bool
    shards: ShardIndex
    shapes: Optional[frozenset[int]] = None
    draws: Optional[bool] = None  # whether its training forward drew dropout (None: not run in training yet)
    grads_pending: bool = True  # the gradient check, at the first call that trains (see verify_block_gradients)
    partial: list[tuple[nn.Module, str]] = dataclasses.field(default_factory=list)  # replicated parameters used on
    # this rank's heads (a per-head norm): each rank's gradient is a part, summed over tp before the optimizer steps
    _shapes_mode: Optional["_LocalShapes"] = dataclasses.field(default=None, repr=False, compare=False)

    def shape_mode(self) -> contextlib.AbstractContextManager:
        """The block's one mode (it holds no state of a call): a compiled block's frames guard on the function
        modes on the stack, and a new object per call would recompile them every call."""
        if not self.shapes:
            return contextlib.nullcontext()
        if self._shapes_mode is None:
            self._shapes_mode = _LocalShapes(self.scope.group.size, self.shapes, self.info.heads, self.scope.group)
        return self._shapes_mode


class _TPBlock:
    """Mixin for the module that owns a group of parallel layers (see the module docstring for what it does)."""

    _tpp_block: BlockState

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        st = self._tpp_block
        mark = gathered_mark()
        args, kwargs = block_inputs(args, kwargs)  # sequence parallelism: the stream's shards gathered
        if st.verify_pending:
            st.verify_pending = False
            verify_block(self, args, kwargs)  # type: ignore[arg-type]
        if st.grads_pending and self.training and torch.is_grad_enabled() and not VERIFYING.get() \
                and not in_sequence_region():  # type: ignore[attr-defined]  (sequence parallelism checks its own)
            st.grads_pending = False
            verify_block_gradients(self, args, kwargs)  # type: ignore[arg-type]
        st.scope.enter()
        try:  # (sequence parallelism: the stream is whole inside, gathered at the entry)
            if not (self.training and st.draws is not False) or VERIFYING.get():  # type: ignore[attr-defined]
                with st.shape_mode(), saved_as_shards(), tokens_sharded(None):
                    return block_output(super().forward(*args, **kwargs))  # type: ignore[misc]
            group = st.scope.group  # dropout over shards: per rank, from the strategy's stream
            with following(group.rank, group.stream, st.name) as draws, st.shape_mode(), saved_as_shards(), \
                    tokens_sharded(None):
                out = super().forward(*args, **kwargs)  # type: ignore[misc]
            st.draws = st.draws or draws.dropped
            return block_output(out)
        finally:
            st.scope.exit()
            release_gathered(mark)


class _TPMultiheadAttentionBlock(_TPBlock, _ParallelMultiheadAttention):
    pass


class _WholeWidth:
    """Mixin for a module of a tensor-parallel attention whose parameters span a projection's whole output, applied
    to this rank's columns of it: OLMo-2's ``q_norm`` / ``k_norm``, an RMSNorm over every head's features at once.
    Its input is gathered over tp along the features (backward: each rank's partial gradient summed, this rank's
    columns kept), it runs whole, as in one process, and its output is cut back to this rank's columns. Its weight's
    gradient on a rank is the part its columns give: summed over tp (the block's ``partial``, from its first such
    call: a module of that size that only ever meets whole inputs, a norm of the block's own input, runs as it is
    and its gradient stays whole)."""

    _tpp_width: "_Width"

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        width = self._tpp_width
        local = x.shape[-1] if isinstance(x, Tensor) else None
        if local not in width.widths:
            return super().forward(x, *args, **kwargs)  # type: ignore[misc]
        if not width.declared:
            width.declared = True
            _declare_partial(width.block.partial, self)  # type: ignore[arg-type]
        group = width.group
        out = super().forward(gather_summed(x.contiguous(), group, x.dim() - 1), *args, **kwargs)  # type: ignore[misc]
        out = out.narrow(-1, group.rank * local, local).contiguous()
        mark_sharded(out)  # this rank's columns (under compile=, nothing made through the gather's Function is known)
        return out


class _SummedTail:
    """Mixin for a layer whole on every rank whose output's last columns every head reads, outside the column layers
    (MLA's shared rope key: the rest of ``kv_a_proj_with_mqa``'s output reaches the heads through ``kv_b_proj``,
    whose input gradient is summed over tp already). Those columns pass through ``copy_to_tp``: each rank's heads
    give a part of their gradient, summed over tp in backward."""

    _tpp_tail: tuple[int, TPGroup]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)  # type: ignore[misc]
        columns, group = self._tpp_tail
        if not isinstance(out, Tensor) or out.shape[-1] < columns:
            return out
        kept, tail = out.split([out.shape[-1] - columns, columns], dim=-1)
        return torch.cat([kept, copy_to_tp(tail, group)], dim=-1)


@dataclasses.dataclass(eq=False)
class _Width:
    group: TPGroup
    widths: dict[int, int]  # this rank's width -> the whole width
    block: BlockState
    declared: bool = False  # its parameters in the block's partial


def _whole_width_modules(block: nn.Module, bname: str, info: BlockInfo, tp: int) -> dict[str, dict[int, int]]:
    """The modules of an attention ``block`` to run whole on gathered columns (:class:`_WholeWidth`): those whose
    parameters are all 1-d with as many entries as the query (or key/value) projection's whole output, outside its
    linear layers; each with this rank's width -> the whole width it would meet (K/V only where tp divides their
    heads: with fewer K/V heads than ranks each rank holds whole heads, not a column block)."""
    widths = {info.heads * info.head_dim}
    if info.kv_heads >= tp:
        widths.add(info.kv_heads * info.head_dim)
    widths = {w for w in widths if w % tp == 0}
    layers = set(info.layers)
    out: dict[str, dict[int, int]] = {}
    for name, sub in block.named_modules():
        full = f"{bname}.{name}" if bname else name
        params = list(sub.parameters(recurse=False))
        if not name or full in layers or not params or any(c.startswith(f"{full}.") for c in info.cut):
            continue
        sizes = {p.numel() for p in params}
        if all(p.dim() == 1 for p in params) and len(sizes) == 1 and sizes <= widths:
            out[name] = {params[0].numel() // tp: params[0].numel()}
    return out


def _localize_attrs(owner: nn.Module, info: BlockInfo, tp: int) -> None:
    """Make head counts and widths that the block's forward reads local (on the block, its children, its config).
    A module that also holds an MLP (projections that are a block's direct children) keeps its widths, which other
    parts of its forward may read; ``_LocalShapes`` repairs the reshapes that use them."""
    q_width, kv_width = info.heads * info.head_dim, info.kv_heads * info.head_dim
    local_kv = max(1, info.kv_heads // tp)  # fewer K/V heads than ranks: each rank holds one (kv_share)
    alone = len(info.row_layers()) == 1

    def local_value(name: str, value: Any) -> Optional[int]:
        if not isinstance(value, int) or isinstance(value, bool) or name in HEAD_DIM_NAMES:
            return None
        if name in HEAD_NAMES and value == info.heads:
            return value // tp
        if name in KV_NAMES and value == info.kv_heads:
            return local_kv
        if name in GROUP_NAMES and info.kv_heads < tp and value == info.heads // info.kv_heads:
            return info.heads // tp // local_kv  # query heads per K/V head, of this rank's heads
        if alone and any(h in name.lower() for h in WIDTH_HINTS) and value in (q_width, kv_width):
            return value // tp if value == q_width else local_kv * info.head_dim
        return None

    targets = [owner] + [m for m in owner.children() if not isinstance(m, (nn.Linear, nn.Embedding))]
    for module in targets:
        for name, value in list(vars(module).items()):
            new = local_value(name, value)
            if new is not None:
                set_local_attr(module, name, new)
        config = module.__dict__.get("config")
        if config is not None and hasattr(config, "__dict__"):
            changes = {n: v for n, v in vars(config).items() if local_value(n, v) is not None}
            if changes:
                local_config = copy.copy(config)
                for n, v in changes.items():
                    object.__setattr__(local_config, n, local_value(n, v))
                set_local_attr(module, "config", local_config)


def apply_plan(model: nn.Module, plan: TPPlan, group: TPGroup, *, verify: bool = True) -> ShardIndex:
    """Shard the parameters named by ``plan`` and swap in the parallel classes (in place); returns which parameters
    were cut and how."""
    modules = dict(model.named_modules())
    done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    shards = ShardIndex()
    scopes: dict[str, TPScope] = {}
    states: dict[str, BlockState] = {}
    for bname, info in plan.blocks.items():
        block = modules[bname]
        state = states[bname] = BlockState(bname, info, TPScope(group), {n: modules[n] for n in info.layers}, verify,
                                           shards, grads_pending=verify)
        scopes.update({n: state.scope for n in info.layers})
        if info.kind in ("attention", "mha"):
            _localize_attrs(block, info, group.size)
        if info.kind == "attention":
            qw, kvw = info.heads * info.head_dim, info.kv_heads * info.head_dim
            kv = (kvw, info.kv_heads) if info.kv_heads >= group.size else ()  # else K/V stay whole: no repair
            state.shapes = frozenset({qw, *kv, info.heads, info.head_dim * group.size})
            for mname, widths in _whole_width_modules(block, bname, info, group.size).items():
                sub = block.get_submodule(mname)
                sub._tpp_width = _Width(group, widths, state)
                swap_class(sub, _WholeWidth)
        # channels cut outside the linear layers (a mixer's), an attention's per-head parameters (its sinks)
        for pname, spec in info.cut.items():
            owner, _, attr = pname.rpartition(".")
            if attr in modules[owner]._buffers:  # non-persistent (mixer.py): the original comes back in a copy
                whole = modules[owner]._buffers[attr]
                set_local_attr(modules[owner], attr, shard_tensor(whole, spec, group.rank, group.size))
            else:
                _set_shard(modules[owner], attr, spec, group, done, shards)
        if info.kind == "mixer":  # the counts the forward reads
            for aname, value in info.local_attrs.items():
                owner, _, attr = aname.rpartition(".")
                set_local_attr(modules[owner], attr, value)
        block._tpp_block = state
        if info.kind == "mha":
            block._tpp_layer = LayerTP(group, scope=state.scope, heads=info.heads)
            set_local_attr(block, MHA_FAST_PATH_FLAG, False)
            for attr in ("in_proj_weight", "in_proj_bias"):
                _set_shard(block, attr, info.fused[bname][0], group, done, shards)
            swap_class(block, _TPMultiheadAttentionBlock)
        else:
            swap_class(block, _TPBlock)
    _declared_partials(plan, states, modules)
    for name, columns in plan.summed_tail.items():  # inside a planned block only: outside, every head is here
        if name in modules and _owner(name, states) is not None:
            modules[name]._tpp_tail = (columns, group)
            swap_class(modules[name], _SummedTail)
    rejoin = {n for info in plan.blocks.values() for n in info.rejoin}
    for name, style in plan.styles.items():
        if style in ("mha", "replicate"):
            continue
        m = modules[name]
        fused = next((blk.fused[name] for blk in plan.blocks.values() if name in blk.fused), None)
        if style in ("colwise", "colwise_gather"):
            spec = fused[0] if fused else ShardSpec(1 if is_transposed_linear(m) else 0)
            _set_shard(m, "weight", spec, group, done, shards)
            _set_shard(m, "bias", dataclasses.replace(spec, dim=0), group, done, shards)
            m._tpp_layer = LayerTP(group, scope=scopes.get(name), gather=style == "colwise_gather",
                                   check=layer_check(name, shards) if verify and style == "colwise_gather" else None,
                                   shared=_shared_infos(m, shards) if spec.replicated else {})
            set_local_attr(m, "nf" if is_transposed_linear(m) else "out_features", m.weight.shape[spec.dim])
            swap_class(m, _ColumnParallel)
        elif style == "rowwise":
            spec = ShardSpec(0 if is_transposed_linear(m) else 1)
            _set_shard(m, "weight", spec, group, done, shards)
            m._tpp_layer = LayerTP(group, rejoin=name in rejoin)
            if not is_transposed_linear(m):
                set_local_attr(m, "in_features", m.weight.shape[1])
            swap_class(m, _RowParallel)
        elif style == "vocab":
            vocab = m.weight.shape[0]
            _set_shard(m, "weight", ShardSpec(0), group, done, shards)
            local = vocab // group.size
            start, pad = group.rank * local, m.padding_idx
            m._tpp_layer = LayerTP(group, vocab_start=start,
                                   padding_idx=pad - start if pad is not None and 0 <= pad - start < local else None,
                                   check=layer_check(name, shards) if verify else None)
            set_local_attr(m, "num_embeddings", local)
            swap_class(m, _VocabParallelEmbedding)
    # the same parameter registered on another module too (BERT's cls.predictions.bias is its decoder's bias): that
    # name follows the shard, or the tie would silently break (the alias stays whole and is never updated)
    for module in modules.values():
        for attr, p in list(module._parameters.items()):
            if p is not None and id(p) in done and done[id(p)][0] is p:
                module._parameters[attr] = done[id(p)][1]
    return shards


def _declared_partials(plan: TPPlan, states: dict[str, BlockState], modules: dict[str, nn.Module]) -> None:
    """The parameters of ``plan.grad_allreduce`` (Hugging Face's ``replicated_with_grad_allreduce``) inside a planned
    block go in its ``partial`` now, so that they are summed over tp even with ``verify=False``; the gradient check
    (:func:`verify_block_gradients`) confirms or corrects each. Outside a planned block (its attention left whole)
    such a parameter sees every head and stays as it is."""
    for name in plan.grad_allreduce:
        owner = _owner(name, states)
        if owner is None or name not in modules:
            continue
        _declare_partial(states[owner].partial, modules[name])


def _owner(name: str, states: dict[str, BlockState]) -> Optional[str]:
    """The innermost planned block holding the module ``name``, if any."""
    return max((b for b in states if name.startswith(f"{b}.")), key=len, default=None)


def _declare_partial(partial: list[tuple[nn.Module, str]], module: nn.Module) -> None:
    """``module``'s own trainable parameters in a block's ``partial`` (each rank's gradient a part, summed over tp),
    each once."""
    partial.extend((module, a) for a, q in module.named_parameters(recurse=False)
                   if q.requires_grad and (module, a) not in partial)


def unchecked_replicated(model: nn.Module) -> list[str]:
    """Names of the replicated parameters inside tensor-parallel attention blocks, outside their parallel layers,
    that no plan declared partial: with ``verify=False`` nothing tells whether each is applied to every head (its
    gradient whole on each rank) or to this rank's heads only (a per-head norm: a part, to be summed over tp). A
    module run whole on gathered columns (:class:`_WholeWidth`) decides it itself, at its first call."""
    out = []
    for bname, block in model.named_modules():
        st = getattr(block, "_tpp_block", None)
        if not isinstance(st, BlockState) or st.info.kind not in ("attention", "mixer"):
            continue
        layers = {id(m) for m in st.layers.values()}
        partial = {id(getattr(m, a)) for m, a in st.partial if getattr(m, a, None) is not None}
        for mname, m in block.named_modules():
            if id(m) in layers or isinstance(m, _WholeWidth):
                continue
            out.extend(".".join(filter(None, (bname, mname, a))) for a, q in m.named_parameters(recurse=False)
                       if q.requires_grad and st.shards.get(q) is None and id(q) not in partial)
    return out


# ----------------------------------------------------------------------------------------------------------------
# numerical check of a block against its original


def _reshard(layer: nn.Module, spec: ShardSpec, group: TPGroup, shards: ShardIndex) -> None:
    for attr, s in (("weight", spec), ("bias", dataclasses.replace(spec, dim=0))):
        p = getattr(layer, attr, None)
        info = shards.get(p) if p is not None else None
        if info is None:
            continue
        full = gather_with_spec(p.detach(), info.spec, group)
        p.data.copy_(shard_tensor(full, s, group.rank, group.size))
        stored = shards.stored(p)
        if stored is not p:  # p is FSDP2's gathered copy for this forward: the dp-sharded parameter follows
            with torch.no_grad():
                local(stored).copy_(local(shard_dp_like(p.detach(), stored)))
        info.spec = s


def layer_check(name: str, shards: ShardIndex) -> Any:
    """The first-call check of a layer outside the blocks (a vocab-parallel embedding, an LM head whose output is
    gathered): its output against the original class's forward with the whole weight, on the same inputs."""

    def check(layer: nn.Module, args: tuple, kwargs: dict, got: Any) -> None:
        got = got.detach() if isinstance(got, Tensor) else got
        check_forward(layer, args, kwargs, group=layer._tpp_layer.group, shards=shards,  # type: ignore[union-attr]
                      parallel=lambda a, k: got, mismatch=Mismatch(
                          "tensor-parallel layer", name, original_class(layer).__name__,
                          "Its forward probably does something the parallel layer does not model"))

    return check


def _block_reference(st: BlockState) -> Any:
    """How a block's original runs: an attention's per-head side tensors (a position bias) whole."""

    def run(ref: nn.Module, args: tuple, kwargs: dict) -> Any:
        with WholeHeads(st.info.heads, st.scope.group) if st.info.kind == "attention" else contextlib.nullcontext():
            return ref.forward(*args, **kwargs)

    return run


def _cause(st: BlockState, cause: str) -> str:
    """What a block's mismatch probably comes from: the parameters cut with the heads on their size alone first."""
    unseen = [n for n, seen in st.info.per_head.items() if not seen]
    if not unseen:
        return cause
    return (f"{cause}; or {unseen} (leading dimension num_heads={st.info.heads}) are not read per head: they were "
            f"cut with the heads on their size, as its forward could not be traced at setup to tell")


def verify_block_gradients(block: nn.Module, args: tuple, kwargs: dict) -> None:
    """At the block's first training call: :func:`~lightning_tpp.core.reference.check_gradients`. A replicated
    parameter whose gradient here is one part of the original's, summed over tp (a norm applied to each of this
    rank's heads: Qwen3's ``q_norm``), goes in ``partial``: training sums it over tp before the optimizer steps
    (:func:`sum_block_partials`); one that matches neither way is a mismatch."""
    st: BlockState = block._tpp_block  # type: ignore[assignment]
    group = st.scope.group

    def replicated(name: str, q: Tensor, g: Tensor, w: Tensor) -> Optional[str]:
        owner, _, attr = name.rpartition(".")
        entry = (block.get_submodule(owner), attr)
        declared = entry in st.partial  # by a Hugging Face plan (``_declared_partials``)
        how = whole_or_part(g, w, group)
        if how == "part" and not declared:
            st.partial.append(entry)
        elif how == "whole" and declared:  # measured whole on every rank: a sum over tp would multiply it
            st.partial.remove(entry)
        return first_difference(g, w, group, f"gradient of {name!r}") if how is None else None

    # the tensor-parallel forward itself, not what wraps it (a pipeline unit's dispatch, a recomputed block's
    # checkpoint: a checkpoint inside the check recomputed another forward in the check's backward, CheckpointError)
    check_gradients(block, args, kwargs, group=group, shards=st.shards, parallel=lambda a, k: _TPBlock.forward(
                        block, *a, **k),  # type: ignore[arg-type]
                    reference=_block_reference(st), replicated=replicated, mismatch=Mismatch(
                        f"tensor-parallel {st.info.kind} block", st.name, type(block).__name__,
                        _cause(st, "Its backward probably depends on something the automatic plan does not model"),
                        claim="computes the right outputs but not the original model's gradients on this rank"))


def checks_off(model: nn.Module) -> None:
    """Turn off every first-call check of ``model``'s tensor-parallel blocks and layers (a meta copy that only
    traces: the checks gather real weights, and the model's own run does them)."""
    for m in model.modules():
        block = m.__dict__.get("_tpp_block")
        if block is not None:
            block.verify_pending = block.grads_pending = False
        layer = m.__dict__.get("_tpp_layer")
        if layer is not None and getattr(layer, "check", None) is not None:
            layer.check = None


def block_states(model: nn.Module) -> list[BlockState]:
    """The tensor-parallel blocks' states of ``model`` (after :func:`apply_plan`)."""
    return [st for m in model.modules() if isinstance(st := getattr(m, "_tpp_block", None), BlockState)]


def sum_block_partials(states: list[BlockState]) -> None:
    """Add up over tp the gradients of the replicated parameters each rank used on its own heads only
    (``BlockState.partial``, found by the gradient check)."""
    grads = [local(q.grad) for st in states for o, a in st.partial if (q := getattr(o, a, None)) is not None
             and q.grad is not None]
    if grads:
        all_reduce_coalesced(grads, states[0].scope.group.group, average=False)


def verify_block(block: nn.Module, args: tuple, kwargs: dict) -> None:
    """Compare the parallel block with its original on this call's inputs; pick the fused layout that matches."""
    st: BlockState = block._tpp_block  # type: ignore[assignment]
    group = st.scope.group
    fused = {n: specs for n, specs in st.info.fused.items() if len(specs) > 1}

    def layout(i: int) -> Any:
        def recut() -> None:
            for name, specs in fused.items():
                _reshard(st.layers.get(name, block), specs[min(i, len(specs) - 1)], group, st.shards)
        return recut

    attempts = max((len(s) for s in fused.values()), default=1)
    check_forward(block, args, kwargs, group=group, shards=st.shards, parallel=lambda a, k: block.forward(*a, **k),
                  reference=_block_reference(st), layouts=[layout(i) for i in range(1, attempts)],
                  mismatch=Mismatch(f"tensor-parallel {st.info.kind} block", st.name, type(block).__name__,
                                    _cause(st, "Its forward probably does something the automatic plan does not "
                                               "model")))
