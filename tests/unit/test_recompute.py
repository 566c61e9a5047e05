"""Activation checkpointing per block (core.recompute) in one process: blocks really run again in backward and keep
fewer tensors, gradients do not change (dropout included), names stay the single-device names, a zero-bubble
forward's weight products are replayed, state the forward changes in its arguments is changed once."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import CheckpointError

from lightning_tpp import TensorPipeStrategy
from lightning_tpp.core.recompute import is_recomputed, recompute_blocks
from lightning_tpp.pipeline.executor import Executor, _MicroBatch
from lightning_tpp.pipeline.partition import block_modules, block_sequence
from lightning_tpp.pipeline.wgrad import DeferWeightGrads, WeightGrads
from models import NanoGPT, token_dataset

BLOCKS = ["transformer.h.0", "transformer.h.1"]


def _pair(dropout: float = 0.0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = NanoGPT()
    for block in plain.transformer.h:
        block.mlp.gelu = nn.Sequential(nn.GELU(), nn.Dropout(dropout))
    recomputed = copy.deepcopy(plain)
    recompute_blocks(recomputed, BLOCKS)
    return plain, recomputed


def _loss(model: nn.Module, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return model(x).pow(2).mean()


def _assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    for (name, p), (name_b, q) in zip(a.named_parameters(), b.named_parameters()):
        assert name == name_b
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_blocks_run_again_in_backward_with_the_same_gradients() -> None:
    plain, recomputed = _pair()
    calls: dict[str, list[bool]] = {"plain": [], "recomputed": []}
    for key, model in (("plain", plain), ("recomputed", recomputed)):
        for block in model.transformer.h:
            block.attn.register_forward_hook(lambda m, a, o, key=key: calls[key].append(torch.is_grad_enabled()))
        loss = _loss(model)
        forward_calls = len(calls[key])
        loss.backward()
        calls[key].append(forward_calls)  # type: ignore[arg-type]
    assert calls["plain"][-1] == 2 and len(calls["plain"]) == 3  # no call during backward
    assert calls["recomputed"][-1] == 2 and len(calls["recomputed"]) == 5  # each block's attention once more
    _assert_same_grads(plain, recomputed)
    assert [n for n, _ in recomputed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(recomputed.state_dict()) == list(plain.state_dict())
    assert type(recomputed.transformer.h[0]).__name__ == "Recomputed[Block]"
    assert is_recomputed(recomputed.transformer.h[1]) and not is_recomputed(plain.transformer.h[1])


def _saved_bytes(model: nn.Module) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _loss(model)
    loss.backward()
    return total


def test_blocks_keep_fewer_tensors_for_backward() -> None:
    plain, recomputed = _pair()
    kept, kept_recomputed = _saved_bytes(plain), _saved_bytes(recomputed)
    assert kept_recomputed < 0.5 * kept, (kept_recomputed, kept)


def test_dropout_is_the_same_when_recomputed() -> None:
    plain, recomputed = _pair(dropout=0.5)
    _loss(plain).backward()
    _loss(recomputed).backward()
    _assert_same_grads(plain, recomputed)


def test_no_recomputation_without_gradients() -> None:
    _, recomputed = _pair()
    calls = []
    recomputed.transformer.h[0].attn.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        _loss(recomputed)
    assert calls == [1]


def test_zero_bubble_forward_replays_weight_products_on_recompute() -> None:
    """The executor's split-backward forward: products file their weight gradients; the recomputed block must save
    what they saved (without the replay, torch's checkpoint finds other tensors and refuses)."""
    plain, recomputed = _pair()
    _loss(plain).backward()
    state = _MicroBatch()
    with Executor._split_backward(state):
        loss = _loss(recomputed)
    loss.backward()
    assert state.weight_grads, "no weight gradient was filed for W"
    assert recomputed.transformer.h[0].attn.c_attn.weight.grad is None  # waits for W
    state.weight_grads.run()
    _assert_same_grads(plain, recomputed)

    _, unreplayed = _pair()
    with DeferWeightGrads(WeightGrads()):
        loss = _loss(unreplayed)
    with pytest.raises(CheckpointError):
        loss.backward()


class _Cache:
    """A KV cache as Hugging Face layers use it: the forward appends to it and reads what it holds."""

    def __init__(self) -> None:
        self.items: list[torch.Tensor] = []


class _CachingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: _Cache) -> torch.Tensor:
        cache.items.append(x)
        return torch.tanh(self.lin(x)) * len(cache.items)


def test_state_in_the_arguments_is_changed_once() -> None:
    torch.manual_seed(0)
    plain = nn.ModuleList([_CachingBlock(), _CachingBlock()])
    recomputed = copy.deepcopy(plain)
    recompute_blocks(recomputed, ["0", "1"])
    x = torch.randn(3, 4, requires_grad=True)
    for model in (plain, recomputed):
        cache = _Cache()
        y = x
        for block in model:
            y = block(y, cache)
        y.sum().backward()
        assert len(cache.items) == 2
    _assert_same_grads(plain, recomputed)


def test_block_modules_of_a_model_and_of_lists_unpacked_by_the_forward() -> None:
    gpt = NanoGPT()
    assert block_modules(gpt, block_sequence(gpt, ordered=False).members) == BLOCKS
    model = nn.Module()
    model.layers = nn.ModuleList([nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]) for _ in range(2)])
    assert block_modules(model, block_sequence(model, ordered=False).members) == [
        "layers.0.0", "layers.0.1", "layers.1.0", "layers.1.1"]


class _Flat(L.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture
def process_group() -> Any:
    """The strategy starts a one-rank process group; other unit tests expect none (test_compat checks so)."""
    existed = dist.is_initialized()
    yield
    if dist.is_initialized() and not existed:
        dist.destroy_process_group()


def _fit(module: L.LightningModule, **kwargs: Any) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=TensorPipeStrategy(**kwargs), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(token_dataset(4), batch_size=2))
    return trainer


def test_strategy_recomputes_the_blocks_in_one_process(process_group: None) -> None:
    module = _Flat(NanoGPT())
    trainer = _fit(module, activation_checkpointing=True, print_plan=False)
    assert trainer.strategy.parallel_state.recomputed == tuple(f"model.{b}" for b in BLOCKS)
    assert all(is_recomputed(b) for b in module.model.transformer.h)
    with pytest.raises(ValueError, match="activation_checkpointing: True .then. vs False .now."):
        _fit(module, activation_checkpointing=False)


def test_strategy_refuses_a_model_without_blocks(process_group: None) -> None:
    module = _Flat(nn.Sequential(nn.Embedding(64, 8)))
    with pytest.raises(ValueError, match="activation_checkpointing=True recomputes each block.*none was found.*"
                                         "blocks='<module name>'"):
        _fit(module, activation_checkpointing=True, print_plan=False)


def test_strategy_argument_is_a_bool() -> None:
    with pytest.raises(TypeError, match="activation_checkpointing='yes' must be True or False"):
        TensorPipeStrategy(activation_checkpointing="yes")  # type: ignore[arg-type]
