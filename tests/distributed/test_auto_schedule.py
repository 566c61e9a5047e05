"""``schedule="auto"`` at pp=2 on CPU (gloo): it measures with zb-drain, logs its choice once, switches for the
steps after, and trains as one process does.

Two launches: nanoGPT through ``tests/parity.py`` (losses, gradients and parameters against one process), and this
file as the worker (``python test_auto_schedule.py OUT``): stages of controlled cost made of sleeps, where a split
backward costs the same as a whole one (F = I = W: a zero-bubble schedule must win) or much more (W three times a
whole backward's weight part: 1F1B must win), each rank recording the action kinds it ran in each step."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch import ROOT, run_ranks  # noqa: E402

from lightning_tpp.pipeline.schedule import actions  # noqa: E402

STEPS = 5
SECONDS = 0.02  # forward, input gradient and (whole) weight gradient per micro-batch and rank


def test_auto_matches_one_process_and_logs_its_choice(tmp_path: Path) -> None:
    from parity import assert_parity, load_record, merge_stages, train

    result = run_ranks(ROOT / "tests" / "parity.py", 2, ["--models", "nanogpt", "--pp", "2", "--out", str(tmp_path),
                                                         "--schedule", "auto"], timeout=240).check()
    lines = [ln for ln in result.outputs[0].splitlines() if "schedule='auto': chose" in ln]
    assert len(lines) == 1, result.outputs[0][-3000:]  # once, on rank 0
    assert "schedule='auto'" not in result.outputs[1]
    got = merge_stages([load_record(tmp_path / f"nanogpt.rank{r}.pt") for r in range(2)])
    assert_parity(got, train("nanogpt"), where="nanogpt pp=2 schedule='auto'")


@pytest.fixture(scope="module")
def sleeps_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    out = tmp_path_factory.mktemp("auto_schedule")
    result = run_ranks(Path(__file__), 2, [str(out)], timeout=120).check()
    return out, result.outputs


@pytest.mark.parametrize("case, allowed", [("free", ("zb-drain", "zero-bubble", "zb-lead")), ("costly", ("1f1b",))])
def test_auto_switches_to_the_schedule_the_costs_favour(sleeps_run, case: str, allowed: tuple[str, ...]) -> None:
    """Free splits: a zero-bubble schedule (they tie at pp=2 with F = I = W; a sleep overrunning under load may
    tip it to zero-bubble, or to zb-lead where the sleeps vary); splits costing a whole forward more than a backward:
    1F1B."""
    out, outputs = sleeps_run
    ranks = [json.loads((out / f"{case}.rank{r}.json").read_text()) for r in range(2)]
    chosen = ranks[0]["choice"]
    assert chosen in allowed and all(r["choice"] == chosen for r in ranks), ranks
    assert f"schedule='auto': chose {chosen!r}" in outputs[0]
    # steps 0-2 measure with zb-drain (rank 1 splits some backwards, rank 0 none); then the choice runs
    assert [r["kinds"][:3] for r in ranks] == [["BF"] * 3, ["BFIW"] * 3]
    # the forwards of those split backwards are timed apart (FS): rank 1's, not the first stage's (it never splits)
    splits = sum(kind == "I" for kind, _, _ in actions("zb-drain", 1, 2, 4))
    assert [r["split_forwards"][:3] for r in ranks] == [[0] * 3, [splits] * 3] and splits > 0
    after = "BF" if chosen == "1f1b" else None  # zb-drain's rank 0 also runs only F and B: checked on 1f1b only
    for r in ranks:
        assert len(r["kinds"]) == STEPS and (after is None or r["kinds"][3:] == [after] * (STEPS - 3)), r
    assert ranks[0]["losses"] == ranks[1]["losses"]


# ---- the worker (run as a script by the fixture above) --------------------------------------------------------------
def _worker(out: Path) -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn

    from worker_pipeline_metrics import Sleep  # importing it makes a marked weight's deferred gradient (W) sleep

    from lightning_tpp import TensorPipeStrategy

    rank = int(os.environ["LOCAL_RANK"])

    class Block(nn.Module):
        def __init__(self, seconds: float, w_seconds: float) -> None:
            super().__init__()
            self.seconds = seconds
            self.weight = nn.Parameter(torch.eye(4) + 0.01 * torch.randn(4, 4))
            self.weight.sleep_in_w = w_seconds
            self.weight.register_hook(lambda g: time.sleep(seconds) if g is not None else None)  # whole backward

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Sleep.apply(x, self.seconds) + 0.1 * F.linear(x, self.weight)

    class Blocks(L.LightningModule):
        def __init__(self, w_seconds: float) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(SECONDS / 2, w_seconds) for _ in range(4)])
            self.scale = nn.Parameter(torch.ones(()))

        def training_step(self, batch, batch_idx):
            x = batch[0] * self.scale
            for block in self.blocks:
                x = block(x)
            return F.mse_loss(x, torch.zeros_like(x))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Record(L.Callback):
        def __init__(self) -> None:
            self.kinds: list[str] = []
            self.losses: list[float] = []
            self.split_forwards: list[int] = []

        def on_train_batch_start(self, trainer, *args) -> None:
            trainer.strategy._engine.record_trace(True)

        def on_train_batch_end(self, trainer, module, outputs, *args) -> None:
            self.kinds.append("".join(sorted({t[0] for t in trainer.strategy._engine.trace})))
            self.losses.append(float(outputs["loss"]))
            self.split_forwards.append(trainer.strategy._engine.times.costs["FS"][1])

    torch.set_num_threads(1)
    for case, w_seconds in (("free", SECONDS / 2), ("costly", 3 * SECONDS / 2)):
        L.seed_everything(0, verbose=False)
        data = torch.utils.data.TensorDataset(torch.randn(4 * STEPS, 4))
        record = Record()
        trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=STEPS, logger=False, callbacks=[record],
                            strategy=TensorPipeStrategy(pp=2, microbatches=4, schedule="auto", print_plan=False),
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Blocks(w_seconds), torch.utils.data.DataLoader(data, batch_size=4))
        choice = trainer.strategy._engine.choice
        (out / f"{case}.rank{rank}.json").write_text(json.dumps(
            {"choice": choice.schedule if choice else None, "kinds": record.kinds, "losses": record.losses,
             "split_forwards": record.split_forwards}))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
