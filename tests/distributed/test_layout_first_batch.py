"""``layout="auto"`` without ``example_input_array`` at 2 processes (issue #44 item 6): rank 0 alone reads the first
batch of the datamodule's ``train_dataloader()`` and every rank times and trains on its shape; a datamodule whose
loader needs ``setup()`` stops every rank with rank 0's error (none waits on a rank 0 that is gone).

This file is also the worker (``python test_layout_first_batch.py OUT CASE``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch import run_ranks  # noqa: E402

BATCH = 4


def test_rank_zero_reads_the_first_batch_and_every_rank_trains_on_its_shape(tmp_path: Path) -> None:
    result = run_ranks(Path(__file__), 2, [str(tmp_path), "reads"], timeout=60).check()
    ranks = [json.loads((tmp_path / f"reads.rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["layout"] == ranks[1]["layout"] and all(r["steps"] == 1 for r in ranks), ranks
    assert [r["calls"]["train_dataloader"] for r in ranks] == [2, 1]  # rank 0: once more, for the shape
    assert [r["calls"]["setup"] for r in ranks] == [1, 1]
    assert f"one per-process batch is {BATCH} x " in result.outputs[0] and "_Data.train_dataloader()" in \
        result.outputs[0]
    assert "one per-process batch is" not in result.outputs[1]


def test_a_loader_that_needs_setup_stops_every_rank_with_rank_zeros_error(tmp_path: Path) -> None:
    result = run_ranks(Path(__file__), 2, [str(tmp_path), "needs_setup"], timeout=60)
    assert not result.timed_out and all(c != 0 for c in result.returncodes), result.returncodes
    reason = "_Data.train_dataloader(), before Lightning calls prepare_data() and setup(), and reading it raised " \
             "AttributeError: '_Data' object has no attribute 'train_set'"
    assert "AutoLayoutError" in result.outputs[0] and reason in result.outputs[0], result.outputs[0][-3000:]
    assert "layout='auto' found no batch shape (rank 0): AutoLayoutError: layout='auto' reads one per-process " \
           "batch shape" in result.outputs[1] and reason in result.outputs[1], result.outputs[1][-3000:]


# ---- the worker (run as a script by the tests above) -----------------------------------------------------------------
def _worker(out: Path, case: str) -> None:
    from dataclasses import asdict

    import lightning as L
    import torch

    from lightning_tpp import TensorPipeStrategy
    from models import LitLM, token_dataset

    class _Data(L.LightningDataModule):
        def __init__(self, early: bool) -> None:
            super().__init__()
            self.calls = {"setup": 0, "train_dataloader": 0}
            if early:
                self.train_set = token_dataset(16)

        def setup(self, stage: str) -> None:
            self.calls["setup"] += 1
            if not hasattr(self, "train_set"):
                self.train_set = token_dataset(16)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            self.calls["train_dataloader"] += 1
            return torch.utils.data.DataLoader(self.train_set, batch_size=BATCH)

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    data = _Data(early=case == "reads")
    strategy = TensorPipeStrategy(layout="auto", print_plan=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LitLM("llama"), datamodule=data)
    rank = trainer.global_rank
    (out / f"{case}.rank{rank}.json").write_text(json.dumps(
        {"layout": asdict(strategy.parallel_state.layout), "calls": data.calls, "steps": trainer.global_step}))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), sys.argv[2])
