"""Context parallelism's attention in one process (issue #46): the causal route on CPU (``_CausalJoined``: each chunk's
rows as two kernel calls joined by their log-sum-exps, a backward that recomputes nothing) against one SDPA call on the
whole sequence, and which products of attention written as matmul -> softmax -> matmul are given every key. At cp=1
the layout still cuts the sequence into a head and a tail chunk (the tail chunk's rows read the head chunk's keys:
the joined part), and the gather over one rank is the tensor itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_tpp.context_parallel import attention as cp_attention
from lightning_tpp.context_parallel.attention import ContextAttention, Traffic
from lightning_tpp.context_parallel.split import SeqLayout, pad_to
from lightning_tpp.core.comm import TPGroup


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"kernel": 0, "gather": 0}
    real = cp_attention.attention_with_lse

    def gather(x: torch.Tensor, dim: int, layout: SeqLayout, group: Any, trim: bool = True) -> torch.Tensor:
        calls["gather"] += 1
        return x  # one rank: its part is the whole (padded) sequence, in natural order

    def kernel(*args: Any) -> Any:
        calls["kernel"] += 1
        return real(*args)

    monkeypatch.setattr(cp_attention, "gather_positions", gather)
    monkeypatch.setattr(cp_attention, "attention_with_lse", kernel)
    return calls


@pytest.mark.parametrize("length, heads, kv_heads, dtype", [
    (32, 4, 4, torch.float32),
    (30, 4, 2, torch.float32),  # padded to 32; grouped-query heads (enable_gqa)
    (32, 2, 1, torch.bfloat16),
])
def test_joined_causal_attention_is_one_sdpa_call(one_rank: dict[str, int], length: int, heads: int, kv_heads: int,
                                                  dtype: torch.dtype) -> None:
    layout = SeqLayout.of(length, 1, 0)
    mode = ContextAttention(TPGroup(None, 0, 1), layout, Traffic())
    torch.manual_seed(0)
    q = torch.randn(2, heads, length, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(2, kv_heads, length, 8, dtype=dtype, requires_grad=True)
    v = torch.randn(2, kv_heads, length, 8, dtype=dtype, requires_grad=True)
    grad = torch.randn(2, heads, length, 8, dtype=dtype)
    options = {"scale": 0.3, "enable_gqa": kv_heads != heads}

    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, **options)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)

    local = [pad_to(t, 2, layout.padded, 0) for t in (q, k, v)]  # this rank's positions (its padding appended)
    with mode:
        out = F.scaled_dot_product_attention(*local, is_causal=True, **options)
    assert one_rank["kernel"] == 3 and mode.taken == 1  # the head chunk, the tail chunk's own keys and earlier ones
    assert out.transpose(1, 2).is_contiguous()  # stored as (batch, rows, heads, features): the model's transpose
    grads = torch.autograd.grad(out.narrow(2, 0, length), (q, k, v), grad)
    assert one_rank["kernel"] == 3 and one_rank["gather"] == 4  # backward: no forward again; keys and values gathered

    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.narrow(2, 0, length), ref, **tol)
    for got, want, name in zip(grads, ref_grads, "qkv"):
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"gradient of {name}: {m}")


def test_what_the_joined_route_does_not_take(one_rank: dict[str, int]) -> None:
    """Dropout, a mask or a key width other than the values' run as before (the recomputed route)."""
    layout = SeqLayout.of(16, 1, 0)
    q = torch.randn(1, 2, 16, 8)
    for options in ({"dropout_p": 0.1}, {"attn_mask": torch.ones(16, 16, dtype=torch.bool).tril()}):
        with ContextAttention(TPGroup(None, 0, 1), layout, Traffic()):
            F.scaled_dot_product_attention(q, q, q, is_causal="attn_mask" not in options, **options)
    with ContextAttention(TPGroup(None, 0, 1), layout, Traffic()):
        F.scaled_dot_product_attention(q, q, torch.randn(1, 2, 16, 4), is_causal=True)
    assert one_rank["kernel"] == 0


def test_which_products_are_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention written as matmul -> softmax -> matmul at cp=2 (this rank: 8 of 16 positions): the product of the
    rows with this rank's transposed keys gets every key (contracted over features), the product of rows over every
    key with this rank's values gets every value; a weight, a 2-d factor, or a product over the whole sequence's
    positions already (Hugging Face's eager function on gathered keys) passes through."""
    gathered: list[tuple[tuple[int, ...], int]] = []

    def gather(x: torch.Tensor, dim: int, layout: SeqLayout, group: Any, trim: bool = True) -> torch.Tensor:
        gathered.append((tuple(x.shape), dim))
        return torch.cat([x, x], dim=dim)  # the other rank's part: here a copy (shapes are what is checked)

    monkeypatch.setattr(cp_attention, "gather_positions", gather)
    layout = SeqLayout.of(16, 2, 0)
    q, k, v = (torch.randn(2, 4, 8, 8) for _ in range(3))  # head dim 8 = this rank's positions: told apart anyway
    with ContextAttention(TPGroup(None, 0, 1), layout, Traffic()) as mode:
        scores = q @ k.transpose(-2, -1)
        out = torch.matmul(scores.softmax(-1), v)
        bias = torch.zeros(8, 1, 8)  # baddbmm's added bias with a column per local key: every key's
        assert torch.baddbmm(bias, q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)).shape == (8, 8, 16)
        weight = nn.Parameter(torch.randn(2, 8, 8))
        assert (q.flatten(0, 1)[:2] @ weight).shape == (2, 8, 8)  # a weight
        assert (q[0, 0] @ k[0, 0].T).shape == (8, 8)  # 2-d factors
        whole_k = torch.randn(2, 4, 16, 8)
        probs = (q @ whole_k.transpose(-2, -1)).softmax(-1)  # keys already whole: rows x 16
        assert (probs @ whole_k).shape == (2, 4, 8, 8)  # contracted over the whole sequence's positions
        frequencies, positions = torch.randn(2, 8, 1), torch.arange(8.0).expand(2, 1, 8)  # rotary: 8 = head dim / 2
        assert (frequencies @ positions).shape == (2, 8, 8)  # an outer product (over 1), this rank's positions
    assert scores.shape == (2, 4, 8, 16) and out.shape == (2, 4, 8, 8)
    assert gathered == [((2, 4, 8, 8), -1), ((2, 4, 8, 8), -2), ((8, 1, 8), -1), ((8, 8, 8), -1)]
    assert mode.products == 3
