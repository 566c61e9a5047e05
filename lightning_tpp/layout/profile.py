"""The model as the cost model sees it: per-block figures measured once on the meta device, scaled per layout.

Nothing here allocates: the model (or a meta copy of it) runs on the meta device three times per tensor-parallel
size measured (tp = 1 and tp = 2): the memory planner's own measurement of the bytes each block saves for backward
(``memory.activations``, with activation checkpointing off and on), its cut (the setup steps, ``steps.run``) for the
parameters each block keeps, and one forward under ``FlopCounterMode`` for each block's FLOPs. Every figure that
tensor parallelism changes is kept as :class:`Scaled` (``whole`` at tp = 1, of which ``cut`` divides by tp), fitted
from the two sizes, so a layout's figure is arithmetic, not another meta run::

    figure(tp) = whole - cut + cut / tp          (exact for what the plan cuts evenly; norms, residuals stay whole)

Mixture-of-experts layers (``experts.find_experts``) are recorded per block (:class:`RoutedLayer`: experts, top-k,
hidden size, the bank's parameters) for expert parallelism's terms. On meta no token reaches an expert (the
data-dependent operations find nothing, ``core.meta_ops``) and grouped matmuls have no FLOP formula, so the experts'
FLOPs are added by arithmetic: each (token, slot) row runs one expert's matrices, 2 FLOPs per parameter.
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from lightning_tpp.context_parallel import mixing_layers
from lightning_tpp.context_parallel.attention import joinable
from lightning_tpp.core.mesh import MeshDims
from lightning_tpp.core.meta_ops import DataDependentOnMeta
from lightning_tpp.experts.detect import MoELayer, find_experts, top_k
from lightning_tpp.memory.activations import ForwardFn, _default_forward, activations_per_stage, meta_copy
from lightning_tpp.config import planning_config
from lightning_tpp.steps import meta_groups, run
from lightning_tpp.pipeline.partition import block_sequence, find_block_sequences, plan_partition
from lightning_tpp.tensor_parallel import TensorParallelConfigError, check_divisible

KEEP = 3  # blocks measured per container: the first (beside the embeddings), one inside, the last (beside the head)
REDUCING = ("rowwise", "mha", "experts")  # an all-reduce of the output per forward (of the input's gradient back)


@dataclass(frozen=True)
class RoutedLayer:
    """A mixture-of-experts layer as expert parallelism costs it: ``experts`` per bank, each token's ``top_k``
    slots, the ``hidden`` size of a row sent, the bank's parameter elements (whole), and how its experts are held
    (``"bank"``: 3-D parameters, which ep splits; ``"list"``: modules, which it does not)."""

    name: str
    kind: str
    experts: int
    top_k: int
    hidden: int
    params: float

    @property
    def flops_per_token(self) -> float:
        """Forward FLOPs of one token through its ``top_k`` experts (2 per parameter of one expert, per slot)."""
        return 2.0 * self.params / self.experts * self.top_k


@dataclass(frozen=True)
class Scaled:
    """A figure at tp = 1 (``whole``), of which ``cut`` is divided by tp."""

    whole: float
    cut: float = 0.0

    def at(self, tp: int) -> float:
        return self.whole - self.cut + self.cut / tp

    @staticmethod
    def fit(at_1: float, at_2: float) -> "Scaled":
        """From the figure at tp = 1 and tp = 2 (``at_2 = whole - cut / 2``). A figure that falls faster than
        ``1 / tp`` (a vocabulary-parallel loss's backward: 269 GB at tp = 1, 101 GB at tp = 2 for a 128 K vocabulary
        at 262 K positions) is taken as all cut: ``at_1 / tp``, above what was measured at tp = 2, where the line
        through both would go below zero by tp = 8 and a layout that cannot run would seem to fit."""
        return Scaled(float(at_1), min(max(2.0 * (at_1 - at_2), 0.0), float(at_1)))


@dataclass(frozen=True)
class BlockProfile:
    """One block of the block sequence: parameters (elements), bytes saved for backward per sequence without and
    with activation checkpointing, forward FLOPs per sequence, and the all-reduces tensor parallelism adds to its
    forward (as many again in backward)."""

    name: str
    kind: str  # the block measured for it (blocks of one container are alike): the key of its timing
    params: Scaled
    saved: Scaled
    kept: Scaled
    flops: Scaled
    reductions: int
    experts: Scaled = Scaled(0.0)  # parameters of its expert banks (in ``params``; expert tp cuts them)
    routed: tuple[RoutedLayer, ...] = ()
    exchange_saved: float = 0.0  # bytes per sequence (tp = 1) that expert parallelism's exchange adds to ``saved``
    tensors: int = 0  # parameter tensors (an optimizer step's per-tensor work)
    keys: float = 0.0  # bytes per sequence (tp = 1) of the keys and values its attention calls read: what context
    # parallelism all-gathers (a block whose attention is not an SDPA call: twice its output, as multi-head attention)
    attention_flops: float = 0.0  # of ``flops``, the attention's (query x key products): what cp recomputes
    queries: float = 0.0  # bytes per sequence (tp = 1) of its SDPA calls' queries (cp_mode="a2a" exchanges them and
    # the outputs, of the queries' size, besides the keys and values; 0: no SDPA call, a2a runs it as "allgather")
    heads: int = 0  # query heads of its SDPA calls (tp = 1): a2a needs heads per tp rank divisible by cp (0: calls
    # without a heads dimension, which a2a runs as "allgather")
    kv_heads: int = 0  # key/value heads of its SDPA calls (tp = 1): a2a repeats them where cp does not divide them
    joined_flops: float = 0.0  # of ``attention_flops``, its causal SDPA calls' without a mask or dropout: on CPU,
    # cp_mode="allgather" joins their parts by log-sum-exp and does not recompute them

    @property
    def active(self) -> float:
        """Parameters as a token runs through them (each bank's top-k of its experts): the weight the strategy
        balances pipeline stages by (``experts.active_parameters``)."""
        return self.params.whole - sum(r.params * (1 - r.top_k / r.experts) for r in self.routed)

    def exchanged(self, seq_len: int, dtype_bytes: int) -> float:
        """Bytes of one all-to-all of every routed layer of the block, per sequence, before ep and tp split it:
        tokens x top-k rows of ``hidden`` elements."""
        return float(sum(seq_len * r.top_k * r.hidden * dtype_bytes for r in self.routed))


@dataclass(frozen=True)
class ModelProfile:
    """Per-block figures and what lies outside the blocks, on the first stage (``first``: embeddings) and the last
    (``last``: final norm, head, loss). Activations and FLOPs are per sequence of ``seq_len`` tokens (they grow
    linearly with the micro-batch); ``sent`` is a stage's output per sequence (what a pipeline send carries and
    what a tp all-reduce of the residual stream moves)."""

    blocks: tuple[BlockProfile, ...]
    first_params: Scaled
    last_params: Scaled
    first_saved: Scaled
    last_saved: Scaled
    end_flops: Scaled
    sent: float
    seq_len: int
    dtype_bytes: int
    tp_choices: tuple[int, ...]  # tensor-parallel sizes whose plan divides every block
    vocab_reductions: int = 0  # all-reduces per forward outside the blocks at tp > 1 (vocabulary-parallel layers)
    whole_params: int = 0
    end_tensors: tuple[int, int] = (0, 0)  # parameter tensors outside the blocks on the first and last stage
    last_transient: Scaled = Scaled(0.0)  # bytes per sequence the loss's backward holds beside the saved tensors
    shared_params: Scaled = Scaled(0.0)  # of first_params and last_params, in both (a tied embedding and head)
    cp_problem: Optional[str] = None  # why context parallelism cannot run the model (None: it can)

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @functools.cached_property
    def actives(self) -> tuple[float, ...]:
        """Each block's ``active`` parameters: the weights the pipeline partition balances."""
        return tuple(b.active for b in self.blocks)

    @functools.cached_property
    def _runs(self) -> tuple[tuple[int, int, BlockProfile], ...]:
        """Consecutive blocks whose figures are alike (names aside): (start, stop, the first of them)."""
        runs: list[tuple[int, int, BlockProfile]] = []
        last = None
        for i, block in enumerate(self.blocks):
            figures = _figures(block)
            if runs and figures == last:
                runs[-1] = (runs[-1][0], i + 1, runs[-1][2])
            else:
                runs.append((i, i + 1, block))
            last = figures
        return tuple(runs)

    def alike(self, a: int, b: int) -> tuple[tuple[BlockProfile, int], ...]:
        """Blocks ``a:b`` as (block, how many in a row are alike): a layout's cost and memory sum a stage's blocks
        once per kind, however deep the stack (searching 1024 devices costs a few figures per stage, not 80)."""
        key = (a, b)
        if key not in self._alike:
            self._alike[key] = tuple((block, min(stop, b) - max(start, a)) for start, stop, block in self._runs
                                     if start < b and stop > a)
        return self._alike[key]

    @functools.cached_property
    def _alike(self) -> dict[tuple[int, int], tuple[tuple[BlockProfile, int], ...]]:
        return {}

    @property
    def routed(self) -> tuple[RoutedLayer, ...]:
        """Every mixture-of-experts layer inside the blocks."""
        return tuple(r for b in self.blocks for r in b.routed)

    def ep_problem(self, ep: int) -> Optional[str]:
        """Why expert parallelism over ``ep`` ranks cannot split this model's experts, or None."""
        for r in self.routed:
            if r.kind != "bank":
                return (f"ep={ep}: the experts of {r.name} are a list of {r.experts} modules; expert parallelism "
                        f"splits 3-D banks only")
            if r.experts % ep:
                return f"ep={ep} must divide the {r.experts} experts of {r.name}"
        return None


def _figures(block: BlockProfile) -> BlockProfile:
    """What a layout's cost and memory read of a block: everything but its (and its routed layers') names."""
    return dataclasses.replace(block, name="", routed=tuple(dataclasses.replace(r, name="") for r in block.routed))


def profile_model(module: nn.Module, *, seq_len: int, dtype: torch.dtype = torch.float32,
                  forward: Optional[ForwardFn] = None, blocks: Optional[Union[str, Sequence[str]]] = None,
                  tp_plan: Union[str, Mapping[str, str]] = "auto", max_tp: int = 8) -> ModelProfile:
    """Measure ``module``'s per-block figures on the meta device (a real module is copied to meta, not touched).
    ``forward(model, ids)`` as in ``estimate_memory``; ``max_tp`` bounds the tensor-parallel sizes checked."""
    containers = (blocks,) if isinstance(blocks, str) else tuple(blocks) if blocks is not None else \
        find_block_sequences(module)
    shortened: dict[str, int] = {}
    try:
        with _truncated(module, containers, KEEP) as lengths:
            shortened = dict(lengths)
            copy = meta_copy(module, dtype)
        return _profile(module, copy, shortened, seq_len, dtype, forward, blocks, tp_plan, max_tp)
    except (IndexError, KeyError, RuntimeError, ValueError):
        if not shortened:
            raise
    # a forward that counts its blocks (``for i in range(n_layers)``) fails on the shortened copy: the whole one
    return _profile(module, meta_copy(module, dtype), {}, seq_len, dtype, forward, blocks, tp_plan, max_tp)


def _profile(module: nn.Module, copy: nn.Module, lengths: Mapping[str, int], seq_len: int, dtype: torch.dtype,
             forward: Optional[ForwardFn], blocks: Any, tp_plan: Any, max_tp: int) -> ModelProfile:
    """The figures of ``copy`` (``module`` on meta, its stacks shortened to the first blocks: ``lengths``)."""
    sequence = block_sequence(copy, blocks)
    n = len(sequence.members)  # a stage per block: the planner's per-stage bytes per block
    partition = plan_partition(copy, n, sequence=sequence)
    flops, flops_total, attention = _flops(copy, partition.names, seq_len, forward)
    layers = find_experts(copy)
    routed = [_routed(copy, layers, names) for names in partition.members]
    expert_flops = [seq_len * sum(r.flops_per_token for r in layers) for layers in routed]
    flops = [f + e for f, e in zip(flops, expert_flops)]
    flops_total += sum(expert_flops)
    figures = {}
    plans = {}
    for tp in (1, 2):
        try:
            figures[tp], plans[tp] = _at_tp(copy, partition, tp, seq_len, dtype, forward, blocks, tp_plan)
        except TensorParallelConfigError:
            figures[tp], plans[tp] = figures[1], plans[1]  # tp = 2 does not divide: no tp at all
    (params1, saved1, kept1, full1, pp1), (params2, saved2, kept2, full2, _) = figures[1], figures[2]
    banks1, banks2 = pp1["experts"], figures[2][4]["experts"]
    exchange = [0.0] * len(full1)  # bytes per sequence the all-to-all's rows add to a block under ep (any ep > 1)
    if any(routed) and all(r.kind == "bank" and r.experts % 2 == 0 for layers in routed for r in layers):
        at_ep = _at_tp(copy, partition, 1, seq_len, dtype, forward, blocks, tp_plan, ep=2)[0][3]
        exchange = [max(e - f, 0.0) for e, f in zip(at_ep, full1)]
    choices = [1] + [t for t in range(2, max_tp + 1) if plans[2].blocks and _divides(plans[2], t)]
    styles = plans[2].styles
    block_list = []
    kinds = _kinds(copy, [names[0] for names in partition.members], partition.blocks)
    for i, names in enumerate(partition.members):
        red = sum(1 for m, s in styles.items() if s in REDUCING and any(_inside(m, b) for b in names))
        block_list.append(BlockProfile(names[0], kinds[i], Scaled.fit(params1[i], params2[i]),
                                       Scaled.fit(full1[i], full2[i]), Scaled.fit(kept1[i], kept2[i]),
                                       Scaled(flops[i], flops[i] if red else 0.0), red,
                                       Scaled.fit(banks1[i], banks2[i]), routed[i], exchange[i],
                                       int(pp1["tensors"][i]), attention[i][0] or 2.0 * pp1["sent"],
                                       *attention[i][1:]))
    block_list = _expand(block_list, partition.blocks, lengths)
    ends = set(partition.pre) | set(partition.post)
    vocab = sum(1 for m, s in styles.items() if s in ("vocab", "colwise_gather") and m in ends)
    last = n - 1
    return ModelProfile(
        tuple(block_list), Scaled.fit(pp1["first"], figures[2][4]["first"]),
        Scaled.fit(pp1["last"], figures[2][4]["last"]),
        Scaled.fit(saved1[0] - full1[0], saved2[0] - full2[0]),
        Scaled.fit(saved1[last] - full1[last], saved2[last] - full2[last]),
        Scaled(flops_total - sum(flops), flops_total - sum(flops) if vocab else 0.0),
        float(pp1["sent"]), seq_len, torch.empty((), dtype=dtype).element_size(), tuple(choices), vocab,
        int(sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())),
        (int(pp1["first_tensors"]), int(pp1["last_tensors"])),
        Scaled.fit(pp1["transient"], figures[2][4]["transient"]),
        Scaled.fit(pp1["shared"], figures[2][4]["shared"]), _cp_problem(copy, partition.names))


def _cp_problem(copy: nn.Module, blocks: Sequence[str]) -> Optional[str]:
    """Why ``cp > 1`` is refused at setup for this model (``steps._context_runs``), or None."""
    mixing = mixing_layers(copy, list(blocks))
    return f"cp: {mixing[0]}" if mixing else None


def _kinds(copy: nn.Module, names: Sequence[str], containers: Sequence[str]) -> list[str]:
    """The timing key of each block: its container, as its blocks are alike; a block whose class or parameter shapes
    differ from its container's last (T5's first, which holds the relative position bias and computes it for the
    others: measured 10-25% slower than the next) is its own kind, timed apart."""
    def signature(name: str) -> tuple:
        module = copy.get_submodule(name)
        return type(module), tuple((n, tuple(p.shape)) for n, p in module.named_parameters())

    container_of = [next((c for c in containers if _inside(n, c)), n) for n in names]
    last = {c: signature(n) for n, c in zip(names, container_of)}  # the container's last block (kept by _expand)
    return [c if signature(n) == last[c] else n for n, c in zip(names, container_of)]


@contextmanager
def _truncated(module: nn.Module, containers: Sequence[str], keep: int) -> Iterator[dict[str, int]]:
    """While it is open, each container of same-class, same-shape blocks holds only its first ``keep`` blocks (the
    model is put back as it was on exit): the copy measured costs ``keep`` blocks per container, whatever the depth.
    Yields each shortened container's real length."""
    lengths: dict[str, int] = {}
    undo = []
    for name in containers:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else None
        stack = getattr(parent, attr, None) if parent is not None else None
        if not isinstance(stack, (nn.ModuleList, nn.Sequential)) or len(stack) <= keep or not _alike(stack):
            continue
        try:
            short = type(stack)(*list(stack)[:keep]) if isinstance(stack, nn.Sequential) else \
                nn.ModuleList(list(stack)[:keep])
        except TypeError:  # a Sequential subclass built another way: measured whole
            continue
        undo.append((parent, attr, stack))
        parent._modules[attr] = short
        lengths[name] = len(stack)
    try:
        yield lengths
    finally:
        for parent, attr, stack in undo:
            parent._modules[attr] = stack


def _alike(stack: nn.Module) -> bool:
    """Blocks of one class with the same parameter shapes: any one of them measures for all."""
    shapes = {(type(m), tuple((n, tuple(p.shape)) for n, p in m.named_parameters())) for m in stack.children()}
    return len(shapes) == 1


def _expand(measured: list[BlockProfile], containers: Sequence[str], lengths: Mapping[str, int]
            ) -> list[BlockProfile]:
    """The whole model's blocks from a shortened copy's: a shortened container's later blocks are its last
    measured one (renamed)."""
    out = []
    for block in measured:
        out.append(block)
        container = next((c for c in containers if _inside(block.name, c)), None)
        if container is None or container not in lengths:
            continue
        index = int(block.name[len(container) + 1:].split(".")[0])
        if index == KEEP - 1:
            out += [dataclasses.replace(block, name=f"{container}.{i}", routed=tuple(
                dataclasses.replace(r, name=f"{container}.{i}" + r.name[len(block.name):]) for r in block.routed))
                for i in range(KEEP, lengths[container])]
    return out


def _inside(name: str, outer: str) -> bool:
    return name == outer or name.startswith(outer + ".")


def _divides(plan: Any, tp: int) -> bool:
    try:
        check_divisible(plan, tp)
    except TensorParallelConfigError:
        return False
    return True


def _at_tp(copy: nn.Module, partition: Any, tp: int, seq_len: int, dtype: torch.dtype, forward: Optional[ForwardFn],
           blocks: Any, tp_plan: Any, ep: int = 1) -> tuple[Any, Any]:
    """Per block at tensor-parallel size ``tp`` (and expert-parallel ``ep``): parameters kept, bytes saved
    (checkpointing on, and off), and the parameters outside the blocks on the first and last stage."""
    twin = meta_copy(copy, dtype)
    config = planning_config(tp, 1, 1, blocks=blocks, tp_plan=tp_plan, ep=ep)
    state = run(twin, config, meta_groups(config), dims=MeshDims(1, 1, tp), until="coverage").state
    assert state is not None
    plan = state.plan
    modules = dict(twin.named_modules())
    params = [float(sum(p.numel() for b in names for p in modules[b].parameters())) for names in partition.members]
    inside = {id(p) for names in partition.members for b in names for p in modules[b].parameters()}
    ends: dict[str, Any] = {}
    owned = {}
    for side, names in (("first", partition.pre), ("last", partition.post)):
        owned[side] = own = {id(p): p for m in names for p in modules[m].parameters() if id(p) not in inside}
        ends[side] = float(sum(p.numel() for p in own.values()))
        ends[f"{side}_tensors"] = len(own)
    ends["shared"] = float(sum(p.numel() for i, p in owned["first"].items() if i in owned["last"]))  # tied
    ends["tensors"] = [len({id(p) for b in names for p in modules[b].parameters()}) for names in partition.members]
    pp_dims = MeshDims(1, 1, tp)
    per_stage, saved, _, _, transient = activations_per_stage(copy, plan, partition, pp_dims, 1, seq_len, dtype,
                                                              False, forward, ep)
    _, kept_saved, recompute, _, _ = activations_per_stage(copy, plan, partition, pp_dims, 1, seq_len, dtype, True,
                                                           forward, ep)
    n = partition.stages
    full = [float(recompute.get(i, 0)) for i in range(n)]  # each block's saved bytes, checkpointing off
    kept = [float(kept_saved.get(i, 0)) - (float(saved.get(i, 0)) - full[i]) for i in range(n)]
    ends["sent"] = float(per_stage.get(0, 0) - saved.get(0, 0)) if n > 1 else 0.0
    ends["transient"] = float(transient.get(n - 1, 0))
    banks = {layer.experts for layer in find_experts(twin)}
    ends["experts"] = [float(sum(p.numel() for b in names for m, mod in modules.items() if m in banks
                                 and _inside(m, b) for p in mod.parameters())) for names in partition.members]
    return (params, [float(saved.get(i, 0)) for i in range(n)], [max(k, 0.0) for k in kept], full, ends), plan


class _Attention(TorchFunctionMode):
    """The bytes of the keys and values the attention calls read, and their query x key FLOPs (a block's figures
    for context parallelism's terms)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys = self.flops = self.queries = self.joined = 0.0
        self.heads = self.kv_heads = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and len(args) >= 3:
            q, k, v = args[:3]
            self.keys += float(k.nbytes + v.nbytes)
            self.queries += float(q.nbytes)
            self.heads = int(q.shape[1]) if q.dim() == 4 else 0
            self.kv_heads = int(k.shape[1]) if k.dim() == 4 else 0
            flops = 2.0 * q.numel() / q.shape[-1] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
            self.flops += flops
            options = {**dict(zip(("attn_mask", "dropout_p", "is_causal"), args[3:])), **kwargs}
            rest = {n: o for n, o in options.items() if n not in ("attn_mask", "dropout_p", "is_causal")}
            if joinable(q, k, v, options.get("attn_mask"), options.get("dropout_p", 0.0),
                        bool(options.get("is_causal")), rest):  # what the CPU route joins (context_parallel.attention)
                self.joined += flops
        elif func is F.multi_head_attention_forward and len(args) >= 3:  # its inputs are gathered under cp
            q, k, v = args[:3]
            self.keys += float(k.nbytes + (v.nbytes if v is not k else 0))
            self.flops += 4.0 * q.numel() * k.shape[0]
        return func(*args, **kwargs)


def _flops(copy: nn.Module, names: Sequence[str], seq_len: int, forward: Optional[ForwardFn]
           ) -> tuple[list[float], float, list[tuple[float, float]]]:
    """Forward FLOPs per sequence of each block (tp = 1), and of the whole forward (loss included), counted by
    ``FlopCounterMode`` on the meta copy; blocks after the second of the same class and shapes are not run again
    (their count is the second's) so that an 80-layer model costs about two layers of meta operations. And per
    block, the bytes of the keys and values its attention calls read and their FLOPs (:class:`_Attention`)."""
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    modules = dict(copy.named_modules())
    done: dict[Any, tuple[float, Any, tuple[float, float, float, int, int, float]]] = {}
    per_block = [0.0] * len(names)
    attention = [(0.0, 0.0, 0.0, 0, 0, 0.0)] * len(names)
    counter = FlopCounterMode(display=False)

    def run(i: int, block: nn.Module, original: Any, *args: Any, **kwargs: Any) -> Any:
        kind = (type(block), tuple((n, tuple(p.shape)) for n, p in block.named_parameters()),
                tuple(tuple(a.shape) if isinstance(a, Tensor) else type(a).__name__ for a in args))
        if kind in done:
            per_block[i], result, attention[i] = done[kind]
            return _fresh(result)
        before = _total(counter)
        with _Attention() as calls:
            result = original(*args, **kwargs)
        per_block[i] = float(_total(counter) - before)
        attention[i] = (calls.keys, calls.flops, calls.queries, calls.heads, calls.kv_heads, calls.joined)
        done[kind] = (per_block[i], result, attention[i])
        return result

    originals = {}
    for i, name in enumerate(names):
        block = modules[name]
        originals[name] = block.forward
        block.forward = functools.partial(run, i, block, block.forward)
    try:
        with counter, torch.no_grad(), DataDependentOnMeta():  # routed layers: shapes only (see the module)
            (forward or _default_forward)(copy, ids)
    finally:
        for name, original in originals.items():
            modules[name].forward = original
    skipped = sum(per_block) - sum(_ran(done))
    return per_block, float(_total(counter) + skipped), attention


def _routed(copy: nn.Module, layers: Sequence[MoELayer], names: Sequence[str]) -> tuple[RoutedLayer, ...]:
    """The mixture-of-experts ``layers`` inside the blocks ``names`` (a layer whose top-k is not found counts one)."""
    out = []
    for layer in layers:
        if not any(_inside(layer.experts, b) for b in names):
            continue
        bank = copy.get_submodule(layer.experts)
        params = float(sum(p.numel() for p in bank.parameters()))
        hidden = layer.bank.hidden if layer.bank is not None else _list_hidden(bank)
        out.append(RoutedLayer(layer.experts, layer.kind, layer.count, top_k(copy, layer) or 1, hidden, params))
    return tuple(out)


def _list_hidden(experts: nn.Module) -> int:
    """The input features of a list of experts (its first expert's first linear layer)."""
    first = next(m for m in experts.modules() if isinstance(m, nn.Linear))
    return int(first.in_features)


def _ran(done: Mapping[Any, tuple[float, Any, Any]]) -> list[float]:
    return [f for f, _, _ in done.values()]


def _total(counter: FlopCounterMode) -> int:
    return int(counter.get_total_flops())


def _fresh(result: Any) -> Any:
    if isinstance(result, Tensor):
        return torch.empty_like(result)
    if isinstance(result, (tuple, list)):
        return type(result)(_fresh(r) for r in result)
    return result
