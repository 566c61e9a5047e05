"""A pipeline stage keeps the user's real modules and runs the model's *own* forward, unchanged.

Every module that holds parameters outside the blocks (embeddings, norms, heads) and every block module is a *unit*
with an owning stage, and gets a dispatcher. During the run of stage ``g``::

    unit owned by g           -> the real module; its output is kept if a later stage needs it
    unit owned by another     -> the output received from its owner, if this stage uses it, else zeros shaped like
                                 it (the shape comes from a meta-device twin; no parameters)
    g's last unit (g not last) -> then stop the forward (StageOutput) and send what later stages need

so masks, rotary tables and whatever the forward computes between units need no annotation, and the loss is the
user's own ``training_step`` on the last stage. Which outputs cross stages — the previous block's hidden state, but
also an encoder's output read by every decoder block, a conditioning vector read by every block, an embedding of the
decoder's input computed before the encoder — is found by :func:`trace`: one run of the step in which every unit
returns zeros and each tensor carries the set of unit outputs it was computed from. Modules of other stages are
replaced by :class:`_RemoteModule` (no parameters: its ``state_dict`` keys are gone, a subset of the single-device
keys remains).
"""

from __future__ import annotations

import contextlib
import copy
from functools import partial
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_tpp.core.meta_ops import DataDependentOnMeta
from lightning_tpp.pipeline.captured import recorded, replay
from lightning_tpp._compat import BatchNormBase, tree_flatten, tree_map, tree_unflatten
from lightning_tpp.core.seeding import seeded
from lightning_tpp.core.swap import original_class, parallel_class, swap_class
from lightning_tpp.core.vocab_cut import VocabCut
from lightning_tpp.core.walk import VERIFYING, Taint, tensors_in

Key = tuple[int, int]  # (unit, how many times it was called before in this forward)


class StageOutput(BaseException):
    """Raised after the last unit of a non-final stage to end the forward."""


class PipelineTraceError(ValueError):
    """The model's forward uses values across stages in a way a pipeline cannot run."""


@dataclass(frozen=True)
class Unit:
    name: str
    stage: int
    kind: str = "block"  # or "pre", "middle", "post": placed by where it is registered around the blocks


@dataclass
class Route:
    """What one stage does with the values crossing stages, for one kind of step."""

    incoming: dict[Key, dict[int, tuple[int, int]]] = field(default_factory=dict)  # call -> {leaf: (stage, slot)}
    inbound: dict[int, int] = field(default_factory=dict)  # producer stage -> tensors in its bundle
    outbound: dict[int, list[tuple[Key, int]]] = field(default_factory=dict)  # consumer stage -> (call, leaf)s
    keep: frozenset = frozenset()  # own calls whose outputs are sent
    stop_after: Optional[Key] = None  # own call after which a non-last stage ends its forward
    runs: bool = True  # whether the stage has anything to do in this step


@dataclass
class RunContext:
    stage: int
    route: Route
    fetch: Callable[[int], list[Tensor]]  # producer stage -> the tensors it sent this stage (received once)
    calls: dict[int, int] = field(default_factory=dict)
    kept: dict[Key, list[Any]] = field(default_factory=dict)
    tracer: Optional[Taint] = None
    trace: list[tuple[Key, frozenset]] = field(default_factory=list)
    stopping: bool = False  # the stage's last own call returned: its forward hook ends the stage's forward
    seed: Optional[int] = None  # this micro-batch's: its step draws from it, each unit call from (seed, call)


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (no memory, shapes only); a
    LightningModule's copy has no Trainer. Its batch normalisation runs on meta tensors (``momentum=None`` would read
    the value of ``num_batches_tracked``)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    trainer = module.__dict__.get("_trainer")
    if trainer is not None:
        memo[id(trainer)] = None
    twin = copy.deepcopy(module, memo)
    for m in twin.modules():  # momentum=None reads num_batches_tracked's value, which a meta tensor has not
        if isinstance(m, BatchNormBase) and m.momentum is None:
            m.momentum = 0.0  # shapes only: the twin's statistics are never read
    return twin


def _signature(obj: Any, depth: int = 0) -> Any:
    if isinstance(obj, Tensor):
        return ("T", tuple(obj.shape), obj.dtype)
    if depth > 4:
        return type(obj).__name__
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(v, depth + 1) for v in obj)
    if isinstance(obj, dict):
        return tuple((k, _signature(v, depth + 1)) for k, v in obj.items())
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return type(obj).__name__


def _to_meta(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    memo = {id(t): torch.empty_like(t.detach(), device="meta") for t in tensors_in((args, kwargs), set())}
    return copy.deepcopy((args, kwargs), memo)


class StageRuntime:
    """The state the dispatchers consult: the units, the current run, and a cache of output shapes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.units: list[Unit] = []
        self.ctx: Optional[RunContext] = None
        self._shapes: dict[tuple, Any] = {}

    def meta_output(self, twin: nn.Module, args: tuple, kwargs: dict) -> Any:
        key = (id(twin), _signature(args), _signature(kwargs))
        if key not in self._shapes:
            margs, mkwargs = _to_meta(args, kwargs)
            try:
                self._shapes[key] = _on_meta(twin, margs, mkwargs, contextlib.nullcontext())
            except Exception as err:  # noqa: BLE001 - raised if the second try fails too
                try:
                    self._shapes[key] = _on_meta(twin, margs, mkwargs, torch.device("meta"))
                except Exception:  # noqa: BLE001
                    raise err from None
        return self._shapes[key]

    def zeros(self, meta: Any) -> Any:
        return tree_map(lambda t: _zeros(t, self.device) if isinstance(t, Tensor) else t, meta)

    # compile=: the runtime's bookkeeping (which call of which unit, run or stand in) stays out of a compiled block's
    # graph, whose guards would otherwise specialise on it (a recompile per unit and call); ``real`` is compiled
    @partial(torch.compiler.disable, recursive=False)
    def dispatch(self, module: nn.Module, args: tuple, kwargs: dict, real: Optional[Callable[[], Any]]) -> Any:
        unit = module.__dict__[BINDING].index
        ctx = self.ctx
        if ctx is None or VERIFYING.get():  # outside a step, or a tensor-parallel block checking itself
            if real is None:
                raise RuntimeError(f"{self.units[unit].name} lives on another pipeline stage: run the model "
                                   f"through the Trainer (fit/validate/test/predict)")
            return real()
        n = ctx.calls.get(unit, 0)
        ctx.calls[unit] = n + 1
        key = (unit, n)
        if ctx.tracer is not None:
            return self._trace_call(module, key, args, kwargs)
        if self.units[unit].stage == ctx.stage:
            if real is None:
                raise RuntimeError(f"{self.units[unit].name} ran on stage {ctx.stage}, which does not hold it")
            with seeded(None if ctx.seed is None else hash((ctx.seed, unit, n)), self.device), recorded() as side:
                out = real()  # dropout draws the same wherever the unit runs; the step's own stream is untouched
            if key in ctx.route.keep:  # what its layers recorded (router logits) travels with its outputs
                ctx.kept[key] = tree_flatten((out, side))[0]
            if key == ctx.route.stop_after:
                ctx.stopping = True  # raised by _end_stage_forward, after the module's other forward hooks
            return out
        out, side = self.zeros(self.meta_output(module.__dict__[BINDING].twin, args, kwargs))
        wanted = ctx.route.incoming.get(key)
        if wanted:
            leaves, spec = tree_flatten((out, side))
            for leaf, (stage, slot) in wanted.items():
                leaves[leaf] = ctx.fetch(stage)[slot]
            out, side = tree_unflatten(leaves, spec)
        replay(side)
        return out

    def _trace_call(self, module: nn.Module, key: Key, args: tuple, kwargs: dict) -> Any:
        ctx = self.ctx
        assert ctx is not None and ctx.tracer is not None
        ctx.trace.append((key, ctx.tracer.of((args, kwargs))))
        ctx.tracer.paused = True
        try:
            out, side = self.zeros(self.meta_output(module.__dict__[BINDING].twin, args, kwargs))
        finally:
            ctx.tracer.paused = False
        for i, leaf in enumerate(tree_flatten((out, side))[0]):
            if isinstance(leaf, Tensor):
                ctx.tracer.tag(leaf, frozenset([(key, i)]))
        replay(side)
        return out


def _zeros(t: Tensor, device: torch.device) -> Tensor:
    """Zeros shaped like ``t`` on ``device``; logits cut along the vocabulary (context parallelism's head) stay cut."""
    if isinstance(t, VocabCut):
        return t.like(torch.zeros(t._tpp_local.shape, dtype=t.dtype, device=device))
    return torch.zeros(t.shape, dtype=t.dtype, device=device)


def trace(runtime: StageRuntime, run: Callable[[], Any], sources: dict[str, Tensor]
          ) -> tuple[list[tuple[Key, frozenset]], frozenset]:
    """Run ``run`` (the user's step, which returns what the last stage consumes) with every unit returning zeros and
    each tensor tagged with the unit outputs it depends on. Returns ``(call, tags of its inputs)`` per unit call in
    order, and the tags of the result. ``sources`` are tensors tagged ``("param", name)`` (root-level parameters)."""
    tracer = Taint()
    runtime.ctx = RunContext(-1, Route(), lambda s: [], tracer=tracer)
    for name, t in sources.items():
        tracer.tag(t, frozenset([(("param", name), 0)]))
    try:
        with tracer:
            result = run()
            result_tags = tracer.of(result)
        return runtime.ctx.trace, result_tags
    finally:
        runtime.ctx = None


def plan_routes(runtime: StageRuntime, calls: list[tuple[Key, frozenset]], result: frozenset, stages: int
                ) -> list[Route]:
    """Each stage's :class:`Route` from a :func:`trace`: a stage receives every unit output (leaf) its own units,
    or (last stage) the step's result, were computed from, from the unit's owner."""
    owner = lambda key: 0 if key[0] == "param" else runtime.units[key[0]].stage  # noqa: E731
    name = lambda key: key[1] if key[0] == "param" else runtime.units[key[0]].name  # noqa: E731
    needs: dict[int, list[tuple[Key, int]]] = {g: [] for g in range(stages)}
    consumers = [(key, runtime.units[key[0]].stage, tags) for key, tags in calls]
    consumers.append((None, stages - 1, result))
    for key, stage, tags in consumers:
        for src, leaf in tags:
            if owner(src) == stage:
                continue
            what = f"unit {name(key)!r}" if key is not None else "the step's result (loss, outputs)"
            if src[0] == "param":
                raise PipelineTraceError(
                    f"parameter {name(src)!r} of the module above the blocks is used by {what} on pipeline stage "
                    f"{stage}, but lives on stage 0 (the forward uses it after the blocks have started). Move it "
                    f"into a submodule (e.g. the head) so that it can be placed on that stage")
            if owner(src) > stage and runtime.units[src[0]].kind == "block":
                raise PipelineTraceError(
                    f"{what} on pipeline stage {stage} uses the output of {name(src)!r}, which runs on the later "
                    f"stage {owner(src)}: the forward does not call its layers in the order they are registered. "
                    f"Pass blocks=[...] (the containers, in the order the forward runs them) or split_points=[...]")
            if owner(src) > stage:
                raise PipelineTraceError(
                    f"{what} on pipeline stage {stage} uses the output of {name(src)!r}, which is registered after "
                    f"the blocks and so lives on stage {owner(src)}, but the forward calls it before them: assign it "
                    f"in __init__ before the blocks (modules are placed by the order they are registered)")
            if (src, leaf) not in needs[stage]:
                needs[stage].append((src, leaf))
    order = {key: i for i, (key, _) in enumerate(calls)}
    routes = []
    for g in range(stages):
        route = Route()
        for s in range(stages):
            mine = sorted((item for item in needs[g] if owner(item[0]) == s), key=lambda it: (order[it[0]], it[1]))
            if mine:
                route.inbound[s] = len(mine)
            for slot, (src, leaf) in enumerate(mine):
                route.incoming.setdefault(src, {})[leaf] = (s, slot)
            theirs = sorted((item for item in needs[s] if owner(item[0]) == g), key=lambda it: (order[it[0]], it[1]))
            if theirs:
                route.outbound[s] = theirs
        route.keep = frozenset(src for items in route.outbound.values() for src, _ in items)
        own = [key for key, _ in calls if runtime.units[key[0]].stage == g]
        route.stop_after = own[-1] if own and g < stages - 1 else None
        route.runs = g == stages - 1 or bool(own)
        routes.append(route)
    return routes


def _on_meta(twin: nn.Module, args: tuple, kwargs: dict, default_device: Any) -> tuple[Any, Any]:
    """The block's meta twin run on meta inputs (routed layers on meta), and what its layers recorded. Tried first on
    the default device as it is (a block may read a value it makes, ``.item()``), then with meta as the default (a
    mask it makes without naming a device, on a CPU run, cannot meet a meta input)."""
    with torch.no_grad(), default_device, DataDependentOnMeta(), recorded(remove=True) as side:
        return twin(*args, **kwargs), side


class _PipelineDispatch:
    """Mixin for this rank's units: ask the runtime whether to run."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        own = self.__dict__.get(_COMPILED) or super(_PipelineDispatch, self).forward
        real = lambda: own(*args, **kwargs)  # noqa: E731
        return self.__dict__[BINDING].runtime.dispatch(self, args, kwargs, real)


_COMPILED = "_tpp_pp_compiled"


def compile_dispatched(module: nn.Module, compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """``compile=`` on a unit of this rank: its own forward compiled, run by the runtime's dispatch, which stays
    eager (compiled around it, each call went through two graphs with a break between). Returns whether ``module``
    is such a unit."""
    if not isinstance(module, _PipelineDispatch):
        return False
    module.__dict__[_COMPILED] = compile_fn(super(_PipelineDispatch, module).forward)
    return True


class _RemoteModule(nn.Module):
    """Stands in for a module held by another stage: no parameters; attributes read through to a meta twin. Made by
    :func:`remote_module` as an instance of the module's own class too (``_RemoteModule[CLIPEncoderLayer]``), so that
    code which finds layers by class still finds it: Hugging Face's ``output_hidden_states`` hooks every layer of its
    decoder/encoder class, and a stand-in of another class left LLaVA's ``hidden_states[-2]`` out of range."""

    def __init__(self, twin: nn.Module, runtime: StageRuntime, *, unit: int) -> None:
        nn.Module.__init__(self)  # not the module's own __init__ (its class is a base of this one's)
        self.__dict__[BINDING] = UnitBinding(runtime, twin, unit)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__[BINDING].runtime.dispatch(self, args, kwargs, None)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__[BINDING].twin, name)

    def extra_repr(self) -> str:
        binding = self.__dict__[BINDING]
        unit = binding.runtime.units[binding.index]
        return f"remote {unit.name} (stage {unit.stage})"


def remote_module(twin: nn.Module, runtime: StageRuntime, *, unit: int) -> _RemoteModule:
    """The stand-in of a unit another stage holds, an instance of ``_RemoteModule`` and of the unit's class."""
    cls = parallel_class(_RemoteModule, original_class(twin))
    remote = cls.__new__(cls)
    _RemoteModule.__init__(remote, twin, runtime, unit=unit)
    return remote


# the one attribute a pipeline unit carries: which runtime dispatches its calls, its meta twin, its index
BINDING = "_tpp_unit"


@dataclass(frozen=True)
class UnitBinding:
    runtime: StageRuntime
    twin: nn.Module  # on the meta device: output shapes of calls another stage runs
    index: int  # in ``runtime.units``


def _set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def mark_dispatch(module: nn.Module, runtime: StageRuntime, *, unit: int, twin: nn.Module) -> None:
    module.__dict__[BINDING] = UnitBinding(runtime, twin, unit)
    swap_class(module, _PipelineDispatch)
    end_stage_forward_last(module)


_STOP_HOOK = "_tpp_stop_hook"


def _end_stage_forward(module: nn.Module, args: Any, output: Any) -> None:
    ctx = module.__dict__[BINDING].runtime.ctx
    if ctx is not None and ctx.stopping:
        ctx.stopping = False
        raise StageOutput()


def end_stage_forward_last(module: nn.Module) -> None:
    """(Re-)register the hook that ends a stage's forward after its last own unit returns, as the unit's last
    forward hook: hooks added since (FSDP2's post-forward: reshard, pre-backward hook) run before the forward is cut
    short. ``module``: a unit, or the model (every unit in it)."""
    for m in module.modules():
        handle = m.__dict__.pop(_STOP_HOOK, None)
        if handle is not None or m is module and BINDING in m.__dict__:
            if handle is not None:
                handle.remove()
            m.__dict__[_STOP_HOOK] = m.register_forward_hook(_end_stage_forward)
