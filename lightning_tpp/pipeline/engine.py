"""Run a pipeline schedule inside the Trainer's step: split the batch, execute this rank's actions, exchange
activations and gradients with the neighbouring stages, and hand every rank the step's loss and logged values.

Sends are asynchronous (``isend``, waited at the end of the step); receives block when the data is needed. The
receiver learns shapes and dtypes from a small header sent with each activation, so a new sequence length or dtype
is simply a new header: nothing is negotiated once and then trusted.

Gradients the schedule produces inside ``training_step`` are parked: Lightning zeroes gradients *after*
``training_step`` and then calls backward; :meth:`PipelineEngine.restore_grads` (from the strategy's backward)
adds them back, so ``zero_grad`` and gradient accumulation behave as without a pipeline.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_tpp._compat import tree_flatten, tree_map, tree_unflatten
from lightning_tpp.pipeline.partition import Partition
from lightning_tpp.pipeline.schedule import actions
from lightning_tpp.pipeline.stage import Route, RunContext, StageOutput, StageRuntime, plan_routes, trace
from lightning_tpp.pipeline.wgrad import DeferWeightGrads, WeightGrads

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]
_MAX_DIMS = 8
_HEADER = 3 + _MAX_DIMS  # dtype, requires_grad, ndim, dims...
_MAX_LEAVES = 64  # tensors per bundle


class PipelineError(RuntimeError):
    """A pipeline step cannot run as the model and batch are."""


@dataclass
class _MicroBatch:
    inputs: dict[int, list[Tensor]] = field(default_factory=dict)  # received, per sending stage (graph leaves)
    outputs: dict[int, list[Tensor]] = field(default_factory=dict)  # sent, per receiving stage (graph roots)
    grads: dict[int, list[tuple[Tensor, Any]]] = field(default_factory=dict)  # posted receives of their gradients
    loss: Optional[Tensor] = None
    weight_grads: WeightGrads = field(default_factory=WeightGrads)  # ``W`` work filed by the backward
    deferred: Optional[tuple[list[Tensor], Optional[list[Tensor]]]] = None  # a whole backward put off to ``W``


def split_batch(batch: Any, n: int) -> tuple[list[Any], list[float]]:
    """``n`` micro-batches (every tensor leaf cut along dim 0, other leaves repeated) and each one's share of the
    batch. A batch size that ``n`` does not divide (an epoch's last batch) gives sizes that differ by one; the shares
    weight each micro-batch's loss so that the step still optimises the mean over the whole batch."""
    leaves, spec = tree_flatten(batch)
    sizes = {t.shape[0] for t in leaves if isinstance(t, Tensor) and t.dim() > 0}
    if not sizes:
        raise PipelineError("the batch holds no tensor with a batch dimension to split into micro-batches")
    if len(sizes) > 1:
        raise PipelineError(f"batch tensors disagree on the batch size (dim 0): {sorted(sizes)}")
    size = sizes.pop()
    if size < n:
        raise PipelineError(f"batch size {size} is smaller than microbatches={n}: every micro-batch needs a sample. "
                            f"Use batches of at least {n} samples (drop_last=True drops a short last batch) or fewer "
                            f"microbatches")
    chunks = [t.tensor_split(n) if isinstance(t, Tensor) and t.dim() > 0 else [t] * n for t in leaves]
    shares = [len(range(size)[i::n]) / size for i in range(n)]  # tensor_split sizes, as fractions
    return [tree_unflatten([c[i] for c in chunks], spec) for i in range(n)], shares


class PipelineEngine:
    def __init__(self, module: nn.Module, partition: Partition, runtime: StageRuntime, *, rank: int, pp: int,
                 virtual: int, schedule: str, microbatches: int, group: Any, stage_rank: Callable[[int], int],
                 chunk_params: list[list[nn.Parameter]], tied: list[tuple[nn.Parameter, Any]],
                 ancestor_params: tuple[str, ...] = ()) -> None:
        self.module, self.partition, self.runtime = module, partition, runtime
        self.rank, self.pp, self.virtual = rank, pp, virtual
        self.schedule, self.microbatches = schedule, microbatches
        self.group, self.stage_rank = group, stage_rank  # pp rank -> global rank (same dp and tp coordinates)
        self.last_rank = stage_rank((partition.stages - 1) % pp)
        self.chunk_params, self.tied, self.ancestor_params = chunk_params, tied, ancestor_params
        self._route_cache: dict[Any, list[Route]] = {}
        self._headers: dict[tuple[int, int, int], tuple[Tensor, Any]] = {}  # (mb, src, dst) -> posted header recv
        # receives posted ahead need messages matched by tag (gloo); NCCL matches a pair's messages in posting order
        self._early = dist.get_backend(group) != "nccl"
        self.order = actions(schedule, rank, pp, microbatches, virtual)
        self._sends: list[Any] = []
        self._parked: dict[nn.Parameter, Tensor] = {}
        self.trace: Optional[list[tuple[str, int, int, float, float, float]]] = None  # see record_trace
        self.position: Optional[tuple[str, int, int]] = None
        self._waited = 0.0

    def record_trace(self, enabled: bool = True) -> None:
        """Record ``(kind, microbatch, chunk, start, end, seconds waiting for peers)`` per action (perf_counter)."""
        self.trace = [] if enabled else None

    # ------------------------------------------------------------------------------------------------------------
    # which values cross stages (traced once per kind of step and batch structure)

    def _routes(self, kind: str, step: Callable[[Any], Any], micro: Any) -> list[Route]:
        leaves, spec = tree_flatten(micro)
        key = (kind, str(spec), tuple((t.dim(), t.dtype) if isinstance(t, Tensor) else type(t).__name__
                                      for t in leaves))
        if key not in self._route_cache:
            sources = {}  # parameters on the first stage, zero buffers of the same name elsewhere
            for fqn in self.ancestor_params:
                owner_name, _, attr = fqn.rpartition(".")
                sources[fqn] = getattr(self.module.get_submodule(owner_name), attr)
            try:
                with _sandbox(self.module, self.runtime.device) as logged:
                    calls, result = trace(self.runtime, lambda: (step(micro), logged), sources)
            except Exception as err:
                raise PipelineError(
                    f"{kind} could not be traced to find which values cross pipeline stages: it runs once with "
                    f"zeros in place of every layer's output, and raised {type(err).__name__}: {err}. A step that "
                    f"cannot run on zeros (sampling from its outputs, asserting on their values) cannot be "
                    f"pipelined automatically") from err
            routes = plan_routes(self.runtime, calls, result, self.partition.stages)
            digest = repr([(k, sorted(map(repr, tags))) for k, tags in calls])
            every: list[Any] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(every, digest, group=self.group)
            if any(d != digest for d in every):
                raise PipelineError(f"the pipeline stages traced different forwards for one {kind} step (the forward "
                                    f"takes a different path on some ranks); it must call the same layers everywhere")
            self._route_cache[key] = routes
        return self._route_cache[key]

    # ------------------------------------------------------------------------------------------------------------
    # point-to-point: one bundle of tensors per micro-batch, stage pair and direction

    def _tag(self, mb: int, src: int, dst: int, kind: int, leaf: int = 0) -> int:
        """Unique per message of a step; both ends derive it from the stages (with interleaving a rank holds several,
        and one stage may feed several later ones)."""
        stages = self.partition.stages
        return (((mb * stages + src) * stages + dst) * 3 + kind) * _MAX_LEAVES + leaf

    def _rank_of_stage(self, stage: int) -> int:
        return self.stage_rank(stage % self.pp)

    def _isend(self, t: Tensor, dst: int, tag: int) -> None:
        self._sends.append(dist.isend(t.contiguous(), dst, tag=tag))

    def _post(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> tuple[Tensor, Any]:
        """Post a receive now (so that the transfer can happen while this rank computes); wait for it later."""
        buf = torch.empty(shape, dtype=dtype, device=self.runtime.device)
        return buf, dist.irecv(buf, src, tag=tag)

    def _wait(self, posted: list[tuple[Tensor, Any]]) -> list[Tensor]:
        start = time.perf_counter()
        for _, work in posted:
            work.wait()
        self._waited += time.perf_counter() - start
        return [buf for buf, _ in posted]

    def _post_headers(self, routes: list[Route], microbatches: int) -> None:
        """Every header this rank will receive in the step, posted up front: a bundle then costs one round trip."""
        for mb in range(microbatches if self._early else 0):
            for chunk in range(self.virtual):
                g = self._stage(chunk)
                for src, count in routes[g].inbound.items():
                    self._headers[(mb, src, g)] = self._post((count * _HEADER,), torch.int64,
                                                             self._rank_of_stage(src), self._tag(mb, src, g, 0))

    def _send_bundle(self, mb: int, src: int, dst: int, tensors: list[Tensor]) -> None:
        if len(tensors) > _MAX_LEAVES:
            raise PipelineError(f"{len(tensors)} tensors cross from pipeline stage {src} to {dst}; at most "
                                f"{_MAX_LEAVES} are supported")
        header = torch.zeros(len(tensors) * _HEADER, dtype=torch.int64, device=self.runtime.device)
        for i, t in enumerate(tensors):
            if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
                raise PipelineError(f"cannot send a {t.dim()}-d {t.dtype} activation between stages")
            row = [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
            header[i * _HEADER:i * _HEADER + len(row)] = torch.tensor(row)
        rank = self._rank_of_stage(dst)
        self._isend(header, rank, self._tag(mb, src, dst, 0))
        for i, t in enumerate(tensors):
            self._isend(t.detach(), rank, self._tag(mb, src, dst, 1, i))

    def _receive_bundle(self, mb: int, src: int, dst: int, count: int, state: _MicroBatch) -> list[Tensor]:
        if src in state.inputs:
            return state.inputs[src]
        rank = self._rank_of_stage(src)
        posted = self._headers.pop((mb, src, dst), None) or self._post(
            (count * _HEADER,), torch.int64, rank, self._tag(mb, src, dst, 0))
        header = self._wait([posted])[0].tolist()
        rows = [header[k * _HEADER:(k + 1) * _HEADER] for k in range(count)]
        out = self._wait([self._post(tuple(dims[:ndim]), _DTYPES[code], rank, self._tag(mb, src, dst, 1, k))
                          for k, (code, _, ndim, *dims) in enumerate(rows)])
        state.inputs[src] = [t.requires_grad_(True) if row[1] else t for t, row in zip(out, rows)]
        return state.inputs[src]

    # ------------------------------------------------------------------------------------------------------------
    # one forward / backward of one micro-batch on one chunk

    def _stage(self, chunk: int) -> int:
        return chunk * self.pp + self.rank

    def _forward(self, mb: int, chunk: int, step: Callable[[Any], Any], micro: Any, states: dict,
                 routes: list[Route], *, split: bool = False) -> Any:
        """Run stage ``chunk``'s part of the step; returns the step's result on the last stage. ``split``: the
        backward will be ``I`` then ``W``, so products with a weight matrix file their weight gradients for ``W``."""
        g = self._stage(chunk)
        route = routes[g]
        state = states[(mb, chunk)] = _MicroBatch()
        last = g == self.partition.stages - 1
        if not route.runs:
            return None
        ctx = RunContext(g, route, lambda s: self._receive_bundle(mb, s, g, route.inbound[s], state))
        self.runtime.ctx = ctx
        result = None
        try:
            with DeferWeightGrads(state.weight_grads) if split else contextlib.nullcontext():
                result = step(micro)
        except StageOutput:
            pass
        else:
            if not last:
                raise PipelineError(f"stage {g}: the step finished without calling "
                                    f"{self.runtime.units[route.stop_after[0]].name!r} (call {route.stop_after[1]}) "
                                    f"as the traced forward did; the step must run the model's forward")
        finally:
            self.runtime.ctx = None
        missing = [s for s in route.inbound if s not in state.inputs]
        if missing:
            raise PipelineError(f"stage {g}: the forward never used what stages {missing} send it, unlike the traced "
                                f"forward of this step; the forward must call the same layers on every step")
        for dst, items in route.outbound.items():
            tensors = [ctx.kept[key][leaf] for key, leaf in items]
            state.outputs[dst] = tensors
            self._send_bundle(mb, g, dst, tensors)
            if torch.is_grad_enabled() and self._early:  # the gradients will come back: post their receives now
                state.grads[dst] = self._post_grads(mb, g, dst, tensors)
        return result

    def _post_grads(self, mb: int, stage: int, dst: int, sent: list[Tensor]) -> list[tuple[Tensor, Any]]:
        rank = self._rank_of_stage(dst)
        return [self._post(tuple(t.shape), t.dtype, rank, self._tag(mb, dst, stage, 2, i))
                for i, t in enumerate(x for x in sent if x.requires_grad)]

    def _roots(self, mb: int, chunk: int, state: _MicroBatch, scale: float) -> tuple[list[Tensor], Optional[list]]:
        roots: dict[int, Tensor] = {}
        grads: dict[int, Tensor] = {}
        if state.loss is not None:
            roots[id(state.loss)], grads[id(state.loss)] = state.loss, torch.full_like(state.loss, scale)
        for dst, tensors in state.outputs.items():
            posted = state.grads.get(dst) or self._post_grads(mb, self._stage(chunk), dst, tensors)
            for t, grad in zip([t for t in tensors if t.requires_grad], self._wait(posted)):
                roots[id(t)], grads[id(t)] = t, grads[id(t)] + grad if id(t) in grads else grad
        return list(roots.values()), [grads[k] for k in roots]

    def _send_input_grads(self, mb: int, chunk: int, state: _MicroBatch, grads: dict[int, Optional[Tensor]]) -> None:
        g = self._stage(chunk)
        for src, tensors in state.inputs.items():
            rank = self._rank_of_stage(src)
            for i, t in enumerate(x for x in tensors if x.requires_grad):
                grad = grads.get(id(t))
                self._isend(grad if grad is not None else torch.zeros_like(t), rank, self._tag(mb, g, src, 2, i))

    def _backward(self, kind: str, mb: int, chunk: int, states: dict, scale: float) -> None:
        state: _MicroBatch = states[(mb, chunk)]
        inputs = [t for tensors in state.inputs.values() for t in tensors if t.requires_grad]
        if kind in ("B", "I"):
            roots, grads = self._roots(mb, chunk, state, scale)
            if kind == "I" and not (inputs and roots):
                state.deferred = (roots, grads)  # nothing to send upstream: the whole backward is weight work
            elif roots:
                torch.autograd.backward(roots, grads)
            sent = {} if state.deferred is not None else {id(t): t.grad for t in inputs}
            self._send_input_grads(mb, chunk, state, sent)
        if kind in ("B", "W"):  # B is I then W at once
            if state.deferred is not None and state.deferred[0]:
                torch.autograd.backward(*state.deferred)
            state.weight_grads.run()  # filed by the products made under DeferWeightGrads
            states[(mb, chunk)] = _MicroBatch(loss=state.loss.detach() if state.loss is not None else None)

    # ------------------------------------------------------------------------------------------------------------
    # steps

    def train_step(self, step: Callable[[Any], Any], batch: Any, *, loss_scale: float) -> Tensor:
        """Run the schedule over ``batch``; returns the mean micro-batch loss (the same tensor value on every stage)."""
        micro, shares = split_batch(batch, min(self.microbatches, _batch_size(batch)))
        order = self._order(len(micro))
        routes = self._routes("training_step", step, micro[0])
        self._post_headers(routes, len(micro))
        params = [p for chunk in self.chunk_params for p in chunk]
        previous = {p: p.grad for p in params}
        for p in params:
            p.grad = None
        states: dict[tuple[int, int], _MicroBatch] = {}
        scale = [loss_scale * share for share in shares]
        # split backwards, except on the first stage: it has no input gradients to send before the weight gradients
        splits = {(mb, chunk) for kind, mb, chunk in order if kind == "I" and self._stage(chunk) > 0}
        try:
            for kind, mb, chunk in order:
                self.position = (kind, mb, chunk)
                start, self._waited = time.perf_counter(), 0.0
                if kind == "F":
                    result = self._forward(mb, chunk, step, micro[mb], states, routes, split=(mb, chunk) in splits)
                    if self._stage(chunk) == self.partition.stages - 1:
                        states[(mb, chunk)].loss = _loss_of(result, self._stage(chunk))
                else:
                    self._backward(kind, mb, chunk, states, scale[mb])
                if self.trace is not None:
                    self.trace.append((kind, mb, chunk, start, time.perf_counter(), self._waited))
            self._wait_sends()
        finally:
            self.runtime.ctx = None
        self.position = None
        for p, group in self.tied:
            if group is not None:  # every holder joins, with zeros if its copy got no gradient (never a lone rank)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=group)
        self._parked = {p: p.grad for p in params if p.grad is not None}
        for p in params:
            p.grad = previous[p]
        losses = [s.loss.float() * shares[mb] for (mb, _), s in states.items() if s.loss is not None]
        mean = torch.stack(losses).sum() if losses else torch.zeros((), device=self.runtime.device)
        return self.broadcast_from_last(mean)

    def _order(self, m: int) -> list[tuple[str, int, int]]:
        """This rank's actions for ``m`` micro-batches: the configured schedule, or GPipe for a short batch (an
        epoch's last) that has fewer samples than the schedule needs. Every rank sees the same batch size."""
        if m == self.microbatches:
            return self.order
        try:
            return actions(self.schedule, self.rank, self.pp, m, self.virtual)
        except ValueError:
            if self.virtual > 1:
                raise PipelineError(f"a batch of {m} samples cannot run the interleaved schedule (needs a multiple of "
                                    f"pp={self.pp} micro-batches): use drop_last=True") from None
            return actions("gpipe", self.rank, self.pp, m)

    def describe_position(self) -> str:
        """Where the current step is, for failure messages: ' in stage 1, backward of micro-batch 3'."""
        if self.position is None:
            return ""
        kind, mb, chunk = self.position
        names = {"F": "forward", "B": "backward", "I": "input-gradient backward", "W": "weight-gradient backward"}
        return f" in pipeline stage {self._stage(chunk)}, {names[kind]} of micro-batch {mb}"

    def discard_grads(self) -> None:
        self._parked = {}

    def restore_grads(self) -> None:
        """Add the gradients of the last schedule back (after Lightning's ``zero_grad``)."""
        for p, g in self._parked.items():
            p.grad = g if p.grad is None else p.grad + g
        self._parked = {}

    def eval_step(self, step: Callable[[Any], Any], batch: Any, kind: str) -> Any:
        """Forward only, whole batch as one micro-batch, through every chunk of this rank in stage order."""
        states: dict[tuple[int, int], _MicroBatch] = {}
        routes = self._routes(kind, step, batch)
        result = None
        try:
            for chunk in range(self.virtual):
                out = self._forward(0, chunk, step, batch, states, routes)
                if self._stage(chunk) == self.partition.stages - 1:
                    result = out
            self._wait_sends()
        finally:
            self.runtime.ctx = None
        box = [tree_map(lambda t: t.detach().cpu() if isinstance(t, Tensor) else t, result)]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        return tree_map(lambda t: t.to(self.runtime.device) if isinstance(t, Tensor) else t, box[0])

    def broadcast_from_last(self, value: Tensor) -> Tensor:
        value = value.detach().float().reshape(()).contiguous()
        dist.broadcast(value, src=self.last_rank, group=self.group)
        return value

    def _wait_sends(self) -> None:
        for work in self._sends:
            work.wait()
        self._sends = []

    @property
    def holds_last(self) -> bool:
        return self.partition.stages - 1 in [self._stage(c) for c in range(self.virtual)]


def _batch_size(batch: Any) -> int:
    sizes = [t.shape[0] for t in tree_flatten(batch)[0] if isinstance(t, Tensor) and t.dim() > 0]
    return min(sizes) if sizes else 1


def _loss_of(result: Any, stage: int) -> Tensor:
    loss = result.get("loss") if isinstance(result, dict) else result
    if not isinstance(loss, Tensor):
        raise PipelineError(f"training_step on the last stage ({stage}) returned {type(result).__name__}; with "
                            f"pipeline parallelism it must return the loss (a tensor, or a dict with 'loss')")
    return loss


@contextlib.contextmanager
def captured_logs(module: Any) -> Iterator[list[tuple[str, Any, dict]]]:
    """Record ``module.log`` calls (``log_dict`` goes through ``log``) instead of logging them."""
    entries: list[tuple[str, Any, dict]] = []

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise PipelineError(f"self.log({name!r}, ...) with positional options is not supported under pipeline "
                                f"parallelism; pass them by keyword")
        entries.append((name, value, kwargs))

    module.log = log
    try:
        yield entries
    finally:
        del module.log


def metric_state(metric: Any) -> dict[str, Any]:
    """A copy of a torchmetrics object's accumulated state, on the CPU (updates add to the live state in place)."""
    cpu = lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else copy.deepcopy(v)  # noqa: E731
    state = {k: [cpu(x) for x in v] if isinstance(v, list) else cpu(v) for k, v in metric.metric_state.items()}
    return {"state": state, "forward_cache": cpu(metric._forward_cache), "update_count": metric._update_count}


def load_metric_state(metric: Any, payload: dict[str, Any], device: torch.device) -> None:
    dev = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    for k, v in payload["state"].items():
        setattr(metric, k, [dev(x) for x in v] if isinstance(v, list) else dev(v))
    metric._forward_cache = dev(payload["forward_cache"])
    metric._update_count = payload["update_count"]
    metric._computed = None


@contextlib.contextmanager
def _sandbox(module: Any, device: torch.device) -> Iterator[list[Tensor]]:
    """For a traced step: no gradients, random state and torchmetrics states restored afterwards, ``self.log``
    values collected (the tensors the last stage must be able to compute) instead of logged."""
    from torchmetrics import Metric

    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    saved = [metric_state(m) for m in metrics]
    logged: list[Tensor] = []
    previous = module.__dict__.get("log")
    module.log = lambda name, value, *args, **kwargs: logged.append(value)
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            yield logged
    finally:
        if previous is None:
            del module.log
        else:
            module.log = previous
        for m, state in zip(metrics, saved):
            load_metric_state(m, state, device)
