"""lightning_tpp.integration's extension points, in one process: the precision plugin and the summary callback become
instances of a subclass (isinstance, state_key and pickling unchanged), and the launcher's whole weights reach the
state_dict through a hook that is removed afterwards."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn

from lightning_tpp import TensorPipeStrategy
from lightning_tpp.integration.launchers import WholeWeightsLauncher
from lightning_tpp.integration.precision import GlobalNormClipping, with_global_norm
from lightning_tpp.integration.summary import ShardedModelSummary, WholeModelSummaryCallback, count_whole_model


def test_connector_plugin_clips_by_the_strategys_global_norm() -> None:
    strategy = TensorPipeStrategy()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", logger=False)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MixedPrecision) and isinstance(plugin, GlobalNormClipping)
    assert type(plugin).__name__ == "MixedPrecision"
    assert plugin.global_norm_clip == strategy._clip_grad_by_norm
    assert "clip_grad_by_norm" not in vars(plugin)  # a method of its class, not assigned on the instance


def test_global_norm_clip_is_called_and_pickles() -> None:
    calls: list[Any] = []
    plugin = with_global_norm(Precision(), lambda opt, v: calls.append(v))
    plugin.clip_grad_by_norm(torch.optim.SGD([nn.Parameter(torch.ones(1))]), 0.5)
    assert calls == [0.5]
    for clone in (pickle.loads(pickle.dumps(with_global_norm(MixedPrecision("bf16-mixed", "cpu"), print))),
                  copy.deepcopy(plugin)):
        assert isinstance(clone, GlobalNormClipping) and isinstance(clone, Precision)
    assert with_global_norm(None, print) is None


def test_unbound_plugin_clips_as_lightning_does() -> None:
    plugin = with_global_norm(Precision(), print)
    plugin.global_norm_clip = None
    p = nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    plugin.clip_grad_by_norm(torch.optim.SGD([p]), 1.0)
    assert abs(float(p.grad.norm()) - 1.0) < 1e-5


def test_summary_callbacks_keep_their_identity() -> None:
    plain, rich = ModelSummary(max_depth=2), RichModelSummary()
    keys = (plain.state_key, rich.state_key)
    count_whole_model([plain, rich, object()])
    count_whole_model([plain])  # idempotent
    assert isinstance(plain, WholeModelSummaryCallback) and isinstance(rich, RichModelSummary)
    assert (plain.state_key, rich.state_key) == keys
    assert "_summary" not in vars(plain)


def test_summary_under_another_strategy_is_lightnings() -> None:
    model = L.LightningModule()
    model.layer = nn.Linear(2, 3)
    cb = ModelSummary()
    count_whole_model([cb])
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    summary = cb._summary(trainer, model)
    assert not isinstance(summary, ShardedModelSummary) and summary.total_parameters == 9


def test_summary_under_tensor_pipe_counts_the_strategys_totals() -> None:
    model = L.LightningModule()
    model.layer = nn.Linear(2, 3)
    cb = ModelSummary()
    count_whole_model([cb])
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=TensorPipeStrategy(), logger=False)
    summary = cb._summary(trainer, model)
    assert isinstance(summary, ShardedModelSummary) and summary.total_parameters == 9


def test_launcher_hands_whole_weights_through_a_removed_hook(monkeypatch: Any) -> None:
    module = nn.Linear(2, 2)
    full = {"weight": torch.zeros(4, 2), "bias": torch.zeros(4)}
    seen = {}

    class Strategy:
        def whole_model_state(self) -> dict[str, Any]:
            return full

    class Trainer:
        lightning_module = module

    def collect(self: Any, trainer: Any, results: Any) -> Any:
        seen.update(trainer.lightning_module.state_dict())
        return results

    monkeypatch.setattr("lightning_tpp._compat.MultiProcessingLauncher.collect_rank_zero_results", collect)
    launcher = WholeWeightsLauncher.__new__(WholeWeightsLauncher)
    launcher._strategy = Strategy()
    assert launcher.collect_rank_zero_results(Trainer(), "results") == "results"
    assert seen.keys() == full.keys() and seen["weight"].shape == (4, 2)
    assert module.state_dict()["weight"].shape == (2, 2)  # the hook is gone


# --- the newcomer's view: the summary shows the model's own classes and whole counts (issue #30, item 6) ---

def _summary_rows(summary: Any) -> list[tuple[str, str, int]]:
    return list(zip(summary.layer_names, summary.layer_types, summary.param_nums))


def test_summary_rows_show_the_models_classes_and_other_stages_modules() -> None:
    """A swapped class shows its original name, and another stage's stand-in shows the module it stands for, with
    the counts of its meta twin: the rows are one process's, at every depth."""
    from lightning.pytorch.utilities.model_summary import summarize

    from lightning_tpp.core.swap import swap_class
    from lightning_tpp.pipeline.stage import StageRuntime, Unit, _RemoteModule, meta_twin

    class Mixin:
        pass

    def build() -> L.LightningModule:
        torch.manual_seed(0)
        model = L.LightningModule()
        model.emb = nn.Embedding(10, 4)
        model.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)) for _ in range(2))
        model.head = nn.Linear(4, 10)
        return model

    one, cut = build(), build()
    swap_class(cut.emb, Mixin)
    swap_class(cut.blocks[0][0], Mixin)
    runtime = StageRuntime(torch.device("cpu"))
    runtime.units = [Unit("blocks.1", 1), Unit("head", 1, "post")]
    cut.blocks[1] = _RemoteModule(meta_twin(one.blocks[1]), runtime, unit=0)
    cut.head = _RemoteModule(meta_twin(one.head), runtime, unit=1)
    assert type(cut.emb).__name__ == "Mixin[Embedding]"
    for depth in (1, 2, -1):
        expected = summarize(one, max_depth=depth)
        got = ShardedModelSummary(cut, max_depth=depth)
        assert _summary_rows(got) == _summary_rows(expected), depth
        assert got.total_parameters == expected.total_parameters
        assert got.total_training_modes == expected.total_training_modes
