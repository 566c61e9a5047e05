"""A rank lost under ``torchrun --max-restarts``, the job resumed in a smaller world; see test_elastic.py.

    torchrun --standalone --nnodes=1 --nproc-per-node=4 --max-restarts=1 worker_elastic.py OUT killed
        attempt 0: tp2 x dp2 (4 ranks), a checkpoint every 2 steps; rank 3 SIGKILLs itself as step 5 starts.
        attempt 1 (torchrun restarts every worker): OUT/world holds the world size left (2) and a port for its
        rendezvous, as a scheduler would hand them out after a node was lost: workers 2 and 3 leave, 0 and 1 form
        tp2 x dp1 (dp="auto") and resume from the last checkpoint (ckpt_path="last") to step 8.
    reference(OUT)    one process, no strategy, 8 steps of the same 8-sample global batches (the order Lightning's
                      DistributedSampler draws: seed 0)

    torchrun --standalone --nnodes=1 --nproc-per-node=4 --max-restarts=1 worker_elastic.py OUT same
        as "killed", but attempt 1 is the same world of 4 on torchrun's own store (the dead attempt's keys in it);
        "same_async": the same with checkpoints saved in the background (async_save=True)

    torchrun --nnodes=1:2 --nproc-per-node=2 --rdzv-backend=c10d ... worker_elastic.py OUT node   (two agents)
        attempt 0: the two agents' 4 workers, tp2 x dp2; as step 5 starts, the second node's workers write their
        pids and wait; the test SIGKILLs that node (its agent and workers). The first agent's workers fail, it
        restarts them, and the c10d rendezvous forms the world that is left: one node of 2 workers, tp2 x dp1.

Every rank records (attempt, step, loss) per micro-batch to OUT/losses.attempt{A}.rank{R}.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
NODE_LOST = sys.argv[2:3] == ["node"]


class Record(L.Callback):
    def __init__(self, out: Path, kill_at: int | None) -> None:
        self.out, self.kill_at = out, kill_at
        self.rows: list[tuple[int, int, float]] = []
        self.step = 0

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        self.step = trainer.global_step
        if self.kill_at is None or trainer.global_step != self.kill_at or ATTEMPT > 0:
            return
        if NODE_LOST:  # the second node's workers say where they are and wait for the test to kill their node
            if trainer.global_rank >= 2:
                self._dump(trainer)
                tmp = self.out / f"pid.rank{trainer.global_rank}.tmp"
                tmp.write_text(f"{os.getpid()} {os.getppid()}")  # the worker and its agent
                os.replace(tmp, self.out / f"pid.rank{trainer.global_rank}")
                if trainer.global_rank == 3:
                    time.sleep(600)
        elif trainer.global_rank == 3:
            self._dump(trainer)
            os.kill(os.getpid(), signal.SIGKILL)  # a lost rank: no exception, no goodbye

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, *args) -> None:
        self.rows.append((ATTEMPT, self.step, float(outputs["loss"])))
        self._dump(trainer)

    def _dump(self, trainer: L.Trainer) -> None:
        path = self.out / f"losses.attempt{ATTEMPT}.rank{trainer.global_rank}.json"
        path.write_text(json.dumps({"world": trainer.world_size, "rows": self.rows}))


def reference(out: Path) -> dict[str, torch.Tensor]:
    from models import LitLM, token_dataset

    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    record = Record(out, None)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=8, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[record])
    data = token_dataset(64)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    model = LitLM("nanogpt4", lr=0.05)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler))
    return model.state_dict()


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "killed" and ATTEMPT > 0:  # the world left after the loss, as a scheduler would hand it out
        world, port = (int(v) for v in (out / "world").read_text().split())
        if int(os.environ["RANK"]) >= world:
            return
        # a rendezvous of the smaller world (torchrun's agent store expects the 4 workers it started)
        os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="False")
    from lightning_tpp import TensorPipeStrategy
    from models import LitLM, token_dataset

    L.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "4"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))  # "node": two agents of 2 workers, then one
    checkpoints = ModelCheckpoint(out / "ckpt", filename="step{step}", every_n_train_steps=2, save_last=True,
                                  auto_insert_metric_name=False)
    record = Record(out, 4 if mode in ("killed", "node", "same", "same_async") else None)
    trainer = L.Trainer(accelerator="cpu", devices=local, num_nodes=world // local, max_steps=8, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[record, checkpoints],
                        strategy=TensorPipeStrategy(tp=2, dp="auto", print_plan=False, timeout=timedelta(seconds=10),
                                                    async_save=mode == "same_async"))
    loader = torch.utils.data.DataLoader(token_dataset(64), batch_size=4)  # one epoch: 8 steps of 8 samples at dp2
    trainer.fit(LitLM("nanogpt4", lr=0.05), loader, ckpt_path="last" if ATTEMPT > 0 else None)
    trainer.save_checkpoint(out / f"final.{mode}.ckpt")


if __name__ == "__main__":
    main()
