"""The pipeline's logging adapter, in one place: what ``self.log`` does while a schedule runs, and how the last
stage's logged values reach every rank.

Under a pipeline only the last stage computes the loss and the values ``training_step`` logs, once per micro-batch;
Lightning expects one ``self.log`` per name and step on *every* rank (``ModelCheckpoint`` and ``EarlyStopping`` read
them on rank 0, the first stage; ``sync_dist=True`` on the last stage alone would deadlock). So::

    during the schedule   captured_logs: module.log records (name, value, options) instead of logging
    traced step           collected_values: module.log keeps the values (the tensors the last stage must compute)
    after the schedule    replay_logs: the last stage reduces each name over micro-batches, broadcasts the values
                          (a torchmetrics object's state), and every rank calls the real ``self.log`` once

Why an instance attribute: Lightning has no public hook to intercept or redirect ``LightningModule.log`` (loggers and
callbacks only see values after the ``_ResultCollection`` took them, and a logging call on a stage that cannot
compute it must not reach it at all). Setting ``module.log`` on the instance shadows the method for the duration of a
step and is removed afterwards (``del`` brings back the class's method), so nothing outlives the step.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist

from lightning_tpp._compat import metric_progress, set_metric_progress
from lightning_tpp.pipeline.errors import PipelineError


class LastStage(Protocol):
    """Where the last stage's step ran (the engine, seen from here): whether this rank holds it, its rank, the pp
    group, this rank's device."""

    last_rank: int
    group: Any
    runtime: Any

    @property
    def holds_last(self) -> bool: ...


LogEntry = tuple[str, Any, dict]  # name, value, keyword options of one self.log call


class Captured(list):
    """The recorded ``LogEntry``s and, one per entry, the share of the batch that the micro-batch it was logged in
    holds (``None`` where unknown: then values are reduced with equal weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.shares: list[Optional[float]] = []


@contextlib.contextmanager
def captured_logs(module: Any, share: Optional[Callable[[], Optional[float]]] = None) -> Iterator[Captured]:
    """Record ``module.log`` calls (``log_dict`` goes through ``log``) instead of logging them; ``share`` tells the
    running micro-batch's share of the batch, kept with each entry (evaluation: ``Executor.share``)."""
    entries = Captured()

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise PipelineError(f"self.log({name!r}, ...) with positional options is not supported under pipeline "
                                f"parallelism; pass them by keyword")
        entries.append((name, value, kwargs))
        entries.shares.append(share() if share is not None else None)

    module.log = log
    try:
        yield entries
    finally:
        del module.log


@contextlib.contextmanager
def collected_values(module: Any) -> Iterator[list[Any]]:
    """For a traced step: collect the logged values, then put back whatever ``module.log`` was (a trace runs inside
    :func:`captured_logs`)."""
    logged: list[Any] = []
    previous = module.__dict__.get("log")
    module.log = lambda name, value, *args, **kwargs: logged.append(value)
    try:
        yield logged
    finally:
        if previous is None:
            del module.log
        else:
            module.log = previous


@contextlib.contextmanager
def kept_metric_states(module: Any, device: torch.device) -> Iterator[None]:
    """torchmetrics objects' states put back afterwards (a traced step must not count as an update)."""
    from torchmetrics import Metric

    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    saved = [metric_state(m) for m in metrics]
    try:
        yield
    finally:
        for m, state in zip(metrics, saved):
            load_metric_state(m, state, device)


def metric_state(metric: Any) -> dict[str, Any]:
    """A copy of a torchmetrics object's accumulated state, on the CPU (updates add to the live state in place)."""
    cpu = lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else copy.deepcopy(v)  # noqa: E731
    state = {k: [cpu(x) for x in v] if isinstance(v, list) else cpu(v) for k, v in metric.metric_state.items()}
    forward_cache, update_count = metric_progress(metric)
    return {"state": state, "forward_cache": cpu(forward_cache), "update_count": update_count}


def load_metric_state(metric: Any, payload: dict[str, Any], device: torch.device) -> None:
    dev = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    for k, v in payload["state"].items():
        setattr(metric, k, [dev(x) for x in v] if isinstance(v, list) else dev(v))
    set_metric_progress(metric, dev(payload["forward_cache"]), payload["update_count"])


def _reduce(values: list[Any], reduce_fx: Any, shares: list[Optional[float]]) -> float:
    """One value from the micro-batches' values: a mean is weighted by their shares of the batch where known (a
    batch that ``microbatches`` does not divide has micro-batches of different sizes)."""
    t = torch.stack([torch.as_tensor(v).detach().float().reshape(()).cpu() for v in values])
    name = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "mean")
    if name in ("sum", "add"):
        return float(t.sum())
    if name in ("max", "amax"):
        return float(t.max())
    if name in ("min", "amin"):
        return float(t.min())
    if len(values) > 1 and all(s is not None for s in shares):
        w = torch.tensor(shares, dtype=torch.float64)
        return float((t.double() * w).sum() / w.sum())
    return float(t.mean())


def replay_logs(engine: LastStage, module: Any, entries: list[LogEntry]) -> None:
    """Log on every rank what the last stage's step logged: one value per name and step (micro-batch values are
    reduced with the call's ``reduce_fx``, a mean weighted by their shares where ``entries`` know them, and their
    ``batch_size=`` options summed). A torchmetrics object's state is copied from the last stage into the same
    metric on the other stages, which then log it themselves, so every rank computes the same values."""
    from torchmetrics import Metric

    payload = None
    if engine.holds_last:
        shares = getattr(entries, "shares", [None] * len(entries))
        by_name: dict[str, tuple[list[Any], list[Optional[float]], list[dict]]] = {}
        for (name, value, kwargs), share in zip(entries, shares):
            values, weights, options = by_name.setdefault(name, ([], [], []))
            values.append(value)
            weights.append(share)
            options.append(kwargs)
        names = {id(m): n for n, m in module.named_modules()}
        payload = []
        for name, (values, weights, options) in by_name.items():
            last = values[-1]
            kwargs = {k: v for k, v in options[-1].items() if k != "sync_dist_group"}
            if len(values) > 1 and all(w is not None for w in weights) and "batch_size" in kwargs:
                kwargs["batch_size"] = sum(int(o.get("batch_size") or 0) for o in options)
            if isinstance(last, Metric):
                if id(last) not in names:
                    raise PipelineError(f"self.log({name!r}, metric): under pipeline parallelism the metric must be "
                                        f"an attribute of the LightningModule")
                payload.append((name, names[id(last)], metric_state(last), kwargs))
            else:
                payload.append((name, None, _reduce(values, kwargs.get("reduce_fx", "mean"), weights), kwargs))
    box = [payload]
    dist.broadcast_object_list(box, src=engine.last_rank, group=engine.group)
    for name, metric_name, value, kwargs in box[0] or []:
        if metric_name is not None:
            metric = module.get_submodule(metric_name)
            if not engine.holds_last:
                load_metric_state(metric, value, engine.runtime.device)
            module.log(name, metric, **kwargs)
        else:
            module.log(name, torch.tensor(value, device=engine.runtime.device), **kwargs)
