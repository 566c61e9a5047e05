"""Spikes planted at chosen batches, guarded by ``SpikeGuard``; or the clean reference that never saw them.

    python worker_incidents.py OUT TP PP DP [SCENARIOS]   # a rank of the guarded runs (default: skip,rollback)

Every replica reads every batch in order (no DistributedSampler), so a one-process run over the same list of
batches is the reference. Two guarded runs per call:

    skip      batch 4's loss x1000 (every rank), batch 7's gradients x1e6 on global rank 1 only (after the dp average),
              batch 9's loss NaN (the strategy's on_nonfinite="skip", recorded by the guard)
    rollback  snapshots every 3 steps; batch 5's loss x1000 -> back to step 3, batches 3..5 skipped, lr x0.5 for 2
              steps; batch 10's gradients x1e6 on rank 1 -> back to step 6 (taken after batch 8), batches 9..10 skipped

    accumulate  two batches per step; batch 6's loss x1000 drops the step of batches 6 and 7

All with SGD momentum and a LambdaLR schedule, so optimizer state, schedule and global_step must come back too.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_tpp.core.dp_shard import local
from models import LitLM, token_dataset
from parity import _full

BATCHES = 12
SCENARIOS = {
    "skip": dict(loss_at={4}, grad_at={7}, nan_at={9}, guard=dict(action="skip"),
                 reference=[b for b in range(BATCHES) if b not in (4, 7, 9)], low_lr=set()),
    "rollback": dict(loss_at={5}, grad_at={10}, nan_at=set(),
                     guard=dict(action="rollback", snapshot_every_n_steps=3, rollback_lr_factor=0.5,
                                rollback_lr_steps=2),
                     reference=[0, 1, 2, 6, 7, 8, 11], low_lr={3, 4, 6}),  # its batches 3, 4, 6 are 6, 7, 11
    # two batches per optimizer step: batch 6's loss x1000 drops the step of batches 6 and 7
    "accumulate": dict(loss_at={6}, grad_at=set(), nan_at=set(), guard=dict(action="skip"), accumulate=2,
                       reference=[b for b in range(BATCHES) if b not in (6, 7)], low_lr=set()),
}
FAULTY_RANK = 1


class Planted(LitLM):
    """nanoGPT (4 blocks), SGD with momentum, LR x0.9 per step; the loss of ``loss_at`` batches x1000, of
    ``nan_at`` batches NaN."""

    def __init__(self, loss_at: set[int], nan_at: set[int]) -> None:
        super().__init__("nanogpt4", lr=0.05, optimizer="sgdm")
        self.loss_at, self.nan_at = loss_at, nan_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if batch_idx in self.nan_at:
            return loss * float("nan")
        return loss * 1000.0 if batch_idx in self.loss_at else loss

    def configure_optimizers(self) -> Any:
        opt = super().configure_optimizers()
        return [opt], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s), "interval": "step"}]


class GradFault(L.Callback):
    """Gradients x1e6 on one rank only at chosen batches (its own shards, after the dp average): the global norm
    spikes, and every rank must still drop or roll back the same step."""

    def __init__(self, at: set[int], rank: int) -> None:
        self.at, self.rank, self.batch = at, rank, -1

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.batch = args[-1]

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.batch in self.at and trainer.global_rank == self.rank:
            for p in pl_module.parameters():
                if p.grad is not None:
                    local(p.grad).mul_(1e6)


class LowerLR(L.Callback):
    """The reference's own way to a lower learning rate at some batches (LambdaLR sets the next one afresh)."""

    def __init__(self, at: set[int]) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx in self.at:
            for g in trainer.optimizers[0].param_groups:
                g["lr"] *= 0.5


class Final(L.Callback):
    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.params = {n: _full(p, p, trainer) for n, p in pl_module.named_parameters(remove_duplicate=False)}
        momenta, canonical = trainer.optimizers[0].state, getattr(trainer.strategy, "parameter_names", {})
        self.params.update({f"momentum:{canonical.get(n, n)}": _full(momenta[p]["momentum_buffer"], p, trainer)
                            for n, p in pl_module.named_parameters() if p in momenta})  # a tied weight: one name


def run(out: Path, scenario: str, tp: int, pp: int, dp: int, *, reference: bool = False) -> dict[str, Any]:
    """One fit; returns what this rank recorded (and saves it under ``out``)."""
    from lightning_tpp import SpikeGuard, TensorPipeStrategy

    spec = SCENARIOS[scenario]
    L.seed_everything(0, verbose=False)
    module = Planted(set() if reference else spec["loss_at"], set() if reference else spec["nan_at"])
    data = token_dataset(4 * BATCHES)
    batches = [list(range(4 * b, 4 * b + 4)) for b in (spec["reference"] if reference else range(BATCHES))]
    loader = torch.utils.data.DataLoader(data, batch_sampler=batches)
    final = Final()
    guard: Optional[SpikeGuard] = None
    if reference:
        callbacks: list[L.Callback] = [LowerLR(spec["low_lr"]), final]
        strategy: Any = "auto"
    else:  # short windows: the spikes come early; the thresholds are the defaults
        guard = SpikeGuard(window=20, warmup=3, **spec["guard"])
        callbacks = [GradFault(spec["grad_at"], FAULTY_RANK if tp * pp * dp > 1 else 0), guard, final]
        strategy = TensorPipeStrategy(tp=tp, pp=pp, dp=dp, microbatches=2, print_plan=False, on_nonfinite="skip")
    trainer = L.Trainer(accelerator="cpu", devices=tp * pp * dp, strategy=strategy, max_epochs=1,
                        logger=CSVLogger(out, name=f"{scenario}{'-reference' if reference else ''}", version=0),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=callbacks, num_sanity_val_steps=0,
                        accumulate_grad_batches=spec.get("accumulate", 1))
    trainer.fit(module, loader)
    record = {"params": final.params, "global_step": trainer.global_step,
              "incidents": [(i.step, i.kind, i.action, i.ranks, i.detail) for i in guard.incidents] if guard else [],
              "lr": [g["lr"] for g in trainer.optimizers[0].param_groups], "log_dir": trainer.log_dir}
    torch.save(record, out / f"{scenario}{'-reference' if reference else ''}.rank{trainer.global_rank}.pt")
    return record


if __name__ == "__main__":
    out, tp, pp, dp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    for name in (sys.argv[5] if len(sys.argv) > 5 else "skip,rollback").split(","):
        run(out, name, tp, pp, dp)
