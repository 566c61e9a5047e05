"""``compile=``'s first-call check of a compiled block against its eager call (issue #48, "checked, not trusted"): the
graph the training steps run is compared, forward and backward, not only an evaluation forward. One process, a
block compiled with ``aot_eager``; a miscompiled backward is stood in for by a graph whose output gradient is halved
on its way back (what a gradient exchange that stopped summing over two ranks gives), its forward unchanged."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_tpp.core.comm import TPGroup
from lightning_tpp.integration.compile_metrics import _DREW, _compare, _trained_difference


class Block(nn.Module):
    def __init__(self, dropout: float = 0.0, norm: type = nn.LayerNorm) -> None:
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(8, 16), nn.Linear(16, 8), norm(8)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        y = self.norm(x) if isinstance(self.norm, nn.LayerNorm) else self.norm(x.flatten(0, 1)).view_as(x)
        return x + self.drop(self.fc2(torch.relu(self.fc1(y))))


class _HalvedBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor) -> Tensor:
        return t.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad * 0.5


def _none(args: tuple, kwargs: dict) -> None:
    return None


def _input() -> Tensor:
    return torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1)).requires_grad_(True)


def test_compiled_training_graph_checked_forward_and_backward() -> None:
    torch.manual_seed(0)
    block = Block().train()
    graph = torch.compile(block._call_impl, backend="aot_eager")
    assert _compare(block, block._call_impl, graph, (_input(),), {}, _none) is None

    def halved(*args, **kwargs):  # the same forward, a backward that lost half of the gradient
        return _HalvedBackward.apply(graph(*args, **kwargs))

    problem = _compare(block, block._call_impl, halved, (_input(),), {}, _none)
    assert problem is not None and problem.startswith("gradient of input 0"), problem
    assert all(p.grad is None for p in block.parameters())  # the check's gradients go nowhere


def test_a_block_that_draws_is_compared_in_eval_mode_and_leaves_the_generator() -> None:
    torch.manual_seed(0)
    block = Block(dropout=0.5).train()
    graph = torch.compile(block._call_impl, backend="aot_eager")
    state = torch.get_rng_state()
    assert _trained_difference(block, block._call_impl, graph, (_input(),), {}, _none) is _DREW
    assert _compare(block, block._call_impl, graph, (_input(),), {}, _none) is None  # eval: no dropout drawn
    assert torch.equal(torch.get_rng_state(), state)
    assert block.training and block.drop.training


def test_running_statistics_kept() -> None:
    torch.manual_seed(0)
    block = Block(norm=nn.BatchNorm1d).train()
    graph = torch.compile(block._call_impl, backend="aot_eager")
    mean, count = block.norm.running_mean.clone(), int(block.norm.num_batches_tracked)
    assert _compare(block, block._call_impl, graph, (_input(),), {}, _none) is None
    assert torch.equal(block.norm.running_mean, mean) and int(block.norm.num_batches_tracked) == count


def test_tolerance_of_values_computed_in_low_precision() -> None:
    """A float32 gradient computed from bf16 products under autocast (the compiled check compares such gradients)
    is compared at bf16's tolerance; plain float32 at 1e-4."""
    from lightning_tpp.core.reference import first_difference

    want = torch.linspace(1, 2, 8)
    got = want * (1 + 3e-3)
    assert first_difference(got, want, TPGroup(None, 0, 1)) is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert first_difference(got, want, TPGroup(None, 0, 1)) is None
