"""Execute this rank's schedule actions: split the batch into micro-batches, run each ``F``/``B``/``I``/``W`` on its
chunk's stage, and collect the last stage's loss. What crosses stages is decided by the routes, traced once per kind
of step and batch structure; moving it is the :class:`~lightning_tpp.pipeline.transport.Transport`'s job.

A rank holds the stages ``chunk * pp + rank``::

    pp=2, v=2:   rank 0: stages 0, 2      rank 1: stages 1, 3      (a micro-batch goes 0 -> 1 -> 2 -> 3)

``F`` runs the user's own step with this stage's units real and the others stand-ins (``stage``), stopping after
the stage's last unit; ``B`` runs autograd from the sent outputs (their gradients received) and the loss; ``I``
computes only what the previous stage waits for, ``W`` the weight gradients filed under ``DeferWeightGrads``.

What the rank is doing is kept where the failure messages, the metrics and the hang report read it: the action
(``position``), each step's :class:`StepTimes`, and, while a timeline records, each action's span (``trace``).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_tpp._compat import collect_rng_states, set_rng_states, tree_flatten
from lightning_tpp.core.recompute import replay_on_recompute
from lightning_tpp.core.seeding import seeded
from lightning_tpp.core.token_mean import Counts, LossNormalization, TokenMean, TokenWarnings, count_tokens, \
    global_totals
from lightning_tpp.pipeline.errors import PipelineError
from lightning_tpp.pipeline.logging import collected_values, kept_metric_states
from lightning_tpp.pipeline.microbatch import batch_size, combinable, combine, split_batch
from lightning_tpp.pipeline.partition import Partition
from lightning_tpp.pipeline.schedule import Action, split_backwards
from lightning_tpp.pipeline.stage import Route, RunContext, StageOutput, StageRuntime, plan_routes, trace
from lightning_tpp.pipeline.transport import Posted, Transport
from lightning_tpp.pipeline.wgrad import DeferWeightGrads, WeightGrads

Step = Callable[[Any], Any]  # the user's step on one micro-batch (training_step, validation_step, ...)
Trace = list[tuple[str, int, int, float, float, float]]  # see Executor.trace
COST_KINDS = ("F", "FS", "B", "I", "W")  # what StepTimes.costs times: the action kinds, "FS" the split F among "F"


@dataclass(frozen=True)
class StepTimes:
    """Where one schedule's time went on this rank (``perf_counter`` seconds): from the first action's start to the
    completion of the last send, of which ``send`` sending and ``recv`` blocked receiving; the rest is compute.
    ``costs``: per action kind, the compute seconds in all and the actions (``I``/``W`` off the first stage only:
    there a split backward runs whole in ``W``, having no input gradient to send), and under ``"FS"`` the ``F``
    actions whose backward is split (counted in ``"F"`` too; they run under ``DeferWeightGrads``, which costs more);
    ``squares``: per kind, the sum of the squared seconds of those actions (how much they vary: ``schedule="auto"``'s
    jitter)."""

    start: float
    end: float
    send: float
    recv: float
    microbatches: int
    costs: dict[str, tuple[float, int]] = field(default_factory=dict)
    squares: dict[str, float] = field(default_factory=dict)

    @property
    def span(self) -> float:
        return self.end - self.start

    @property
    def compute(self) -> float:
        return max(self.span - self.send - self.recv, 0.0)


@dataclass
class _MicroBatch:
    inputs: dict[int, list[Tensor]] = field(default_factory=dict)  # received, per sending stage (graph leaves)
    outputs: dict[int, list[Tensor]] = field(default_factory=dict)  # sent, per receiving stage (graph roots)
    grads: dict[int, list[Posted]] = field(default_factory=dict)  # posted receives of their gradients
    loss: Optional[Tensor] = None
    weight_grads: WeightGrads = field(default_factory=WeightGrads)  # ``W`` work filed by the backward
    deferred: Optional[tuple[list[Tensor], Optional[list[Tensor]]]] = None  # a whole backward put off to ``W``


States = dict[tuple[int, int], _MicroBatch]  # (micro-batch, chunk) -> its state


def _loss_of(result: Any, stage: int) -> Tensor:
    loss = result.get("loss") if isinstance(result, dict) else result
    if not isinstance(loss, Tensor):
        raise PipelineError(f"training_step on the last stage ({stage}) returned {type(result).__name__}; with "
                            f"pipeline parallelism it must return the loss (a tensor, or a dict with 'loss')")
    return loss


@contextlib.contextmanager
def _sandbox(module: nn.Module, device: torch.device) -> Iterator[list[Any]]:
    """For a traced step: no gradients, random state and torchmetrics states restored afterwards, ``self.log``
    values collected (the tensors the last stage must be able to compute) instead of logged."""
    devices = [device] if device.type == "cuda" else []
    with kept_metric_states(module, device), collected_values(module) as logged:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            yield logged


class Executor:
    """Runs action lists on this rank's chunks. ``ancestor_params``: parameters of the model itself used before the
    blocks (on the first stage; zero buffers of the same name elsewhere), sources for tracing."""

    def __init__(self, module: nn.Module, partition: Partition, runtime: StageRuntime, transport: Transport, *,
                 rank: int, pp: int, virtual: int, ancestor_params: tuple[str, ...] = ()) -> None:
        self.module, self.partition, self.runtime, self.transport = module, partition, runtime, transport
        self.rank, self.pp, self.virtual, self.ancestor_params = rank, pp, virtual, ancestor_params
        self._route_cache: dict[Any, list[Route]] = {}
        self.trace: Optional[Trace] = None  # (kind, microbatch, chunk, start, end, seconds waiting for peers)
        self.position: Optional[Action] = None
        self.times: Optional[StepTimes] = None  # of the last schedule run
        self._seed: Optional[int] = None  # this step's, drawn from the global generator (the same on every stage)
        self.share: Optional[float] = None  # the running micro-batch's share of the batch (logging reads it)
        self.eval_microbatches = 0  # micro-batches of the last evaluation step
        self.eval_whole_batch = os.environ.get("TPP_EVAL_WHOLE_BATCH") == "1"  # evaluate as one micro-batch
        self._combine_cache: dict[Any, Optional[tuple[str, ...]]] = {}  # see _eval_split
        # losses averaged over tokens (core.token_mean): how, over which dp group, and this step's counts
        self.normalization: LossNormalization = "batch"
        self.dp_group: Optional[Any] = None
        self.dp_size = 1
        self._counts: Optional[Counts] = None
        self._totals: list[float] = []
        self.token_warnings = TokenWarnings()

    def _draw_seed(self) -> None:
        """One draw of the global generator per step, on every rank alike: each micro-batch's step then draws from
        its own generator (seeded by this and its index), the same on every stage whichever units ran before, and
        each unit call from (that, the unit, the call), the same on whichever stage holds it (see ``seeded``)."""
        self._seed = int(torch.randint(0, 2 ** 62, (1,)).item())

    def stage(self, chunk: int) -> int:
        return chunk * self.pp + self.rank

    @property
    def holds_last(self) -> bool:
        return self.partition.stages - 1 in [self.stage(c) for c in range(self.virtual)]

    def describe_position(self) -> str:
        """Where the current step is, for failure messages: ' in stage 1, backward of micro-batch 3'."""
        if self.position is None:
            return ""
        kind, mb, chunk = self.position
        names = {"F": "forward", "B": "backward", "I": "input-gradient backward", "W": "weight-gradient backward"}
        return f" in pipeline stage {self.stage(chunk)}, {names[kind]} of micro-batch {mb}"

    # ------------------------------------------------------------------------------------------------------------
    # which values cross stages (traced once per kind of step and batch structure)

    @staticmethod
    def _structure(kind: str, micro: Any) -> Any:
        leaves, spec = tree_flatten(micro)
        return (kind, str(spec), tuple((t.dim(), t.dtype) if isinstance(t, Tensor) else type(t).__name__
                                       for t in leaves))

    def routes(self, kind: str, step: Step, micro: Any) -> list[Route]:
        key = self._structure(kind, micro)
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
                    f"pipelined automatically. {self._partition_hint()}") from err
            routes = plan_routes(self.runtime, calls, result, self.partition.stages)
            self.transport.agree(repr([(k, sorted(map(repr, tags))) for k, tags in calls]), kind)
            self._route_cache[key] = routes
        return self._route_cache[key]

    def _partition_hint(self) -> str:
        """For a step that fails only because of how the model was cut: the stacks it was cut along, and the
        ``blocks=`` that cuts one of them alone (the others then run whole on the stage that uses them)."""
        blocks = self.partition.blocks
        said = f"The model was cut along {', '.join(map(repr, blocks))} into {self.partition.stages} stages"
        if len(blocks) > 1:
            return f"{said}; if the step runs in one process, cut one stack alone, e.g. " + " or ".join(
                f"blocks={b!r}" for b in blocks)
        return f"{said}; if the step runs in one process, name the layers to cut with blocks='<module name>'"

    def inbound(self, routes: list[Route]) -> dict[int, dict[int, int]]:
        """Local stage -> {source stage: tensors it sends}, in chunk order."""
        return {self.stage(c): dict(routes[self.stage(c)].inbound) for c in range(self.virtual)}

    # ------------------------------------------------------------------------------------------------------------
    # one forward / backward of one micro-batch on one chunk

    def _receive(self, mb: int, src: int, dst: int, count: int, state: _MicroBatch) -> list[Tensor]:
        if src not in state.inputs:
            state.inputs[src] = self.transport.receive_bundle(mb, src, dst, count)
        return state.inputs[src]

    def forward(self, mb: int, chunk: int, step: Step, micro: Any, states: States, routes: list[Route], *,
                split: bool = False) -> Any:
        """Run stage ``chunk``'s part of the step; returns the step's result on the last stage. ``split``: the
        backward will be ``I`` then ``W``, so products with a weight matrix file their weight gradients for ``W``."""
        g = self.stage(chunk)
        route = routes[g]
        state = states[(mb, chunk)] = _MicroBatch()
        last = g == self.partition.stages - 1
        if not route.runs:
            return None
        ctx = RunContext(g, route, lambda s: self._receive(mb, s, g, route.inbound[s], state),
                         seed=None if self._seed is None else hash((self._seed, mb)))
        self.runtime.ctx = ctx
        result = None
        try:
            with self._split_backward(state) if split else contextlib.nullcontext(), \
                    seeded(ctx.seed, self.runtime.device), self._token_mean(mb) if last else contextlib.nullcontext():
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
            self.transport.send_bundle(mb, g, dst, tensors)
            if torch.is_grad_enabled() and self.transport.early:  # the gradients will come back: post receives now
                state.grads[dst] = self.transport.post_grads(mb, g, dst, tensors)
        return result

    # ------------------------------------------------------------------------------------------------------------
    # losses averaged over tokens (core.token_mean)

    def count_tokens(self, kind: str, step: Step, micro: list[Any], shares: list[float]) -> None:
        """Before a schedule: count what each micro-batch's mean-reduced losses divide by, where the last stage is
        (and on global rank 0 at the first training step, which warns about reductions it cannot see)."""
        self._counts, self._totals = None, []
        training = kind == "training_step"
        across = training and self.normalization == "global"  # over the dp replicas: one micro-batch too
        if self.normalization == "microbatch" or kind == "predict_step" or (len(micro) < 2 and not across):
            return
        warn = training and self.token_warnings.pending
        if not (self.holds_last or warn):
            return

        def run(mb: int) -> None:
            self.runtime.ctx = RunContext(-1, Route(), lambda s: [])  # every unit a stand-in (zeros)
            try:  # the micro-batch's own draws (as its forward will make them), the global state kept
                with seeded(None if self._seed is None else hash((self._seed, mb)), self.runtime.device):
                    step(micro[mb])
            finally:
                self.runtime.ctx = None

        states = collect_rng_states()  # Python's and NumPy's too: only this rank counts
        try:
            with _sandbox(self.module, self.runtime.device):
                counts: Optional[Counts] = count_tokens(run, len(micro))
        except Exception as err:  # noqa: BLE001 - the forward that follows raises a real error where it belongs
            counts = None
            self.token_warnings.uncounted(kind, err)
        finally:
            set_rng_states(states)
        if warn:
            self.token_warnings.first_step(counts, shares)
        if self.holds_last:
            totals = counts.totals() if counts is not None else []
            if across:  # every replica's last stage joins, counted or not
                totals = global_totals(totals, self.dp_group, self.dp_size, self.runtime.device)
            if counts is not None:
                self._counts, self._totals = counts, totals

    def _token_mean(self, mb: int) -> ContextManager[Any]:
        if self._counts is None or self.share is None:
            return contextlib.nullcontext()
        return TokenMean(self._totals, self._counts.means[mb], self.share, self.token_warnings.mismatch)

    @staticmethod
    @contextlib.contextmanager
    def _split_backward(state: _MicroBatch) -> Iterator[None]:
        """Weight products file their weight gradients for ``W``; a block recomputed in backward (activation
        checkpointing) runs its products the same way, so that it saves what the first forward saved (its filed
        list is never run: the first forward's autograd nodes do the backward)."""
        with DeferWeightGrads(state.weight_grads), replay_on_recompute(lambda: DeferWeightGrads(WeightGrads())):
            yield

    def _roots(self, mb: int, chunk: int, state: _MicroBatch, scale: float) -> tuple[list[Tensor], Optional[list]]:
        roots: dict[int, Tensor] = {}
        grads: dict[int, Tensor] = {}
        if state.loss is not None:
            roots[id(state.loss)], grads[id(state.loss)] = state.loss, torch.full_like(state.loss, scale)
        for dst, tensors in state.outputs.items():
            posted = state.grads.get(dst) or self.transport.post_grads(mb, self.stage(chunk), dst, tensors)
            received = self.transport.wait(posted, ("gradients", mb, dst, self.stage(chunk)))
            for t, grad in zip([t for t in tensors if t.requires_grad], received):
                roots[id(t)], grads[id(t)] = t, grads[id(t)] + grad if id(t) in grads else grad
        return list(roots.values()), [grads[k] for k in roots]

    def backward(self, kind: str, mb: int, chunk: int, states: States, scale: float) -> None:
        state = states[(mb, chunk)]
        inputs = [t for tensors in state.inputs.values() for t in tensors if t.requires_grad]
        if kind in ("B", "I"):
            roots, grads = self._roots(mb, chunk, state, scale)
            if kind == "I" and not (inputs and roots):
                state.deferred = (roots, grads)  # nothing to send upstream: the whole backward is weight work
            elif roots:
                torch.autograd.backward(roots, grads)
            sent = {} if state.deferred is not None else {id(t): t.grad for t in inputs}
            for src, tensors in state.inputs.items():
                self.transport.send_grads(mb, self.stage(chunk), src, tensors, sent)
        if kind in ("B", "W"):  # B is I then W at once
            if state.deferred is not None and state.deferred[0]:
                torch.autograd.backward(*state.deferred)
            state.weight_grads.run()  # filed by the products made under DeferWeightGrads
            states[(mb, chunk)] = _MicroBatch(loss=state.loss.detach() if state.loss is not None else None)

    # ------------------------------------------------------------------------------------------------------------
    # steps

    def run(self, order: list[Action], step: Step, micro: list[Any], routes: list[Route], shares: list[float],
            loss_scale: float) -> Tensor:
        """Run ``order`` over the micro-batches; returns this rank's share-weighted loss sum (zero off the last
        stage)."""
        states: States = {}
        scale = [loss_scale * share for share in shares]
        splits = split_backwards(order, self.rank, self.pp)
        self._draw_seed()
        self.count_tokens("training_step", step, micro, shares)
        transport = self.transport
        transport.waited = transport.sent = 0.0
        costs = {kind: (0.0, 0) for kind in COST_KINDS}
        squares = dict.fromkeys(COST_KINDS, 0.0)
        first = time.perf_counter()
        try:
            for kind, mb, chunk in order:
                self.position = (kind, mb, chunk)
                start, waited, sent = time.perf_counter(), transport.waited, transport.sent
                if kind == "F":
                    self.share = shares[mb]  # what the step logs is weighted by it (logging reads it)
                    result = self.forward(mb, chunk, step, micro[mb], states, routes, split=(mb, chunk) in splits)
                    if self.stage(chunk) == self.partition.stages - 1:
                        states[(mb, chunk)].loss = _loss_of(result, self.stage(chunk))
                else:
                    self.backward(kind, mb, chunk, states, scale[mb])
                end = time.perf_counter()
                if kind in "FB" or self.stage(chunk) > 0:
                    took = end - start - (transport.waited - waited) - (transport.sent - sent)
                    for key in (kind, "FS") if kind == "F" and (mb, chunk) in splits else (kind,):
                        total, count = costs[key]
                        costs[key] = (total + took, count + 1)
                        squares[key] += took * took
                if self.trace is not None:
                    self.trace.append((kind, mb, chunk, start, end, transport.waited - waited))
            transport.flush()
        finally:
            self.runtime.ctx, self.share = None, None
        self.times = StepTimes(first, time.perf_counter(), transport.sent, transport.waited, len(micro), costs,
                               squares)
        self.position = None
        losses = [s.loss.float() * shares[mb] for (mb, _), s in states.items() if s.loss is not None]
        return torch.stack(losses).sum() if losses else torch.zeros((), device=self.runtime.device)

    def run_eval(self, step: Step, batch: Any, kind: str, microbatches: int = 1) -> Any:
        """Forward only: ``F`` of every micro-batch on every chunk of this rank, chunk by chunk (the stages' order),
        sends not waited for, so that stage ``s`` runs micro-batch ``i + 1`` while stage ``s + 1`` runs ``i``::

            pp=2, m=4   rank 0: F0 F1 F2 F3            (whole batch: rank 0: F      )
                        rank 1:    F0 F1 F2 F3                       rank 1:    F

        The batch is split as training splits it (fewer micro-batches for a short batch) when the step's result can
        be put together from the micro-batches' (``microbatch.combine``), else it runs whole. Returns the step's
        result on the last stage, else ``None``."""
        micro, shares, modes = self._eval_split(kind, step, batch, microbatches)
        states: States = {}
        routes = self.routes(kind, step, micro[0])
        self._draw_seed()
        self.count_tokens(kind, step, micro, shares)
        self.transport.post_headers(self.inbound(routes), len(micro))
        results = []
        try:
            for chunk in range(self.virtual):
                for mb, part in enumerate(micro):
                    self.position, self.share = ("F", mb, chunk), shares[mb]
                    out = self.forward(mb, chunk, step, part, states, routes)
                    if self.stage(chunk) == self.partition.stages - 1:
                        results.append(out)
            self.transport.flush()
        finally:
            self.runtime.ctx, self.position, self.share = None, None, None
        self.eval_microbatches = len(micro)
        if not results:
            return None
        return results[0] if len(micro) == 1 else combine(kind, results, shares, modes)

    def _eval_split(self, kind: str, step: Step, batch: Any, microbatches: int
                    ) -> tuple[list[Any], list[float], tuple[str, ...]]:
        """The micro-batches, their shares and how each leaf of the result combines; the whole batch as the one
        micro-batch when it cannot be split, or the result cannot be combined, or the step logs a torchmetrics
        object ``on_step`` (see ``_probe``), or ``TPP_EVAL_WHOLE_BATCH=1``."""
        m = 1 if self.eval_whole_batch else min(microbatches, batch_size(batch))
        if m > 1:
            try:
                micro, shares = split_batch(batch, m)
            except PipelineError:  # no batch dimension, or tensors of other sizes: as one micro-batch
                return [batch], [1.0], ()
            self.routes(kind, step, micro[0])  # a step that cannot be traced fails here, with the routes' message
            key = (self._structure(kind, batch), batch_size(batch), batch_size(micro[0]), m)
            if key not in self._combine_cache:
                (whole, _), (part, step_metric) = self._probe(step, batch), self._probe(step, micro[0])
                self._combine_cache[key] = None if step_metric else combinable(
                    kind, whole, part, batch_size(batch), batch_size(micro[0]))
            modes = self._combine_cache[key]
            if modes is not None:
                return micro, shares, modes
        return [batch], [1.0], ()

    def forget_results(self) -> None:
        """A new evaluation loop or dataloader: its step may return results of another structure."""
        self._combine_cache.clear()

    def _probe(self, step: Step, batch: Any) -> tuple[Any, bool]:
        """The step's result on ``batch`` with every unit returning zeros (its shapes, on every rank alike), and
        whether it logs a torchmetrics object ``on_step``: that value is the metric's last ``forward``, which would
        be the last micro-batch's instead of the batch's."""
        from torchmetrics import Metric

        box: list[Any] = []
        step_metric: list[bool] = []
        with _sandbox(self.module, self.runtime.device):
            self.module.log = lambda name, value, *args, **kwargs: step_metric.append(  # put back by _sandbox
                isinstance(value, Metric) and bool(kwargs.get("on_step")))
            trace(self.runtime, lambda: box.append(step(batch)) or box[0], {})
        return box[0], any(step_metric)

