"""A checkpoint saved by an earlier version loads and means what it meant (issue #45: nothing a user sees changes).

``tests/data/ckpt_f406bc4_tp2_step2``: a sharded checkpoint written by commit f406bc4 (before the configuration
became one object and setup was reorganised) at tp=2, nanogpt after 2 SGD-momentum steps (``LitLM("nanogpt",
optimizer="sgdm", lr=0.05)``, ``token_dataset(16)``, batch 4). Consolidated today, it equals one process's model
after the same two steps, and holds the step and the momentum."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from models import LitLM, token_dataset

OLD = Path(__file__).resolve().parents[1] / "data" / "ckpt_f406bc4_tp2_step2"


def test_a_checkpoint_of_the_previous_version_consolidates_to_one_process_weights(tmp_path: Path) -> None:
    from lightning_tpp import consolidate

    consolidate(OLD, tmp_path / "old.ckpt")
    old = torch.load(tmp_path / "old.ckpt", weights_only=True)
    L.seed_everything(0, verbose=False)
    model = LitLM("nanogpt", optimizer="sgdm", lr=0.05)
    L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(
        model, torch.utils.data.DataLoader(token_dataset(16), batch_size=4))
    assert old["global_step"] == 2
    want = model.state_dict()
    assert old["state_dict"].keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(old["state_dict"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    momentum = [s["momentum_buffer"] for s in old["optimizer_states"][0]["state"].values()]
    assert len(momentum) == len(list(model.parameters())) and all(torch.isfinite(m).all() for m in momentum)
