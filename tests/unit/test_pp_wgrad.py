"""Unit tests of ``lightning_tpp.pipeline.wgrad``: weight gradients filed by the backward and computed later equal
autograd's, for every product it takes over, and nothing else changes."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_tpp.pipeline.wgrad import DeferWeightGrads, WeightGrads


class Conv1D(nn.Module):
    """Hugging Face GPT-2's transposed linear: ``addmm`` with a (in, out) weight."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


class Mixed(nn.Module):
    """Every product kind, a weight tied to an embedding, a norm, and a bias that is not a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.up = nn.Linear(8, 16)
        self.conv = Conv1D(16, 8)
        self.rot = nn.Parameter(torch.randn(8, 8) * 0.1)
        self.norm = nn.LayerNorm(8)
        self.gate = nn.Linear(8, 8, bias=False)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = self.conv(F.gelu(self.up(h)))
        h = self.norm(h @ self.rot)
        h = F.linear(h, self.gate.weight, self.scale * 0.5)  # a bias computed from a parameter: left to autograd
        return F.linear(h, self.emb.weight)  # tied head: the embedding's weight, deferred here, direct in emb


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("steps", [1, 3])  # several micro-batches accumulate into the same .grad
def test_filed_weight_gradients_equal_autograd(steps):
    torch.manual_seed(0)
    ref = Mixed()
    model = copy.deepcopy(ref)
    for step in range(steps):
        ids = torch.randint(0, 11, (3, 5))
        ref(ids).pow(2).sum().backward()
        filed = WeightGrads()
        with DeferWeightGrads(filed):
            out = model(ids).pow(2).sum()
        out.backward()
        assert len(filed) == 4  # up, conv, rot, tied head (gate's bias needs a gradient of its own: not filed)
        if step == 0:  # before W, only what is not a weight matrix has its gradient
            assert set(_grads(model)) == {"emb.weight", "norm.weight", "norm.bias", "scale", "gate.weight"}
        filed.run()
        assert not filed
    got, want = _grads(model), _grads(ref)
    assert set(got) == set(want)
    for name, p in model.named_parameters():  # plain values: no autograd history kept from one step to the next
        assert p.grad.grad_fn is None and not p.grad.requires_grad, name
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_input_gradients_are_complete_before_w():
    """What ``I`` sends upstream must not wait for ``W``: the input's gradient is final when backward returns."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    x = torch.randn(2, 3, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    copy.deepcopy(lin)(x_ref).sum().backward()
    filed = WeightGrads()
    with DeferWeightGrads(filed):
        y = lin(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert lin.weight.grad is None and len(filed) == 1


def test_filed_operands_are_released():
    """Nothing of a micro-batch outlives its W: no reference cycle from the autograd graph to the filed list."""
    lin = nn.Linear(8, 8)
    filed = WeightGrads()
    with DeferWeightGrads(filed):
        h = lin(torch.randn(2, 8, requires_grad=True))
        y = lin(h)
    alive = weakref.ref(h)
    loss = y.sum()
    del h, y
    loss.backward()
    del loss
    assert alive() is not None  # W still needs the product's input
    filed.run()
    assert alive() is None


def test_a_lost_list_computes_weight_gradients_at_once():
    """If a step is abandoned before W (its list dropped), a later backward of the graph does not lose them."""
    lin = nn.Linear(4, 4)
    filed = WeightGrads()
    with DeferWeightGrads(filed):
        y = lin(torch.randn(3, 4))
    del filed
    y.sum().backward()
    assert lin.weight.grad is not None and lin.bias.grad is not None


def test_autocast_products_match_autograd():
    torch.manual_seed(0)
    ref = Mixed()
    model = copy.deepcopy(ref)
    ids = torch.randint(0, 11, (3, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(ids)
        filed = WeightGrads()
        with DeferWeightGrads(filed):
            got = model(ids)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    want.float().pow(2).sum().backward()
    got.float().pow(2).sum().backward()
    filed.run()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert q.grad.dtype == torch.float32, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_what_is_not_a_weight_product_runs_unchanged():
    """No grad mode, a product with a plain tensor, a weight on the left, keyword forms autograd would not see
    differently: none is filed."""
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    filed = WeightGrads()
    with DeferWeightGrads(filed):
        with torch.no_grad():
            F.linear(x, w)
        y = (w @ x.t()).sum() + (x @ w.detach()).sum() + torch.addmm(torch.zeros(2, 4), x, w, beta=0.5).sum()
    y.backward()
    assert not filed and w.grad is not None
