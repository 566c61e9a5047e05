"""core.token_mean in one process: what a mean-reduced loss divides by, and micro-batches combined by their counts
equal to the whole batch's mean, for every form of cross-entropy / NLL a user writes."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_tpp.core.token_mean import Counts, TokenMean, TokenWarnings, _bound, check_normalization, \
    count_tokens, counted

V = 7


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 5, V, generator=g, requires_grad=True)
    target = torch.randint(0, V, (4, 5), generator=g)
    target[0, :4] = -100  # samples count 1, 3, 5 and 0 targets
    target[1, 1:3] = -100
    target[3] = -100
    return logits, target


LOSSES = {
    "ignore_index": lambda x, t: F.cross_entropy(x.reshape(-1, V), t.reshape(-1)),
    "weight": lambda x, t: F.cross_entropy(x.reshape(-1, V), t.reshape(-1), weight=torch.linspace(0.5, 2, V)),
    "smoothing": lambda x, t: F.cross_entropy(x.reshape(-1, V), t.reshape(-1), label_smoothing=0.1,
                                              weight=torch.linspace(0.5, 2, V)),
    "k_dim": lambda x, t: F.cross_entropy(x.transpose(1, 2), t),  # (N, C, T) with (N, T)
    "other_ignore": lambda x, t: F.cross_entropy(x.reshape(-1, V), t.reshape(-1).clamp(min=0), ignore_index=3),
    "nll": lambda x, t: F.nll_loss(F.log_softmax(x, -1).reshape(-1, V), t.reshape(-1)),
    "module": lambda x, t: nn.CrossEntropyLoss()(x.reshape(-1, V), t.reshape(-1)),
    "probabilities": lambda x, t: F.cross_entropy(x.reshape(-1, V), F.softmax(x.detach().reshape(-1, V) * 2, -1)),
}


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_microbatches_combine_to_the_batch_mean(kind: str) -> None:
    """Counted on each micro-batch, then each call returns sum / (total * share): the shares' weighted sum is the
    whole batch's loss, and so are the gradients (a micro-batch with no counted target included)."""
    loss_fn = LOSSES[kind]
    logits, target = _batch()
    whole = loss_fn(logits, target)
    (grad_whole,) = torch.autograd.grad(whole, logits)
    parts = [(logits[i:i + 1], target[i:i + 1]) for i in range(4)]
    shares = [0.25] * 4
    counts = count_tokens(lambda i: loss_fn(*parts[i]), len(parts))
    assert len(counts.means) == 4 and all(len(m) == 1 for m in counts.means)
    mismatches: list[str] = []
    total = torch.zeros(())
    for i, (x, t) in enumerate(parts):
        with TokenMean(counts.totals(), counts.means[i], shares[i], mismatches.append):
            total = total + shares[i] * loss_fn(x, t)
    (grad,) = torch.autograd.grad(total, logits)
    assert not mismatches
    torch.testing.assert_close(total, whole, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, grad_whole, rtol=1e-6, atol=1e-7)
    if kind == "ignore_index":  # the mean of micro-batch means is another number (one is NaN: nothing counted)
        plain = [loss_fn(x, t) for x, t in parts]
        assert torch.isnan(plain[3]) and not torch.isclose(sum(plain[:3]) / 3, whole)


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_counted_is_what_mean_divides_by(kind: str) -> None:
    """torch's own mean is the summed loss over the count (the count pass computes no loss: it returns a zero)."""
    logits, target = _batch(1)
    with torch.no_grad():
        mean = LOSSES[kind](logits, target)
        counts = count_tokens(lambda i: LOSSES[kind](logits, target), 1).means[0]
        summed = _Summed()
        with summed:
            total = LOSSES[kind](logits, target)
    assert len(counts) == 1 and counts[0] > 0
    torch.testing.assert_close(total / counts[0], mean)
    if kind == "ignore_index":
        assert counts == [float((target != -100).sum())]


class _Summed(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in (F.cross_entropy, F.nll_loss):
            kwargs = {**kwargs, "reduction": "sum"}
        return func(*args, **kwargs)


def test_a_call_the_count_did_not_see_keeps_its_mean() -> None:
    logits, target = _batch()
    said: list[str] = []
    with TokenMean([4.0], [4.0], 0.5, said.append):
        F.cross_entropy(logits[0], target[0])  # counts 1, not 4
        second = F.cross_entropy(logits[1], target[1])
    assert "counts 1 targets, 4 when counted" in said[0] and "call 1 of the step was not seen" in said[1]
    torch.testing.assert_close(second, F.cross_entropy(logits[1], target[1]))


def test_reductions_left_as_they_are() -> None:
    """'none' and 'sum' are the user's to reduce; legacy size_average/reduce are not read."""
    logits, target = _batch()
    with TokenMean([1.0], [1.0], 0.5, lambda s: None):
        none = F.cross_entropy(logits[0], target[0], reduction="none")
        total = F.cross_entropy(logits[0], target[0], reduction="sum")
    torch.testing.assert_close(none, F.cross_entropy(logits[0], target[0], reduction="none"))
    torch.testing.assert_close(total, F.cross_entropy(logits[0], target[0], reduction="sum"))
    assert _bound(F.cross_entropy, (logits[0], target[0]), {"size_average": False}) is None


def test_own_reduction_warned_when_counts_are_uneven() -> None:
    logits, target = _batch()

    def own_mean(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        rows = F.cross_entropy(x.reshape(-1, V), t.reshape(-1), reduction="none")
        return rows.sum() / (t != -100).sum().clamp(min=1)

    uneven = count_tokens(lambda i: own_mean(logits[i:i + 1], target[i:i + 1]), 4)
    even = count_tokens(lambda i: own_mean(logits[i:i + 1], target[i:i + 1].clamp(min=0)), 4)
    with pytest.warns(UserWarning, match=r"count \[1.0, 3.0, 5.0, 0.0\] targets .*reduction='mean'"):
        TokenWarnings().first_step(uneven, [0.25] * 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TokenWarnings().first_step(even, [0.25] * 4)
    assert Counts(own=[[2.0], [4.0]]).uneven_own([1 / 3, 2 / 3]) is False


def test_normalization_values() -> None:
    assert check_normalization("global") == "global"
    with pytest.raises(ValueError, match="loss_normalization='tokens' must be one of 'batch', 'global'"):
        check_normalization("tokens")


def test_a_step_that_fails_on_stand_ins_is_said_once() -> None:
    said = TokenWarnings()
    with pytest.warns(UserWarning, match=r"training_step could not be run on stand-ins to count its tokens "
                                         r"\(RuntimeError: boom\); .*weighted by its share"):
        said.uncounted("training_step", RuntimeError("boom"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        said.uncounted("training_step", RuntimeError("again"))
