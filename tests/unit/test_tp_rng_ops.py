"""The operators that draw dropout over tensor-parallel shards inside a compiled graph (``tensor_parallel.rng``): the
numbers the eager draw gets from the same seed, forward and backward, and a block followed by ``ShardedDraws``
compiles without a graph break."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_tpp.core.seeding import OwnStream, seeded
from lightning_tpp.tensor_parallel import rng


def _key(seed: int = 1234) -> torch.Tensor:
    return torch.tensor(seed, dtype=torch.int64)


@pytest.mark.parametrize("func", [F.dropout, F.dropout2d, torch.dropout], ids=["dropout", "dropout2d", "torch"])
def test_noise_is_what_the_eager_draw_multiplies_by(func) -> None:
    x = torch.randn(3, 4, 5, 6)
    with seeded(rng._draw_seed(_key(), 2, 1), x.device):
        want = func(x, 0.3, True)
    noise = torch.ops.lightning_tpp.sharded_noise(x, _key(), 2, 1, rng._NOISE_OF[func], 0.3)
    assert torch.equal(x * noise, want)
    other = torch.ops.lightning_tpp.sharded_noise(x, _key(), 2, 0, rng._NOISE_OF[func], 0.3)  # another tp rank
    assert not torch.equal(other, noise)


@pytest.mark.parametrize("mask", [None, "bias"], ids=["causal", "learned_bias"])
def test_attention_operator_equals_seeded_sdpa_forward_and_backward(mask) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, requires_grad=True) for _ in range(3))
    bias = torch.randn(4, 6, 6, requires_grad=True) if mask else None
    seed = rng._draw_seed(_key(), 1, 0)
    grad = torch.randn(2, 4, 6, 8)

    with seeded(seed, q.device):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.4, is_causal=mask is None,
                                              scale=0.3)
    leaves = [q, k, v] + ([bias] if mask else [])
    want_grads = torch.autograd.grad(want, leaves, grad)
    got = torch.ops.lightning_tpp.sharded_attention(q, k, v, bias, 0.4, mask is None, 0.3, False, _key(), 1, 0)
    got_grads = torch.autograd.grad(got, leaves, grad)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


class _Block(torch.nn.Module):
    """A column output marked sharded, dropped (per rank), a row-like product, dropped again (replicated)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.stream = OwnStream(seed=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with rng.following(0, self.stream, "block"):
            h = self.up(x)
            rng.mark_sharded(h)
            h = F.dropout(F.gelu(h), 0.5, True)
            y = self.down(h)
            rng.mark_replicated(y)
            return F.dropout(y, 0.2, True)


def test_followed_block_compiles_whole_and_draws_the_eager_masks() -> None:
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    block = _Block()
    compiled = torch.compile(block, backend="aot_eager")
    x = torch.randn(4, 8)
    for step in range(3):
        block.stream.start_step(step)
        torch.manual_seed(step)
        want = block(x)
        block.stream.start_step(step)  # the same call again: the same key (a new step's counts)
        torch.manual_seed(step)
        got = compiled(x)
        assert torch.equal(got, want), step
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
