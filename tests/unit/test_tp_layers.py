"""Single-process tests of the class-swap helpers and layer geometry in ``lightning_tpp.tensor_parallel.layers``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from lightning_tpp.core.swap import original_class, parallel_class, swap_class
from lightning_tpp.tensor_parallel.layers import (
    _ColumnParallel,
    _ParallelMultiheadAttention,
    _RowParallel,
    _VocabParallelEmbedding,
    is_transposed_linear,
    linear_dims,
)


@pytest.mark.parametrize(("mixin", "base"), [(_ColumnParallel, nn.Linear), (_RowParallel, nn.Linear),
                                             (_RowParallel, Conv1D), (_VocabParallelEmbedding, nn.Embedding),
                                             (_ParallelMultiheadAttention, nn.MultiheadAttention)])
def test_parallel_class(mixin: type, base: type) -> None:
    cls = parallel_class(mixin, base)
    assert issubclass(cls, base) and issubclass(cls, mixin)
    assert cls.__mro__[1] is mixin  # the mixin's methods win
    assert cls.forward is mixin.forward
    assert cls.__module__ == base.__module__
    assert cls.__name__ == f"{mixin.__name__.strip('_')}[{base.__name__}]"
    assert parallel_class(mixin, base) is cls  # cached


def test_swap_keeps_isinstance_and_object() -> None:
    lin = nn.Linear(4, 6)
    weight = lin.weight
    swap_class(lin, _ColumnParallel)
    assert isinstance(lin, nn.Linear)
    assert isinstance(lin, _ColumnParallel)
    assert type(lin) is parallel_class(_ColumnParallel, nn.Linear)
    assert type(lin).__name__ == "ColumnParallel[Linear]"
    assert lin.weight is weight
    assert (lin.in_features, lin.out_features) == (4, 6)
    assert original_class(lin) is nn.Linear


@pytest.mark.parametrize(("make", "mixin"), [(lambda: nn.Linear(4, 6), _ColumnParallel),
                                             (lambda: nn.Linear(4, 6, bias=False), _RowParallel),
                                             (lambda: nn.Embedding(10, 4), _VocabParallelEmbedding),
                                             (lambda: Conv1D(6, 4), _RowParallel),
                                             (lambda: nn.MultiheadAttention(8, 2), _ParallelMultiheadAttention)])
def test_swap_keeps_state_dict(make, mixin: type) -> None:
    module = make()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    swap_class(module, mixin)
    after = module.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert not any(k.startswith("_tpp_") for k in after)
    # parameters keep their names too (optimizers and checkpoints see the same model)
    assert [n for n, _ in module.named_parameters()] == list(dict(make().named_parameters()))


def test_swap_in_a_model_keeps_fqns() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    keys = list(model.state_dict())
    swap_class(model[0], _ColumnParallel)
    swap_class(model[2], _RowParallel)
    assert list(model.state_dict()) == keys
    assert all(isinstance(m, nn.Linear) for m in (model[0], model[2]))
    model.load_state_dict(copy.deepcopy(model.state_dict()))


def test_swap_twice_remembers_original() -> None:
    lin = nn.Linear(4, 4)
    swap_class(lin, _ColumnParallel)
    swap_class(lin, _RowParallel)
    assert original_class(lin) is nn.Linear
    assert type(lin) is parallel_class(_RowParallel, parallel_class(_ColumnParallel, nn.Linear))
    assert isinstance(lin, nn.Linear)


def test_swap_subclass_of_linear() -> None:
    class MyLinear(nn.Linear):
        pass

    lin = MyLinear(3, 5)
    swap_class(lin, _ColumnParallel)
    assert isinstance(lin, MyLinear) and isinstance(lin, nn.Linear)
    assert original_class(lin) is MyLinear


def test_linear_dims_linear() -> None:
    assert linear_dims(nn.Linear(4, 6)) == (4, 6)
    assert linear_dims(nn.Linear(7, 3, bias=False)) == (7, 3)
    assert not is_transposed_linear(nn.Linear(4, 6))


def test_linear_dims_conv1d() -> None:
    conv = Conv1D(6, 4)  # nf = out features, nx = in features; weight is (in, out)
    assert conv.weight.shape == (4, 6)
    assert is_transposed_linear(conv)
    assert linear_dims(conv) == (4, 6)
    x = torch.randn(2, 4)
    assert conv(x).shape == (2, 6)


def test_conv1d_still_transposed_after_swap() -> None:
    conv = Conv1D(6, 4)
    swap_class(conv, _RowParallel)
    assert isinstance(conv, Conv1D)
    assert is_transposed_linear(conv)  # judged by the original class, not the swapped one
    assert linear_dims(conv) == (4, 6)


def test_not_transposed_other_modules() -> None:
    assert not is_transposed_linear(nn.Conv1d(4, 6, 1))
    assert not is_transposed_linear(nn.Embedding(4, 6))
