"""``layout="auto"`` with a model that Lightning's ``configure_model`` builds (the way to build a large model on
meta): the strategy builds it on meta before the mesh, as the Trainer would, searches, and trains; a hook that
cannot run before the mesh exists gets an error that says so."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_tpp import TensorPipeStrategy
from lightning_tpp.layout.strategy import AutoLayoutError
from models import SEQ, VOCAB, LitLM, token_dataset


def _fit(module: L.LightningModule, steps: int = 1) -> L.Trainer:
    module.example_input_array = torch.zeros(4, SEQ, dtype=torch.long)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=TensorPipeStrategy(layout="auto", print_plan=False),
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    try:
        trainer.fit(module, torch.utils.data.DataLoader(token_dataset(16), batch_size=4))
    finally:  # the strategy's one-process group, which later tests would meet
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return trainer


def test_a_model_built_in_configure_model_is_searched_and_trains() -> None:
    calls = []

    class Counted(LitLM):
        def configure_model(self) -> None:
            calls.append(self.model is None)
            super().configure_model()

    module = Counted("llama", build_in_configure_model=True)
    trainer = _fit(module, steps=2)
    assert calls[0] is True and len(calls) == 2  # built once, before the mesh; Lightning's own call finds it
    ranking = trainer.strategy.layout_ranking
    assert ranking is not None and ranking.best.layout == trainer.strategy.parallel_state.layout
    assert trainer.global_step == 2
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in module.parameters())
    params = sum(p.numel() for p in LitLM("llama").parameters())
    assert sum(p.numel() for p in module.parameters()) == params  # the model that trained is the whole model


def test_a_configure_model_that_needs_the_mesh_is_named() -> None:
    class NeedsMesh(LitLM):
        def configure_model(self) -> None:
            if self.model is None:
                self.device_mesh["tp"]  # ModelParallelStrategy's style: the mesh is not there yet
                super().configure_model()

    with pytest.raises(AutoLayoutError, match=r"configure_model failed there: TypeError: 'NoneType' object is not subscriptable.*give tp, pp and dp"):
        _fit(NeedsMesh("llama", build_in_configure_model=True))


def test_a_module_without_forward_is_searched_by_its_model() -> None:
    """A LightningModule that calls its Hugging Face model in training_step (no forward of its own), built in
    configure_model: the search profiles the child holding the parameters (a Qwen2 it has not seen)."""
    import transformers

    class NoForward(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
                self.model = transformers.Qwen2ForCausalLM(cfg)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = NoForward()
    trainer = _fit(module, steps=2)
    assert trainer.global_step == 2 and trainer.strategy.layout_ranking is not None
    assert not any(p.is_meta for p in module.parameters())
