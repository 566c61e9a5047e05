"""Activations of one micro-batch, measured on a meta copy: the bytes autograd saves for backward on each pipeline
stage (and in each block, and what a split backward keeps from ``I`` until ``W``), for ``estimate``'s planner. How and
why: see the package's docstring (``lightning_tpp.memory``)."""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from lightning_tpp._compat import TorchDispatchMode, storage_key, tree_flatten, tree_map
from lightning_tpp.config import planning_config
from lightning_tpp.core.meta_ops import DataDependentOnMeta
from lightning_tpp.core.mesh import MeshDims
from lightning_tpp.pipeline.partition import Partition, PipelinePartitionError, block_sequence
from lightning_tpp.pipeline.stage import meta_twin
from lightning_tpp.pipeline.wgrad import deferred_product
from lightning_tpp.steps import meta_groups, run
from lightning_tpp.tensor_parallel import TPPlan

ForwardFn = Callable[[nn.Module, Tensor], Any]  # (model, token ids of one micro-batch) -> what backward starts from


def meta_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``module`` on the meta device, its floating-point parameters in ``dtype``."""
    copy = meta_twin(module)
    for p in copy.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return copy


def activations_per_stage(module: nn.Module, plan: TPPlan, partition: Optional[Partition], dims: MeshDims,
                          mb: int, seq_len: int, dtype: torch.dtype, checkpointing: bool, forward: Optional[ForwardFn],
                          ep: int = 1, cp_mode: str = "allgather"
                          ) -> tuple[dict[int, int], dict[int, int], dict[int, int], dict[int, int], dict[int, int]]:
    """Bytes held per micro-batch by each stage (saved tensors plus the outputs sent to the next stage; saved
    tensors alone), what comes on top at a stage's peak (under checkpointing, its largest block's activations
    while it recomputes), what a split backward keeps from ``I`` until ``W``, and what the loss's backward holds
    beside the saved tensors (the last stage's; ``_Live``)."""
    owners = partition.owners() if partition is not None else {}
    blocks = block_names(module, partition)
    full = _measure(module, plan, owners, blocks, dims, mb, seq_len, dtype, False, forward, ep, cp_mode)
    last = partition.stages - 1 if partition is not None else 0
    # after a split backward's I: the weight products' operands and the sent outputs; the first stage runs its
    # backward whole in W (it sends no input gradient), so it keeps everything until then
    waiting = {g: full.weight_operands.get(g, 0) + (full.sent.get(g, 0) if g < last else 0) for g in range(last + 1)}
    held, recompute = full, dict[int, int]()
    if checkpointing:
        held = _measure(module, plan, owners, blocks, dims, mb, seq_len, dtype, True, forward, ep, cp_mode)
        for name, b in full.blocks.items():
            g = owners.get(name, 0)
            recompute[g] = max(recompute.get(g, 0), b)
    per_stage = _per_stage(held, last)
    return per_stage, dict(held.saved), recompute, {**waiting, 0: per_stage.get(0, 0)}, {last: full.transient}


def block_names(module: nn.Module, partition: Optional[Partition]) -> tuple[str, ...]:
    if partition is not None:
        return tuple(n for members in partition.members for n in members)
    try:
        return tuple(n for members in block_sequence(module, ordered=False).members for n in members)
    except PipelinePartitionError:  # no block sequence: nothing to checkpoint per block
        return ()


def _per_stage(m: "_Measured", last: int) -> dict[int, int]:
    return {g: m.saved.get(g, 0) + (m.sent.get(g, 0) if g < last else 0) for g in range(last + 1)}


@dataclass
class _Measured:
    saved: dict[int, int] = field(default_factory=dict)  # stage -> bytes saved for backward
    sent: dict[int, int] = field(default_factory=dict)  # stage -> bytes of its last unit's outputs
    blocks: dict[str, int] = field(default_factory=dict)  # block -> bytes saved inside it
    weight_operands: dict[int, int] = field(default_factory=dict)  # stage -> bytes a split backward keeps until W
    transient: int = 0  # the most bytes alive in the backward beyond what the forward kept (the loss's)


def _measure(module: nn.Module, plan: TPPlan, owners: Mapping[str, int], blocks: Sequence[str], dims: MeshDims,
             mb: int, seq_len: int, dtype: torch.dtype, checkpointing: bool, forward: Optional[ForwardFn],
             ep: int = 1, cp_mode: str = "allgather") -> _Measured:
    """Run one micro-batch forward on a meta copy cut by ``plan``; attribute every saved tensor to the stage (and
    block) whose module is running, or else to the stage that ran last (the loss goes to the last stage)."""
    copy = meta_copy(module, dtype)
    config = planning_config(dims.tp, 1, ep=ep, cp=dims.cp, cp_mode=cp_mode)
    # the blocks on this rank's positions (cp > 1): what their attention gathers is counted as it runs
    run(copy, config, meta_groups(config), dims=MeshDims(1, 1, dims.tp, dims.cp),
        until="context_parallel" if dims.cp > 1 else "experts", plan=plan)
    modules = dict(copy.named_modules())
    out = _Measured()
    running: list[str] = []
    last = [0]
    seen: dict[int, Tensor] = {}  # keeps counted tensors alive, so that ids are not reused
    params = {id(p) for p in copy.parameters()}
    block_set = set(blocks)
    repeats = _Repeats(out, owners)
    for name in blocks:
        modules[name].forward = functools.partial(repeats.run, name, modules[name], modules[name].forward,
                                                  checkpointing)

    def stage() -> int:
        return owners.get(running[0], 0) if running else last[0]

    def pack(t: Tensor) -> Tensor:
        base = t._base if t._base is not None else t
        if id(base) in params or id(base) in seen:
            return t
        seen[id(base)] = base
        out.saved[stage()] = out.saved.get(stage(), 0) + base.nbytes
        if running and running[0] in block_set:
            out.blocks[running[0]] = out.blocks.get(running[0], 0) + base.nbytes
        return t

    def enter(name: str, *_: Any) -> None:
        running.append(name)

    def leave(name: str, _m: nn.Module, _a: Any, result: Any) -> None:
        running.pop()
        if not running:
            last[0] = owners.get(name, 0)
            out.sent[last[0]] = _float_bytes(result)

    handles = []
    for name in (*owners, *(n for n in blocks if n not in owners)):
        handles.append(modules[name].register_forward_pre_hook(functools.partial(enter, name)))
        handles.append(modules[name].register_forward_hook(functools.partial(leave, name)))
    ids = torch.zeros(mb, seq_len, dtype=torch.long, device="meta")
    live = _Live()
    handles += [q.register_hook(live.gradient) for q in copy.parameters() if q.requires_grad]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _FusedAttention(), \
                _WeightOperands(out.weight_operands, stage), DataDependentOnMeta(), live:
            try:
                result = (forward or _default_forward)(copy, ids)
            except (RuntimeError, NotImplementedError, TypeError) as err:
                raise ValueError(
                    f"estimate_memory runs the model's forward on the meta device to measure activations, and "
                    f"{type(module).__name__}'s failed there: {type(err).__name__}: {err}. Pass "
                    f"forward=lambda model, ids: <the loss of one micro-batch> to call it another way") from err
            held = live.now  # at the backward's start: what the forward keeps
            live.counts = []
            # under checkpointing the recompute is counted apart (``recompute``), the transient by the run without
            if not checkpointing and isinstance(result, Tensor) and result.requires_grad and \
                    result.is_floating_point():
                try:
                    result.backward(torch.ones_like(result))
                except (RuntimeError, NotImplementedError, TypeError) as err:
                    warnings.warn(f"estimate_memory could not run {type(module).__name__}'s backward on the meta "
                                  f"device ({type(err).__name__}: {err}): the bytes its backward holds beside the "
                                  f"saved tensors (the loss's gradients) are counted only as far as it ran",
                                  stacklevel=2)
                out.transient = max(live.most() - held, 0)
    finally:
        for h in handles:
            h.remove()
    return out


class _Live(TorchDispatchMode):
    """The bytes of the tensors the operations it sees create (views and in-place results aside) while they live,
    counted after each operation (its outputs beside its inputs): saved tensors, the forward's temporaries and the
    backward's gradients in flight. A parameter's gradient is taken out of every count since its creation when
    autograd hands it to the parameter (``gradient``, a tensor hook): the planner counts gradients apart. Behind the
    blocks ``_Repeats`` stands in for, the backward stops (their outputs are fresh leaves): what it sees is the
    loss's and the head's backward, where a large vocabulary's fp32 gradients sit beside every saved activation.
    Measured on an H200: a 1.2 B Llama (128 K vocabulary, 4 x 2048 tokens) peaked 5.8 GB above what the saved
    tensors and the states add up to."""

    def __init__(self) -> None:
        super().__init__()
        self.alive: dict[int, tuple[int, int]] = {}  # storage -> (bytes, the count it entered)
        self.now = 0
        self.counts: list[int] = []  # after each operation

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        result = func(*args, **(kwargs or {}))
        given = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        for t in tree_flatten(result)[0]:
            key = storage_key(t) if isinstance(t, Tensor) else None
            if key is not None and key not in given and key not in self.alive:
                self.alive[key] = (t.untyped_storage().nbytes(), len(self.counts))
                self.now += self.alive[key][0]
                weakref.finalize(t, self._freed, key)
        self.counts.append(self.now)
        return result

    def most(self) -> int:
        return max(self.counts, default=self.now)

    def gradient(self, grad: Optional[Tensor]) -> None:
        if grad is None:  # a parameter no path reaches (T5's relative-position table in some stacks)
            return
        key = storage_key(grad)
        n, since = self.alive.get(key, (0, 0))
        self._freed(key)
        for i in range(since, len(self.counts)):
            self.counts[i] -= n

    def _freed(self, key: int) -> None:
        self.now -= self.alive.pop(key, (0, 0))[0]


class _FlashSaves(torch.autograd.Function):
    """What a fused attention kernel (flash / memory-efficient, on GPU and CPU alike) keeps for backward: q, k, v,
    the output, the log-sum-exp per query, and the mask if one is given; no (seq x seq) probabilities."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if mask is not None else []))
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # shapes only: the planner's meta backward
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


class _WeightOperands(TorchFunctionMode):
    """What a split backward (zero-bubble's ``I`` then ``W``) keeps of a micro-batch after ``I``: for each weight
    product ``pipeline.wgrad`` defers, its input (each storage once) and its output's gradient."""

    def __init__(self, into: dict[int, int], stage: Callable[[], int]) -> None:
        super().__init__()
        self.into, self.stage = into, stage
        self.seen: dict[int, Tensor] = {}  # keeps counted inputs alive, so that ids are not reused

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        result = func(*args, **(kwargs or {}))
        product = deferred_product(func, args, kwargs or {}) if torch.is_grad_enabled() else None
        if product is not None and isinstance(result, Tensor):
            x = product[0]
            base = x._base if x._base is not None else x
            size = result.nbytes + (0 if id(base) in self.seen else base.nbytes)
            self.seen[id(base)] = base
            self.into[self.stage()] = self.into.get(self.stage(), 0) + size
        return result


class _FusedAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` on meta tensors takes the math path, which saves the attention
    probabilities; real devices run a fused kernel that does not. Count what the fused kernel keeps."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and all(isinstance(a, Tensor) and a.is_meta for a in args[:3]):
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            return _FlashSaves.apply(*args[:3], mask if isinstance(mask, Tensor) else None)
        return func(*args, **kwargs)


class _Repeats:
    """Runs a block only until two blocks of the same kind (class, parameter shapes, input shapes) have run; later
    ones are counted as the second (shared inputs such as rotary tables are counted by the first only) and return
    fresh meta tensors of the same shapes: an 80-layer model costs two layers' worth of meta operations."""

    def __init__(self, out: "_Measured", owners: Mapping[str, int]) -> None:
        self.out, self.owners = out, owners
        self.done: dict[Any, list[tuple[int, Any]]] = {}  # kind -> (bytes, output) of the blocks that ran

    def run(self, name: str, block: nn.Module, forward: Callable[..., Any], checkpointing: bool, *args: Any,
            **kwargs: Any) -> Any:
        ends = tuple((getattr(slot, "first", None), getattr(slot, "last", None))  # a run's first and last blocks cut
                     for slot in (getattr(block, "_tpp_sp", None), getattr(block, "_tpp_cp", None)))  # and gather
        kind = (type(block), tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()),
                _shapes((args, kwargs)), ends)
        ran = self.done.setdefault(kind, [])
        if len(ran) >= 2:
            saved, result = ran[-1]
            stage = self.owners.get(name, 0)
            self.out.saved[stage] = self.out.saved.get(stage, 0) + saved
            self.out.blocks[name] = saved
            return tree_map(lambda t: torch.empty_like(t).requires_grad_(t.requires_grad)
                            if isinstance(t, Tensor) else t, result)
        result = checkpoint(forward, *args, use_reentrant=False, **kwargs) if checkpointing else \
            forward(*args, **kwargs)
        ran.append((self.out.blocks.get(name, 0), result))
        return result


def _shapes(obj: Any, depth: int = 0) -> Any:
    if isinstance(obj, Tensor):
        return (tuple(obj.shape), obj.dtype, obj.requires_grad)
    if isinstance(obj, (list, tuple)) and depth < 4:
        return tuple(_shapes(v, depth + 1) for v in obj)
    if isinstance(obj, dict) and depth < 4:
        return tuple((k, _shapes(v, depth + 1)) for k, v in obj.items())
    return obj if obj is None or isinstance(obj, (bool, int, float, str)) else type(obj).__name__


def _float_bytes(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.nbytes if value.is_floating_point() else 0
    if isinstance(value, (tuple, list)):
        return sum(_float_bytes(v) for v in value)
    if isinstance(value, Mapping):
        return sum(_float_bytes(v) for v in value.values())
    return 0


def _default_forward(model: nn.Module, ids: Tensor) -> Any:
    """A language model's step: a Hugging Face model's own loss (``labels=``), else a cross-entropy on the logits
    when ``model(ids)`` returns ``(batch, tokens, vocab)`` scores."""
    if hasattr(model, "base_model_prefix") and hasattr(model, "config"):
        return model(input_ids=ids, labels=ids).loss
    out = model(ids)
    logits = getattr(out, "logits", out)
    if isinstance(logits, Tensor) and logits.is_floating_point() and logits.dim() == 3 and \
            logits.shape[:2] == ids.shape:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
    return out
