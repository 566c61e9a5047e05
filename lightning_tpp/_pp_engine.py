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
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_tpp._pp_partition import Partition
from lightning_tpp._pp_schedule import actions
from lightning_tpp._pp_stage import RunContext, StageOutput, StageRuntime

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]
_MAX_DIMS = 8
_HEADER = 3 + _MAX_DIMS  # dtype, requires_grad, ndim, dims...


class PipelineError(RuntimeError):
    """A pipeline step cannot run as the model and batch are."""


@dataclass
class _MicroBatch:
    inputs: list[Tensor] = field(default_factory=list)  # received activations (leaves of this stage's graph)
    outputs: list[Tensor] = field(default_factory=list)  # sent activations (roots of this stage's graph)
    loss: Optional[Tensor] = None
    received: bool = False
    param_groups: Any = None
    deferred: Optional[tuple[list[Tensor], Optional[list[Tensor]]]] = None


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
                 virtual: int, schedule: str, microbatches: int, group: Any, prev_rank: int, next_rank: int,
                 last_rank: int, chunk_params: list[list[nn.Parameter]], tied: list[tuple[nn.Parameter, Any]]
                 ) -> None:
        self.module, self.partition, self.runtime = module, partition, runtime
        self.rank, self.pp, self.virtual = rank, pp, virtual
        self.schedule, self.microbatches = schedule, microbatches
        self.group, self.prev_rank, self.next_rank, self.last_rank = group, prev_rank, next_rank, last_rank
        self.chunk_params, self.tied = chunk_params, tied
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
    # point-to-point

    def _tag(self, mb: int, sender_stage: int, kind: int, leaf: int = 0) -> int:
        """Unique per message of a step; both ends derive it from the *sending* stage (with interleaving the last
        rank's chunk c feeds rank 0's chunk c + 1)."""
        return ((mb * self.partition.stages + sender_stage) * 4 + kind) * 64 + leaf

    def _isend(self, t: Tensor, dst: int, tag: int) -> None:
        self._sends.append(dist.isend(t.contiguous(), dst, tag=tag))

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.runtime.device)
        start = time.perf_counter()
        dist.irecv(buf, src, tag=tag).wait()
        self._waited += time.perf_counter() - start
        return buf

    def _send_activation(self, mb: int, chunk: int, tensors: list[Tensor]) -> None:
        header = torch.zeros(len(tensors) * _HEADER, dtype=torch.int64, device=self.runtime.device)
        for i, t in enumerate(tensors):
            if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
                raise PipelineError(f"cannot send a {t.dim()}-d {t.dtype} activation between stages")
            row = [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
            header[i * _HEADER:i * _HEADER + len(row)] = torch.tensor(row)
        g = self._stage(chunk)
        self._isend(header, self.next_rank, self._tag(mb, g, 0))
        for i, t in enumerate(tensors):
            self._isend(t.detach(), self.next_rank, self._tag(mb, g, 1, i))

    def _receive_activation(self, mb: int, chunk: int, state: _MicroBatch, meta: Any) -> Any:
        leaves, spec = tree_flatten(meta)
        slots = [i for i, v in enumerate(leaves) if isinstance(v, Tensor)]
        sender = self._stage(chunk) - 1
        header = self._recv((len(slots) * _HEADER,), torch.int64, self.prev_rank, self._tag(mb, sender, 0)).tolist()
        out = list(leaves)
        for k, i in enumerate(slots):
            dtype_code, grad, ndim, *dims = header[k * _HEADER:(k + 1) * _HEADER]
            t = self._recv(tuple(dims[:ndim]), _DTYPES[dtype_code], self.prev_rank, self._tag(mb, sender, 1, k))
            if grad:
                t.requires_grad_(True)
            state.inputs.append(t)
            out[i] = t
        state.received = True
        return tree_unflatten(out, spec)

    # ------------------------------------------------------------------------------------------------------------
    # one forward / backward of one micro-batch on one chunk

    def _stage(self, chunk: int) -> int:
        return chunk * self.pp + self.rank

    def _forward(self, mb: int, chunk: int, step: Callable[[Any], Any], micro: Any, states: dict) -> None:
        g = self._stage(chunk)
        state = states[(mb, chunk)] = _MicroBatch()
        start, end = self.partition.bounds[g]
        last = g == self.partition.stages - 1
        self.runtime.ctx = RunContext(g, start, end, g == 0, last,
                                      lambda meta: self._receive_activation(mb, chunk, state, meta))
        try:
            result = step(micro)
        except StageOutput as out:
            state.outputs = [t for t in tree_flatten(out.value)[0] if isinstance(t, Tensor)]
            self._send_activation(mb, chunk, state.outputs)
        else:
            if not last:
                raise PipelineError(f"stage {g}: the step finished without reaching block "
                                    f"{self.partition.names[end - 1]!r}; the step must run the model's forward")
            state.loss = _loss_of(result, g)
        finally:
            self.runtime.ctx = None
        if g > 0 and not state.received:
            raise PipelineError(f"stage {g}: the forward never called block {self.partition.names[start - 1]!r}, "
                                f"whose output this stage receives")

    def _roots(self, mb: int, chunk: int, state: _MicroBatch, scale: float) -> tuple[list[Tensor], Optional[list]]:
        if state.loss is not None:
            return [state.loss * scale], None
        roots = [t for t in state.outputs if t.requires_grad]
        grads = [self._recv(tuple(t.shape), t.dtype, self.next_rank, self._tag(mb, self._stage(chunk) + 1, 2, i))
                 for i, t in enumerate(roots)]
        return roots, grads

    def _send_input_grads(self, mb: int, chunk: int, grads: list[Optional[Tensor]], inputs: list[Tensor]) -> None:
        for i, (g, t) in enumerate(zip(grads, inputs)):
            self._isend(g if g is not None else torch.zeros_like(t), self.prev_rank,
                        self._tag(mb, self._stage(chunk), 2, i))

    def _backward(self, kind: str, mb: int, chunk: int, states: dict, scale: float) -> None:
        state: _MicroBatch = states[(mb, chunk)]
        first = self._stage(chunk) == 0
        inputs = [t for t in state.inputs if t.requires_grad]
        if kind == "B":
            roots, grads = self._roots(mb, chunk, state, scale)
            torch.autograd.backward(roots, grads)
            if not first:
                self._send_input_grads(mb, chunk, [t.grad for t in inputs], inputs)
        elif kind == "I":
            roots, grads = self._roots(mb, chunk, state, scale)
            if first or not inputs:
                state.deferred = (roots, grads)  # nothing to send upstream: the whole backward is weight work
            else:
                dinputs, state.param_groups = stage_backward_input(roots, grads, inputs,
                                                                   iter(self.chunk_params[chunk]))
                self._send_input_grads(mb, chunk, list(dinputs), inputs)
        else:  # "W"
            if state.deferred is not None:
                torch.autograd.backward(*state.deferred)
            else:
                for p in self.chunk_params[chunk]:  # torch accumulates with "+=": an expanded grad cannot take it
                    if p.grad is not None and not p.grad.is_contiguous():
                        p.grad = p.grad.contiguous()
                stage_backward_weight(iter(self.chunk_params[chunk]), state.param_groups)
        if kind in ("B", "W"):
            states[(mb, chunk)] = _MicroBatch(loss=state.loss.detach() if state.loss is not None else None)

    # ------------------------------------------------------------------------------------------------------------
    # steps

    def train_step(self, step: Callable[[Any], Any], batch: Any, *, loss_scale: float) -> Tensor:
        """Run the schedule over ``batch``; returns the mean micro-batch loss (the same tensor value on every stage)."""
        micro, shares = split_batch(batch, min(self.microbatches, _batch_size(batch)))
        order = self._order(len(micro))
        params = [p for chunk in self.chunk_params for p in chunk]
        previous = {p: p.grad for p in params}
        for p in params:
            p.grad = None
        states: dict[tuple[int, int], _MicroBatch] = {}
        scale = [loss_scale * share for share in shares]
        try:
            for kind, mb, chunk in order:
                self.position = (kind, mb, chunk)
                start, self._waited = time.perf_counter(), 0.0
                if kind == "F":
                    self._forward(mb, chunk, step, micro[mb], states)
                else:
                    self._backward(kind, mb, chunk, states, scale[mb])
                if self.trace is not None:
                    self.trace.append((kind, mb, chunk, start, time.perf_counter(), self._waited))
            self._wait_sends()
        finally:
            self.runtime.ctx = None
        self.position = None
        for p, grad in self.tied:
            if grad is not None and p.grad is not None:
                dist.all_reduce(p.grad, group=grad)
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

    def eval_step(self, step: Callable[[Any], Any], batch: Any) -> Any:
        """Forward only, whole batch as one micro-batch, through every chunk of this rank in stage order."""
        states: dict[tuple[int, int], _MicroBatch] = {}
        result = None
        try:
            for chunk in range(self.virtual):
                g = self._stage(chunk)
                if g == self.partition.stages - 1:
                    result = self._eval_last(step, batch, chunk, states)
                else:
                    self._forward(0, chunk, step, batch, states)
            self._wait_sends()
        finally:
            self.runtime.ctx = None
        box = [tree_map(lambda t: t.detach().cpu() if isinstance(t, Tensor) else t, result)]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        return tree_map(lambda t: t.to(self.runtime.device) if isinstance(t, Tensor) else t, box[0])

    def _eval_last(self, step: Callable[[Any], Any], batch: Any, chunk: int, states: dict) -> Any:
        g = self._stage(chunk)
        state = states[(0, chunk)] = _MicroBatch()
        start, end = self.partition.bounds[g]
        self.runtime.ctx = RunContext(g, start, end, g == 0, True,
                                      lambda meta: self._receive_activation(0, chunk, state, meta))
        try:
            return step(batch)
        finally:
            self.runtime.ctx = None

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
