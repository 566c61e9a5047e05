"""``SpikeGuard``: the Lightning callback that watches each step's loss and global gradient norm and, on a spike,
drops the step or rolls back, every rank alike. Where it hooks in (Lightning's public callback hooks)::

    training_step -> on_before_backward (loss, per accumulated batch)  -> backward -> dp averaging
      -> on_before_optimizer_step: all-gather [loss, local |g|^2] over the world + the strategy's global norm
         -> the same SpikeDetector verdict on every rank -> spike: every gradient set to None
      -> (clip) -> optimizer.step (nothing to apply) -> LR schedulers step
      -> on_train_batch_end: "skip": schedulers and learning rates put back; "rollback": the last HostSnapshot
         put back (parameters, optimizer state, schedulers, RNG, global_step); the incident recorded;
         otherwise every ``snapshot_every_n_steps`` a new snapshot

Dropping every gradient is how ``on_nonfinite="skip"`` drops a step: optimizers skip parameters without a gradient,
so parameters and optimizer state (momenta, Adam's step count) stay as they were, on every rank.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_tpp.core.dp_shard import local
from lightning_tpp.incidents.detector import IncidentBudget, SpikeDetector, TooManyIncidentsError, Trigger
from lightning_tpp.incidents.record import Incident, IncidentLog
from lightning_tpp.incidents.snapshot import HostSnapshot, restore_snapshot, take_snapshot

Action = Literal["skip", "rollback"]


class SpikeGuard(Callback):
    """Drop or roll back the optimizer steps whose loss or global gradient norm spikes, on every rank alike.

    Args:
        action: ``"skip"`` (the step's update dropped everywhere; optimizer state and LR schedule untouched;
            ``global_step`` still counts it) or ``"rollback"`` (the last snapshot restored: parameters, optimizer
            state, LR schedulers, RNG streams and ``global_step``; the batches read since it are skipped, the data
            position goes on forward).
        window: steps in the running window each value is compared with.
        warmup: steps watched before the first verdict (the window must say something first).
        z_threshold: a spike is more than this many standard deviations above the window's mean...
        loss_ratio: ... and more than this many times its mean (the loss; ``None``: the loss is not watched).
        grad_norm_ratio: the same for the global gradient norm (over every tp, pp and dp shard; ``None``: not
            watched). The defaults (6 sigma, 2x loss, 10x norm) do not fire on a healthy run's noise (see
            ``docs/incidents.md``); a non-finite value always fires.
        snapshot_every_n_steps: with ``"rollback"``, a host-memory snapshot of this rank's shards every so many
            optimizer steps (and at the start): a rollback goes back at most this far.
        rollback_lr_factor: after a rollback, the learning rates are multiplied by this...
        rollback_lr_steps: ... for this many optimizer steps (0: not lowered).
        max_incidents: more incidents than this within ``incident_window`` steps stops the run on every rank with
            ``TooManyIncidentsError`` listing them.
        incident_window: see ``max_incidents``.

    Every incident (and every ``on_nonfinite`` decision of ``TensorPipeStrategy``) is appended to
    ``incidents.jsonl`` in the Trainer's log directory and logged under ``incidents/`` (global rank 0 writes).
    A step that ``on_nonfinite="skip"`` dropped is recorded and, as a skipped spike, leaves the LR schedule where
    it was. Needs automatic optimization.
    """

    def __init__(self, *, action: Action = "skip", window: int = 100, warmup: int = 20, z_threshold: float = 6.0,
                 loss_ratio: Optional[float] = 2.0, grad_norm_ratio: Optional[float] = 10.0,
                 snapshot_every_n_steps: int = 50, rollback_lr_factor: float = 1.0, rollback_lr_steps: int = 0,
                 max_incidents: int = 3, incident_window: int = 1000) -> None:
        if action not in ("skip", "rollback"):
            raise ValueError(f"action={action!r} must be 'skip' (drop the step's update everywhere) or 'rollback' "
                             f"(restore the last snapshot and skip the batches since)")
        if not isinstance(snapshot_every_n_steps, int) or snapshot_every_n_steps < 1:
            raise ValueError(f"snapshot_every_n_steps={snapshot_every_n_steps!r} must be a positive integer")
        if not 0 < rollback_lr_factor <= 1 or not isinstance(rollback_lr_steps, int) or rollback_lr_steps < 0:
            raise ValueError(f"rollback_lr_factor={rollback_lr_factor!r} must be in (0, 1] and rollback_lr_steps="
                             f"{rollback_lr_steps!r} a non-negative integer, e.g. rollback_lr_factor=0.5, "
                             f"rollback_lr_steps=100")
        self.action = action
        self._detector_args = dict(window=window, warmup=warmup, z_threshold=z_threshold,
                                   ratios={"loss": loss_ratio, "grad_norm": grad_norm_ratio})
        SpikeDetector(**self._detector_args)  # the thresholds' errors at construction, not at fit
        self.every = snapshot_every_n_steps
        self.lr_factor, self.lr_steps = rollback_lr_factor, rollback_lr_steps
        self._budget_args = (max_incidents, incident_window)
        IncidentBudget(*self._budget_args)
        self.incident_log = IncidentLog()
        self.snapshot: Optional[HostSnapshot] = None
        self._loaded: dict[str, Any] = {}  # a checkpoint's state, applied to every new run's detector
        self._hooks: list[Any] = []  # torch optimizer step hooks that lower the learning rate after a rollback
        self._reset_run()

    def _reset_run(self) -> None:
        self.detector = SpikeDetector(**self._detector_args)
        self.budget = IncidentBudget(*self._budget_args)
        self._apply_loaded()
        self._loss: Optional[Tensor] = None
        self._nonfinite_skip = False
        self._pending: Optional[Incident] = None
        self._kept_schedulers: list[dict[str, Any]] = []  # before a skipped step: the schedulers' states...
        self._kept_lrs: list[list[float]] = []  # ... and the optimizers' learning rates
        self._low_lr_left = 0
        self._lowered: list[list[float]] = []
        self._snapshot_batch = 0  # the first batch index read after the snapshot

    # ------------------------------------------------------------------------------------------------------------
    # checkpoints: the windows and the incident budget go on after a resume (plain values: ``weights_only`` loads)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"windows": {s: list(w.values) for s, w in self.detector.windows.items()},
                "incidents": [[step, text] for step, text in self.budget.steps]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict
        self._apply_loaded()

    def _apply_loaded(self) -> None:
        for signal, values in self._loaded.get("windows", {}).items():
            if signal in self.detector.windows:
                self.detector.windows[signal].values.clear()
                self.detector.windows[signal].values.extend(float(v) for v in values)
        self.budget.steps = [(int(step), str(text)) for step, text in self._loaded.get("incidents", [])]

    @property
    def incidents(self) -> list[Incident]:
        return self.incident_log.incidents

    # ------------------------------------------------------------------------------------------------------------
    # run boundaries

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not pl_module.automatic_optimization:
            raise ValueError("SpikeGuard needs automatic optimization (it drops or rolls back the step Lightning "
                             "runs); with manual optimization check the loss yourself before opt.step()")
        self._remove_hooks()
        self._reset_run()
        log_dir = trainer.log_dir  # a broadcast: every rank asks
        self.incident_log.open(log_dir, writer=trainer.global_rank == 0)
        for opt in trainer.optimizers:
            self._hooks += [opt.register_step_pre_hook(self._lower_lr), opt.register_step_post_hook(self._raise_lr)]

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.action == "rollback":
            self._take(trainer, pl_module, next_batch=0)

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._remove_hooks()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._remove_hooks()
        from lightning_tpp.reliability.nonfinite import NonFiniteLossError

        if isinstance(exception, NonFiniteLossError):  # on_nonfinite="raise": the same on every rank
            found = re.search(r"on ranks \[([\d, ]*)\]", str(exception))
            ranks = [int(r) for r in found.group(1).split(",") if r.strip()] if found else []
            self.incident_log.add(Incident(trainer.global_step, "nonfinite", "raise", {"loss": math.nan}, ranks),
                                  trainer.loggers)

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------------------------------------------------
    # the step

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> None:
        if getattr(trainer.strategy, "_skip_backward", False):  # TensorPipeStrategy(on_nonfinite="skip") dropped it
            self._nonfinite_skip = True
            return
        loss = loss.detach().float().reshape(())
        self._loss = loss.clone() if self._loss is None else self._loss + loss  # accumulated batches: their mean

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: Any) -> None:
        loss, self._loss = self._loss, None
        if self._nonfinite_skip:  # decided by the strategy on every rank alike: recorded, not judged again
            self._nonfinite_skip = False
            self._pending = Incident(trainer.global_step, "nonfinite", "skip", {"loss": math.nan},
                                     _replica_ranks(trainer.strategy),
                                     "on_nonfinite='skip': the step was dropped on every rank")
            self._keep_schedule(trainer)  # a dropped step leaves the schedule as a spike's does
            return
        if loss is None:
            return
        norm = _grad_norm(trainer, optimizer)
        device = norm.device if norm is not None else loss.device
        table = _gather_world(torch.stack([loss.to(device), _local_square(pl_module).to(device)]))
        values = {"loss": float(table[:, 0].mean()),  # every rank's: a rank holds its whole replica's loss
                  "grad_norm": float(norm) if norm is not None else math.sqrt(float(table[:, 1].max()))}
        triggers = self.detector.check(values)
        if not triggers:
            return
        self._pending = Incident(trainer.global_step, "spike", self.action, _describe(values, triggers),
                                 _culprits(table, triggers))
        try:
            self.budget.add(trainer.global_step, self._pending.describe())  # raises on every rank alike
        except TooManyIncidentsError:
            stop, self._pending = self._pending, None
            self.incident_log.add(Incident(stop.step, stop.kind, "stop", stop.values, stop.ranks,
                                           "too many incidents: the run stops", stop.time), trainer.loggers)
            raise
        for opt in trainer.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = None
        for p in pl_module.parameters():
            p.grad = None
        if self.action == "skip":
            self._keep_schedule(trainer)

    def _keep_schedule(self, trainer: "pl.Trainer") -> None:
        """The LR schedulers step after this (dropped) optimizer step: keep what to put back afterwards."""
        self._kept_schedulers = [copy.deepcopy(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs]
        self._kept_lrs = [[g["lr"] for g in opt.param_groups] for opt in trainer.optimizers]

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        incident, self._pending = self._pending, None
        if incident is not None and incident.action == "skip":
            self._put_schedule_back(trainer)
        elif incident is not None and incident.action == "rollback":
            incident = self._roll_back(trainer, pl_module, incident, batch_idx)
        if incident is not None:
            rank_zero_warn(f"SpikeGuard: step {incident.step}: {incident.describe()}")
            self.incident_log.add(incident, trainer.loggers)
            return
        step = trainer.global_step
        if self.action == "rollback" and step % self.every == 0 and (self.snapshot is None or
                                                                     self.snapshot.step != step):
            self._take(trainer, pl_module, next_batch=batch_idx + 1)

    def _put_schedule_back(self, trainer: "pl.Trainer") -> None:
        for config, state in zip(trainer.lr_scheduler_configs, self._kept_schedulers):
            config.scheduler.load_state_dict(state)
        for opt, lrs in zip(trainer.optimizers, self._kept_lrs):
            for group, lr in zip(opt.param_groups, lrs):
                group["lr"] = lr
        self._kept_schedulers, self._kept_lrs = [], []

    # ------------------------------------------------------------------------------------------------------------
    # snapshots and rollback

    def _take(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *, next_batch: int) -> None:
        self.snapshot = take_snapshot(pl_module, trainer.optimizers,
                                      [c.scheduler for c in trainer.lr_scheduler_configs],
                                      step=trainer.global_step, counters={"global_step": trainer.global_step})
        self._snapshot_batch = next_batch

    def _roll_back(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", incident: Incident,
                   batch_idx: int) -> Incident:
        snap = self.snapshot
        assert snap is not None  # taken at the start of training
        restore_snapshot(snap, pl_module, trainer.optimizers, [c.scheduler for c in trainer.lr_scheduler_configs])
        _rewind_global_step(trainer, snap.counters["global_step"])
        self._low_lr_left = self.lr_steps if self.lr_factor < 1 else 0
        lowered = f"; learning rates x{self.lr_factor} for {self.lr_steps} steps" if self._low_lr_left else ""
        first = self._snapshot_batch if self._snapshot_batch <= batch_idx else 0  # a new epoch since: from its start
        detail = (f"rolled back to step {snap.step}; batches {first}..{batch_idx} of this epoch skipped{lowered}")
        self._snapshot_batch = batch_idx + 1
        return Incident(incident.step, incident.kind, incident.action, incident.values, incident.ranks, detail,
                        incident.time)

    def _lower_lr(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._low_lr_left > 0:
            self._lowered.append([g["lr"] for g in optimizer.param_groups])
            for g in optimizer.param_groups:
                g["lr"] = g["lr"] * self.lr_factor

    def _raise_lr(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Back to the scheduled rates right after the step, before the LR schedulers step from them."""
        if self._lowered:
            for g, lr in zip(optimizer.param_groups, self._lowered.pop()):
                g["lr"] = lr
            self._low_lr_left -= 1


def _grad_norm(trainer: "pl.Trainer", optimizer: Any) -> Optional[Tensor]:
    """The strategy's global norm over every shard (``TensorPipeStrategy.global_grad_norm``), or None under another
    strategy: then the largest of the ranks' own norms stands for it (the same number on every rank; the norm itself
    in one process or with replicated, averaged gradients as DDP's; a lower bound of it where gradients are
    sharded)."""
    measure = getattr(trainer.strategy, "global_grad_norm", None)
    if measure is None:
        return None
    return measure(getattr(optimizer, "optimizer", optimizer)).float().reshape(())


def _local_square(pl_module: "pl.LightningModule") -> Tensor:
    """Squared norm of the gradients this rank holds (its shards): which ranks a gradient spike came from."""
    grads = [local(p.grad).detach().float() for p in pl_module.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.stack([g.pow(2).sum() for g in grads]).sum().cpu()


def _gather_world(row: Tensor) -> Tensor:
    """Every rank's ``row``, in rank order (one all-gather over the world; the row itself in one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return row.reshape(1, -1)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    return torch.stack(rows).cpu()


def _describe(values: dict[str, float], triggers: list[Trigger]) -> dict[str, float]:
    out = dict(values)
    for t in triggers:
        out.update({f"{t.signal}_mean": t.mean, f"{t.signal}_z": t.z, f"{t.signal}_ratio": t.ratio})
    return out


def _culprits(table: Tensor, triggers: list[Trigger]) -> list[int]:
    """Ranks whose own values stand out: a loss over the threshold's share of its replica, a gradient holding at
    least half of the largest rank's squared norm, or anything non-finite."""
    ranks: set[int] = set()
    signals = {t.signal: t for t in triggers}
    for r, (loss, square) in enumerate(table.tolist()):
        if not (math.isfinite(loss) and math.isfinite(square)):
            ranks.add(r)
        elif "loss" in signals and math.isfinite(signals["loss"].mean) and loss > signals["loss"].mean * 1.0001:
            if loss >= max(row[0] for row in table.tolist()) * 0.5:
                ranks.add(r)
        if "grad_norm" in signals and square >= 0.5 * float(table[:, 1].max()):
            ranks.add(r)
    return sorted(ranks) or list(range(table.shape[0]))


def _rewind_global_step(trainer: "pl.Trainer", step: int) -> None:
    """``trainer.global_step`` back to ``step``: the optimizer-step counters of Lightning's automatic optimization
    loop (what a resumed run restores from a checkpoint's loop state)."""
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
    back = progress.total.completed - step
    for tracker in (progress.total, progress.current):
        tracker.ready = max(tracker.ready - back, 0)
        tracker.completed = max(tracker.completed - back, 0)


def _replica_ranks(strategy: Any) -> list[int]:
    """Every global rank of the dp replicas whose loss was not finite (``TensorPipeStrategy`` names the replicas;
    the same list on every rank)."""
    dims, replicas = getattr(strategy, "dims", None), getattr(strategy, "nonfinite_replicas", [])
    if dims is None:
        return list(replicas)
    return sorted(dims.rank_of(dp=d, pp=p, tp=t, cp=c) for d in replicas for p in range(dims.pp)
                  for c in range(getattr(dims, "cp", 1)) for t in range(dims.tp))
