"""Expert tensor parallelism: every expert's intermediate features cut over the tp group, for experts held as 3-D
banks (a list of expert MLPs is cut by the tensor-parallel plan, each expert an MLP).

One bank, tp = 2 (E experts, H model width, I intermediate)::

    tokens (replicated) --f--> up   (E, 2I/2, H)  each rank: its half of every expert's gate and up features
    weights (replicated) -f--> down (E, H, I/2)   each rank: the matching rows
                               output: a partial sum --g--> all-reduced once per MoE layer

``f`` is identity forward / all-reduce backward, ``g`` all-reduce forward / identity backward (Megatron's pair); no
token moves between ranks. The router stays replicated outside the bank: it sees what one process sees, so the model's
routing, its load-balancing loss and any router z-loss are unchanged. A bias added after the rows (gpt-oss's
``down_proj_bias``) is kept whole and enters each rank's partial sum as ``bias / tp``, its gradient unscaled.
The bank is compared with the original (whole weights, same inputs) on its first call.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from lightning_tpp._compat import tree_flatten, tree_map
from lightning_tpp.core.comm import (TPGroup, copy_to_tp, gather_tokens, reduce_from_tp, reduce_scatter_tokens,
                                     tokens_sharded_over)
from lightning_tpp.core.params import ShardIndex, ShardInfo
from lightning_tpp.core.sharding import shard_tensor
from lightning_tpp.core.swap import original_class, set_local_attr, swap_class
from lightning_tpp.core.walk import VERIFYING
from lightning_tpp.core.reference import Mismatch, check_forward
from lightning_tpp.experts.detect import ExpertBank, MoELayer

_WIDTH_NAMES = ("intermediate_dim", "intermediate_size", "moe_intermediate_size", "expert_dim", "ffn_dim")


class ExpertParallelConfigError(ValueError):
    """Experts that cannot be cut as asked."""


@dataclass
class BankState:
    name: str
    bank: ExpertBank
    group: TPGroup
    shards: ShardIndex
    verify_pending: bool


class _Fraction(torch.autograd.Function):
    """``x / n`` forward, the gradient unscaled: a whole parameter added into each rank's partial sum."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, n: int) -> Tensor:
        return x / n

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


@contextlib.contextmanager
def _fractions(module: nn.Module, names: list[str], n: int) -> Iterator[None]:
    saved = {k: module._parameters[k] for k in names}
    try:
        for k, p in saved.items():
            module._parameters[k] = _Fraction.apply(p, n)  # type: ignore[assignment]
        yield
    finally:
        module._parameters.update(saved)


def _each_float(value: Any, fn: Any) -> Any:
    if isinstance(value, Tensor):
        return fn(value) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_each_float(v, fn) for v in value)
    return value


def _first(out: Any, fn: Any) -> Any:
    """``fn`` on the bank's output (the first element of a tuple: the rest are extras)."""
    return fn(out) if isinstance(out, Tensor) else type(out)((fn(out[0]), *out[1:]))


def _reduced(out: Any, group: TPGroup) -> Any:
    """The bank's output summed over the ranks."""
    return _first(out, lambda t: reduce_from_tp(t, group))


def _tokens(args: tuple, kwargs: dict, fn: Any, group: TPGroup) -> tuple[tuple, dict]:
    """The bank's inputs that hold one row per token (hidden states, routing indices and weights) gathered over
    ``group`` by ``fn``; the others as they are. A bank inside a block run on sequence shards holds a part of every
    expert's features, so it runs on every rank's tokens and reduce-scatters its partial sums back."""
    rows = next((t.shape[0] for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and t.dim() >= 1), None)
    g = lambda t: fn(t, group) if isinstance(t, Tensor) and t.dim() >= 1 and t.shape[0] == rows else t  # noqa: E731
    return tuple(tree_map(g, a) for a in args), {k: tree_map(g, v) for k, v in kwargs.items()}


class _TPExperts:
    """Mixin for a bank module (see the module docstring)."""

    _tpp_experts: BankState

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        st = self._tpp_experts
        if st.verify_pending and not VERIFYING.get():
            st.verify_pending = False
            verify_bank(self, args, kwargs)  # type: ignore[arg-type]
        return self._parallel_forward(args, kwargs)

    def _parallel_forward(self, args: tuple, kwargs: dict) -> Any:
        st = self._tpp_experts
        sharded = tokens_sharded_over()
        if sharded is not None and sharded.group is st.group.group:  # sequence parallelism: every rank's tokens
            out = self._local_forward(*_tokens(args, kwargs, gather_tokens, st.group))
            return _first(out, lambda t: reduce_scatter_tokens(t, st.group))
        f = lambda t: copy_to_tp(t, st.group)  # noqa: E731
        out = self._local_forward(_each_float(args, f), {k: _each_float(v, f) for k, v in kwargs.items()})
        return _reduced(out, st.group)

    def _local_forward(self, args: tuple, kwargs: dict) -> Any:
        st = self._tpp_experts
        with _fractions(self, st.bank.down_biases, st.group.size):  # type: ignore[arg-type]
            return super().forward(*args, **kwargs)  # type: ignore[misc]


def shard_banks(model: nn.Module, layers: list[MoELayer], group: TPGroup, shards: ShardIndex, *,
                verify: bool = True) -> list[str]:
    """Cut every bank of ``layers`` over ``group`` in place (parameters recorded in ``shards``); returns their names."""
    modules = dict(model.named_modules())
    done = []
    for layer in layers:
        if layer.kind != "bank" or layer.bank is None:
            continue
        module, bank = modules[layer.experts], layer.bank
        for attr, spec in bank.specs().items():
            old = module._parameters[attr]
            assert old is not None
            try:
                spec.check(old.shape[spec.dim], group.size, f"{layer.experts}.{attr}")
            except ValueError as err:
                raise ExpertParallelConfigError(
                    f"tp={group.size} must divide the intermediate width {bank.intermediate} of every expert of "
                    f"{layer.experts} ({err}); choose another tp, or keep the experts whole with "
                    f"tp_plan={{'{layer.experts}': 'replicate'}}") from None
            new = nn.Parameter(shard_tensor(old.data, spec, group.rank, group.size), requires_grad=old.requires_grad)
            shards.add(new, ShardInfo(spec, tuple(old.shape)))
            module._parameters[attr] = new
        for name, value in list(vars(module).items()):
            if name in _WIDTH_NAMES and value == bank.intermediate:
                set_local_attr(module, name, value // group.size)
        module._tpp_experts = BankState(layer.experts, bank, group, shards, verify)
        swap_class(module, _TPExperts)
        done.append(layer.experts)
    return done


def verify_bank(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """The bank's output on this call's inputs against the original class with whole weights."""
    st: BankState = module._tpp_experts  # type: ignore[assignment]
    check_forward(module, args, kwargs, group=st.group, shards=st.shards,
                  parallel=module._parallel_forward,  # type: ignore[arg-type]
                  mismatch=Mismatch("expert tensor parallelism of", st.name, original_class(module).__name__,
                                    f"Its forward probably does something the bank layout (up {st.bank.up}, down "
                                    f"{st.bank.down}, transposed={st.bank.transposed}) does not model"))
