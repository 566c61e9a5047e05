"""Batch statistics under micro-batching (pipeline.batchnorm) in one process: running statistics accumulated over
the micro-batches of a step and committed once equal a layer's update from the whole batch; the normalisation of each
micro-batch is unchanged; eval is untouched; a recomputation is not counted; the warning names the layers; and
``sync_batchnorm`` converts over the dp group only (data_parallel.sync_batchnorm)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lightning_tpp.core.recompute import recompute_blocks
from lightning_tpp.data_parallel import SyncBatchNormDeviceError, sync_batchnorm_over_dp
from lightning_tpp.pipeline.batchnorm import DeferredStatistics, batch_statistics_layers, microbatch_warning
from models import TinyResNet

TOL = dict(rtol=1e-5, atol=1e-6)


class Norms(nn.Module):
    """One of each kind of layer whose running statistics are deferred, each on the input (a layer after another
    would see the first one's output, normalised by micro-batch here and by the whole batch there)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(3)
        self.cumulative = nn.BatchNorm2d(3, momentum=None)
        self.bn1d = nn.BatchNorm1d(3, momentum=0.3)
        self.instance = nn.InstanceNorm2d(3, track_running_stats=True)
        self.untracked = nn.BatchNorm2d(3, track_running_stats=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.bn(x), self.cumulative(x), self.instance(x), self.untracked(x),
                            self.bn1d(x.flatten(2)).view_as(x)])


def _buffers(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in m.named_buffers()}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)


def test_committed_statistics_equal_the_whole_batch() -> None:
    torch.manual_seed(0)
    ref = Norms()
    deferred = copy.deepcopy(ref)
    stats = DeferredStatistics.install(deferred, pp=2, microbatches=3)
    assert stats is not None and [n for n, _ in stats.layers] == ["bn", "cumulative", "bn1d", "instance"]
    for step in range(3):  # moving buffers: each commit starts from the last one
        batch = torch.randn(5, 3, 4, 4) * (step + 1) + step
        ref(batch)
        before = _buffers(deferred)
        stats.begin(5, 3)
        for part in batch.split([2, 2, 1]):  # uneven micro-batches, as split_batch cuts 5 in 3
            out = deferred(part)
            torch.testing.assert_close(out, copy.deepcopy(ref).train()(part), **TOL)  # each normalised by its own
        _assert_same(_buffers(deferred), before)  # nothing moves before the commit
        stats.commit()
        _assert_same(_buffers(deferred), _buffers(ref))
    assert int(deferred.cumulative.num_batches_tracked) == 3
    ref.eval(), deferred.eval()
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(deferred(x), ref(x), **TOL)  # eval: the running statistics, as in one process


def test_without_deferral_the_statistics_differ() -> None:
    """The check above can fail: updating per micro-batch (what a pipeline did) gives other running statistics."""
    torch.manual_seed(0)
    ref, micro = Norms(), None
    micro = copy.deepcopy(ref)
    batch = torch.randn(4, 3, 4, 4)
    ref(batch)
    for part in batch.chunk(2):
        micro(part)
    assert not torch.allclose(micro.bn.running_var, ref.bn.running_var, **TOL)
    assert int(micro.cumulative.num_batches_tracked) == 2


def test_a_recomputed_block_is_counted_once() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)))
    deferred = copy.deepcopy(ref)
    recompute_blocks(deferred, ["0"])
    stats = DeferredStatistics.install(deferred, pp=2, microbatches=2)
    assert stats is not None
    batch = torch.randn(4, 3, 4, 4)
    ref(batch)
    stats.begin(4, 2)
    for part in batch.chunk(2):
        deferred(part).square().sum().backward()  # backward runs the block's forward again
    stats.commit()
    _assert_same(_buffers(deferred), _buffers(ref))


def test_nothing_to_defer() -> None:
    assert DeferredStatistics.install(Norms(), pp=2, microbatches=1) is None
    assert DeferredStatistics.install(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)), pp=2, microbatches=4) is None


def test_warning_names_the_layers_and_what_to_do(recwarn: pytest.WarningsRecorder) -> None:
    model = TinyResNet()
    layers = batch_statistics_layers(model)
    assert [layer.name for layer in layers] == ["bn"] + [f"blocks.{i}.bn{j}" for i in range(4) for j in (1, 2)]
    text = microbatch_warning(layers, microbatches=2, batch=8, pp=2)
    assert "9 layer(s)" in text and "BatchNorm2d: bn, blocks.0.bn1" in text and "(3 more)" in text
    assert "micro-batches of 4 samples" in text and "microbatches=1" in text and "GroupNorm/LayerNorm" in text
    assert "running statistics are kept over the whole batch" in text
    stats = DeferredStatistics.install(model, pp=2, microbatches=2)
    assert stats is not None
    stats.begin(8, 2)
    stats.begin(8, 2)  # once
    said = [str(w.message) for w in recwarn if "normalise with batch statistics" in str(w.message)]
    assert len(said) == 1 and "pp=2 with microbatches=2" in said[0]


def test_warning_a_layer_of_another_class() -> None:
    class MyNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("running_mean", torch.zeros(2))
            self.register_buffer("running_var", torch.ones(2))

    class FrozenBatchNorm2d(MyNorm):  # torchvision's reads no batch statistics
        pass

    layers = batch_statistics_layers(nn.Sequential(MyNorm(), FrozenBatchNorm2d(), nn.BatchNorm1d(2)))
    assert [(layer.name, layer.deferred) for layer in layers] == [("0", False), ("2", True)]
    text = microbatch_warning(layers, microbatches=4, batch=4, pp=2)
    assert "running statistics of 0 are updated once per micro-batch" in text


def test_sync_batchnorm_converts_over_dp_only() -> None:
    group: Any = object()  # stands in for the dp process group
    model = TinyResNet()
    n = sync_batchnorm_over_dp(model, convert=True, dp=2, group=group, device=torch.device("cuda"))
    assert n == 9 and isinstance(model.blocks[0].bn1, nn.SyncBatchNorm)
    assert all(m.process_group is group for m in model.modules() if isinstance(m, nn.SyncBatchNorm))
    assert not isinstance(model.norm, nn.SyncBatchNorm)
    one = TinyResNet()  # one replica: nothing to synchronise
    assert sync_batchnorm_over_dp(one, convert=True, dp=1, group=group, device=torch.device("cuda")) == 0
    own = nn.Sequential(nn.SyncBatchNorm(2))  # the user's own, without a group: the dp group, not the world
    sync_batchnorm_over_dp(own, convert=False, dp=1, group=group, device=torch.device("cuda"))
    assert own[0].process_group is group


def test_sync_batchnorm_on_cpu_raises() -> None:
    with pytest.raises(SyncBatchNormDeviceError, match=r"9 SyncBatchNorm layer\(s\) .* GPUs only.*accelerator='gpu'"):
        sync_batchnorm_over_dp(TinyResNet(), convert=True, dp=2, group=None, device=torch.device("cpu"))


def test_sync_batchnorm_commits_the_replicas_union(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SyncBatchNorm adds its sums over its process group before committing: two replicas that saw the same batch
    (all_reduce doubles) commit what one layer gets from both batches together. torch's SyncBatchNorm trains on GPUs
    only, so the sums are added here as its forward would add them."""
    import torch.distributed as dist

    from lightning_tpp.pipeline import batchnorm

    torch.manual_seed(0)
    model = nn.Sequential(nn.SyncBatchNorm(3))
    stats = DeferredStatistics.install(model, pp=2, microbatches=2, warn=[])
    assert stats is not None
    batch = torch.randn(4, 3, 4, 4)
    stats.begin(4, 2)
    for part in batch.chunk(2):
        model[0].__dict__[batchnorm._SLOT].add(model[0], part)
    groups = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: groups.append(group) or t.mul_(2))
    model[0].process_group = "dp"
    stats.commit()
    ref = nn.BatchNorm2d(3)
    ref(torch.cat([batch, batch]))
    assert groups == ["dp"]
    _assert_same({n: b for n, b in model[0].named_buffers()}, {n: b for n, b in ref.named_buffers()})


def test_the_strategy_reads_trainers_sync_batchnorm() -> None:
    import lightning as L

    from lightning_tpp import TensorPipeStrategy

    for flag in (True, False):
        trainer = L.Trainer(strategy=TensorPipeStrategy(), accelerator="cpu", devices=1, sync_batchnorm=flag,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False)
        assert trainer.strategy._sync_batchnorm is flag  # type: ignore[attr-defined]
        assert trainer.strategy._config()["sync_batchnorm"] == repr(flag)  # type: ignore[attr-defined]
