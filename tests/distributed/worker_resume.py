"""Train, save, resume in another layout: one phase of it per call (``layout`` = "none" for one process).

    python worker_resume.py OUT first  TP PP CKPT   # 1 epoch (3 steps), then save CKPT
    python worker_resume.py OUT second TP PP CKPT   # resume from CKPT for a second epoch (steps 4-6)
    ... [sharded|whole] [OPTIMIZER] [DP] [MODEL] [EP] [CP]  # save as a torch.distributed.checkpoint folder; sgdm
                                                    # or adafactor; DP replicas (FSDP2-sharded), each reading every
                                                    # batch; a MODELS name (default nanogpt4); experts split over EP
                                                    # ranks; context parallelism over CP ranks
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import lightning as L
import torch

from models import LitLM, token_dataset
from parity import Recorder


def run(out: Path, phase: str, tp: int, pp: int, ckpt: Path, model: str = "nanogpt4", sharded: bool = False,
        optimizer: str = "sgdm", dp: int = 1, ep: int = 1, cp: int = 1) -> None:
    from lightning_tpp import TensorPipeStrategy

    L.seed_everything(0, verbose=False)
    module = LitLM(model, lr=0.05, optimizer=optimizer)
    strategy = TensorPipeStrategy(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, microbatches=2, print_plan=False,
                                  save_distributed_checkpoint=sharded) if tp * pp else "auto"
    recorder = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=max(tp * pp * dp * cp, 1), strategy=strategy,
                        max_steps=3 if phase == "first" else 6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[recorder])
    loader = torch.utils.data.DataLoader(token_dataset(12), batch_size=4, shuffle=False)
    trainer.fit(module, loader, ckpt_path=None if phase == "first" else ckpt)
    if phase == "first":
        trainer.save_checkpoint(ckpt)
    else:  # evaluate the checkpoint we started from, in this layout
        recorder.record.logged = trainer.validate(module, loader, ckpt_path=ckpt, verbose=False)[0]
    torch.save(asdict(recorder.record), out / f"{phase}.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    out, phase, tp, pp, ckpt = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    run(out, phase, tp, pp, ckpt, sharded=len(sys.argv) > 6 and sys.argv[6] == "sharded",
        optimizer=sys.argv[7] if len(sys.argv) > 7 else "sgdm", dp=int(sys.argv[8]) if len(sys.argv) > 8 else 1,
        model=sys.argv[9] if len(sys.argv) > 9 else "nanogpt4", ep=int(sys.argv[10]) if len(sys.argv) > 10 else 1,
        cp=int(sys.argv[11]) if len(sys.argv) > 11 else 1)
