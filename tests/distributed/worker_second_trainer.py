"""One model, two Trainers: the second adopts the parallel state the first built (pipeline and tensor parallel layers
stay cut as they are) and trains on; a third with other arguments is refused. The set-ups after the first build no
process group: the layout's are reused. See test_second_trainer.py.

    python worker_second_trainer.py OUT TP PP     # TP = PP = 0: one process, no strategy (the reference)
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

from models import LitLM, token_dataset
from parity import Recorder


class Lit(LitLM):
    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x).flatten(0, 1), y.flatten()), sync_dist=True)


def _trainer(tp: int, pp: int, recorder: Recorder, microbatches: int = 2) -> L.Trainer:
    from lightning_tpp import TensorPipeStrategy

    strategy = TensorPipeStrategy(tp=tp, pp=pp, microbatches=microbatches, print_plan=False) if tp * pp else "auto"
    return L.Trainer(accelerator="cpu", devices=max(tp * pp, 1), strategy=strategy, max_steps=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False, callbacks=[recorder])


def _groups() -> int:
    """Process groups alive in this process (the default one included)."""
    import torch.distributed.distributed_c10d as c10d
    return len(c10d._world.pg_map)


def main() -> None:
    out, tp, pp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    L.seed_everything(0, verbose=False)
    module = Lit("nanogpt4", lr=0.05, optimizer="sgdm")
    loader = torch.utils.data.DataLoader(token_dataset(8), batch_size=4, shuffle=False)
    _trainer(tp, pp, Recorder()).fit(module, loader)
    groups = _groups()  # the process groups of the layout, built by the first fit
    second = Recorder()
    trainer = _trainer(tp, pp, second)
    trainer.fit(module, loader)  # a new Trainer and strategy, the same (already parallel) module
    second.record.logged = trainer.validate(module, loader, verbose=False)[0]
    # .test and .predict of two more Trainers, each adopting the state; predictions: whole logits on every rank
    second.record.logged.update(_trainer(tp, pp, Recorder()).test(module, loader, verbose=False)[0])
    predictions = _trainer(tp, pp, Recorder()).predict(module, loader)
    second.record.logged["predicted"] = float(sum(p.double().square().sum() for p in predictions))
    torch.save(asdict(second.record), out / f"second.rank{trainer.global_rank}.pt")
    if tp * pp:
        print("adopted", trainer.strategy.parallel_state is not None, flush=True)
        print(f"process groups after the first fit {groups}, after four more set-ups {_groups()}", flush=True)
        _trainer(tp, pp, Recorder(), microbatches=4).validate(module, loader, verbose=False)  # refused


if __name__ == "__main__":
    main()
