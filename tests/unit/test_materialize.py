"""Materialising a meta-built model: one seed, the same weights whatever the cut; what nobody initialises is named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_tpp.core.materialize import UninitializedParametersError, materialize, module_seed
from lightning_tpp.core.params import ParamNames, ShardIndex, ShardInfo
from lightning_tpp.core.sharding import ShardSpec, shard_tensor, unshard_tensor


def _model() -> nn.Module:
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 12), nn.LayerNorm(12),
                         nn.MultiheadAttention(12, 2, batch_first=True))


def _materialized(tp_rank: int, tp_size: int, seed: int = 3) -> tuple[nn.Module, ShardIndex]:
    with torch.device("meta"):
        model = _model()
    names = ParamNames.of(model)
    shards = ShardIndex()
    if tp_size > 1:  # cut the Linear column-wise, as tensor parallelism would on meta
        lin = model[1]
        for attr in ("weight", "bias"):
            old = getattr(lin, attr)
            new = nn.Parameter(shard_tensor(old.data, ShardSpec(0), tp_rank, tp_size))
            shards.add(new, ShardInfo(ShardSpec(0), tuple(old.shape)))
            setattr(lin, attr, new)
    materialize(model, device=torch.device("cpu"), names=names, shards=shards, tp_rank=tp_rank, tp_size=tp_size,
                base_seed=seed)
    return model, shards


def test_same_weights_in_every_cut() -> None:
    whole, _ = _materialized(0, 1)
    parts = [_materialized(r, 2)[0] for r in range(2)]
    for name, p in whole.named_parameters():
        if name.startswith("1."):
            got = unshard_tensor([dict(m.named_parameters())[name].detach() for m in parts], ShardSpec(0))
        else:
            got = dict(parts[1].named_parameters())[name]
        assert torch.equal(got, p), name
    assert not torch.equal(whole[3].in_proj_weight, torch.zeros_like(whole[3].in_proj_weight))
    assert torch.equal(whole[3].out_proj.bias, torch.zeros(12))  # the parent's _reset_parameters ran after the child's


def test_seed_changes_weights_and_parameters_keep_identity() -> None:
    a, _ = _materialized(0, 1, seed=1)
    b, _ = _materialized(0, 1, seed=2)
    assert not torch.equal(a[0].weight, b[0].weight)
    assert module_seed(1, "0") != module_seed(1, "1")
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    weight = model.weight
    materialize(model, device=torch.device("cpu"), names=ParamNames.of(model), shards=ShardIndex(), tp_rank=0,
                tp_size=1, base_seed=0)
    assert model.weight is weight and not weight.is_meta and weight.requires_grad


class _NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


class _HalfInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.a)  # forgets b


@pytest.mark.parametrize(("cls", "match"), [(_NoInit, r"define no reset_parameters.*1 \(_NoInit: scale\)"),
                                            (_HalfInit, r"left tensors \(partly\) unwritten: 1 \(_HalfInit: b\)")])
def test_what_nobody_initialises_is_named(cls: type, match: str) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), cls())
    with pytest.raises(UninitializedParametersError, match=match):
        materialize(model, device=torch.device("cpu"), names=ParamNames.of(model), shards=ShardIndex(), tp_rank=0,
                    tp_size=1, base_seed=0)


def test_uninitialised_allocation_for_loading() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), _NoInit())
    materialize(model, device=torch.device("cpu"), names=ParamNames.of(model), shards=ShardIndex(), tp_rank=0,
                tp_size=1, base_seed=0, initialize=False)  # weights will be loaded: no initialiser needed
    assert not any(p.is_meta for p in model.parameters())


def test_what_a_file_fills_is_only_allocated() -> None:
    """A module without an initialiser is fine when a weights file fills all its tensors (``loaded``); the others
    are still initialised."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), _NoInit())
    done = materialize(model, device=torch.device("cpu"), names=ParamNames.of(model), shards=ShardIndex(),
                       tp_rank=0, tp_size=1, base_seed=0, loaded={"1.scale"})
    assert set(done) == {"0", "1"} and not torch.isnan(model[0].weight).any()
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), _NoInit())
    with pytest.raises(UninitializedParametersError, match="_NoInit"):
        materialize(model, device=torch.device("cpu"), names=ParamNames.of(model), shards=ShardIndex(), tp_rank=0,
                    tp_size=1, base_seed=0, loaded={"0.weight", "0.bias"})
