"""Loss parallelism (``tensor_parallel.loss``): the cross-entropy computed from vocabulary shards equals torch's on
whole logits, and shape operations keep the link to the shard. On a one-rank gloo group; two tp ranks are emulated
as the two halves of the vocabulary, each reduction adding the other half's piece (the tp2 parity tests run it on
real ranks)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_tpp.core.comm import TPGroup
from lightning_tpp.core import vocab_cut
from lightning_tpp.core.vocab_cut import Cut, VocabCut
from lightning_tpp.tensor_parallel.loss import VocabShardedLogits


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}", rank=0,
                            world_size=1)
    yield TPGroup(dist.group.WORLD, 0, 1)
    dist.destroy_process_group()


@pytest.mark.parametrize("kwargs", [{}, {"reduction": "sum"}, {"reduction": "none"}, {"ignore_index": 3},
                                    {"label_smoothing": 0.1}], ids=["mean", "sum", "none", "ignore", "smoothing"])
def test_cross_entropy_from_shards_equals_torch(group: TPGroup, kwargs: dict) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 10, requires_grad=True)
    target = torch.tensor([0, 3, 7, 9, 3, 5])
    expected = F.cross_entropy(logits, target, **kwargs)
    expected.sum().backward()
    # single-process group: the shard is the whole vocabulary (start 0)
    leaf = logits.detach().clone().requires_grad_()
    got = F.cross_entropy(VocabShardedLogits.wrap(logits.detach(), leaf, group, 0), target, **kwargs)
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, expected)
    got.sum().backward()
    torch.testing.assert_close(leaf.grad, logits.grad)


def test_two_vocabulary_halves_give_torch_values(group: TPGroup) -> None:
    """The all-reduced pieces (max, sum of exponentials, target logit, mean logit) from two halves, exchanged by
    hand, give torch's loss and each half of its gradient."""
    torch.manual_seed(1)
    logits = torch.randn(5, 8, requires_grad=True)
    target = torch.tensor([1, 6, 4, 7, 0])
    kwargs = dict(label_smoothing=0.05)
    expected = F.cross_entropy(logits, target, **kwargs)
    expected.backward()
    halves = logits.detach().chunk(2, dim=-1)
    # each rank's local pieces, then the exchanged (reduced) ones: run the function pairwise, step by step
    pieces = {0: [], 1: []}
    for rank in (0, 1):
        def record(t, group, op=dist.ReduceOp.SUM, rank=rank):
            pieces[rank].append((t.clone(), op))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(vocab_cut, "_reduce", record)
            leaf = halves[rank].clone().requires_grad_()
            F.cross_entropy(VocabShardedLogits.wrap(logits.detach(), leaf, group, rank * 4), target, **kwargs)
    assert [op for _, op in pieces[0]] == [dist.ReduceOp.MAX, dist.ReduceOp.SUM, dist.ReduceOp.SUM,
                                           dist.ReduceOp.SUM]
    # second pass: each reduction returns the combination of both ranks' first-pass pieces, in order. The first
    # piece (the max) changes what follows, so the pieces after it are recomputed with the global max.
    global_max = torch.maximum(pieces[0][0][0], pieces[1][0][0])
    losses, grads = [], []
    for rank in (0, 1):
        exchanged = iter([global_max])
        def reduce(t, group, op=dist.ReduceOp.SUM, rank=rank):
            value = next(exchanged, None)
            if value is not None:
                t.copy_(value)
                return
            # after the max: recompute the other half's piece with the same global max
            other = halves[1 - rank] - global_max.unsqueeze(-1)
            start = (1 - rank) * 4
            n = reduce.calls = getattr(reduce, "calls", 0) + 1
            if n == 1:  # target logit
                own = (target >= start) & (target < start + 4)
                t.add_(other.gather(-1, (target - start).clamp(0, 3).unsqueeze(-1)).squeeze(-1) * own)
            elif n == 2:  # mean logit (label smoothing)
                t.add_(other.sum(-1) / 8)
            else:  # sum of exponentials
                t.add_(other.exp().sum(-1))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(vocab_cut, "_reduce", reduce)
            leaf = halves[rank].clone().requires_grad_()
            loss = F.cross_entropy(VocabShardedLogits.wrap(logits.detach(), leaf, group, rank * 4), target, **kwargs)
            loss.backward()
            losses.append(loss)
            grads.append(leaf.grad)
    for loss in losses:
        torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(torch.cat(grads, dim=-1), logits.grad)


def test_shape_operations_keep_the_shard(group: TPGroup) -> None:
    """What Hugging Face's loss and a training_step do to logits before F.cross_entropy: float(), slicing the
    sequence, contiguous(), view(-1, V); other operations see (and return) whole plain logits."""
    whole = torch.randn(2, 5, 6)
    local = whole.clone().requires_grad_()
    x = VocabShardedLogits.wrap(whole, local, group, 0)
    shifted = x.float()[..., :-1, :].contiguous().view(-1, 6)
    assert isinstance(shifted, VocabShardedLogits) and shifted._tpp_local.shape == (8, 6)
    assert isinstance(x[:, 1:], VocabShardedLogits)
    assert not isinstance(x[..., :3], VocabShardedLogits)  # the vocabulary cut: whole values, no shard
    assert type(x.argmax(-1)) is torch.Tensor and torch.equal(x.argmax(-1), whole.argmax(-1))
    assert type(x.softmax(-1)) is torch.Tensor
    target = torch.randint(0, 6, (8,))
    F.cross_entropy(shifted, target).backward()
    assert local.grad is not None and local.grad[:, -1].abs().sum() == 0  # the dropped position has no gradient
    # fall back to the whole logits: class weights, probabilities as targets
    plain = torch.randn(3, 6)
    w = VocabShardedLogits.wrap(plain, plain.clone(), group, 0)
    torch.testing.assert_close(F.cross_entropy(w, torch.tensor([0, 1, 2]), weight=torch.ones(6)),
                               F.cross_entropy(plain, torch.tensor([0, 1, 2]), weight=torch.ones(6)))
    probs = torch.softmax(torch.randn(3, 6), -1)
    torch.testing.assert_close(F.cross_entropy(w, probs), F.cross_entropy(plain, probs))


def test_saved_logits_are_plain_tensors(group: TPGroup, tmp_path) -> None:
    """A prediction returned by the head (``trainer.predict``) can be saved: the process group stays behind."""
    whole = torch.randn(2, 3, 6)
    x = VocabShardedLogits.wrap(whole, whole.clone(), group, 0)
    torch.save({"pred": x}, tmp_path / "p.pt")
    back = torch.load(tmp_path / "p.pt", weights_only=True)["pred"]
    assert type(back) is torch.Tensor and torch.equal(back, whole)


def _cut(local: torch.Tensor, group: TPGroup) -> VocabCut:
    """A one-rank cut (this rank holds every column): what it computes must equal the plain tensor's."""
    return VocabCut(local, local.shape, Cut(((group, (local.shape[-1],)),), 0), "lm_head")


def test_vocab_cut_keeps_its_columns_through_a_loss(group: TPGroup) -> None:
    """Context parallelism's head output (``core.vocab_cut``): what Hugging Face's ForCausalLMLoss and a
    training_step do to logits keeps the cut, the loss and the gradient equal the plain tensor's, and no whole
    logits are made (the wrapper holds no values of its own)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from lightning_tpp.core import vocab_cut as vc

    vc._WARNED.clear()
    torch.manual_seed(2)
    plain = torch.randn(2, 7, 12, requires_grad=True)
    local = plain.detach().clone().requires_grad_()
    labels = torch.randint(0, 12, (2, 7))
    labels[0, 3] = -100
    cut = _cut(local, group)
    assert cut.shape == (2, 7, 12) and cut.size(-1) == 12 and cut.dtype == torch.float32 and cut.requires_grad
    shifted = cut.float()[..., :-1, :].contiguous().view(-1, cut.size(-1))
    assert isinstance(shifted, VocabCut) and shifted._tpp_local.shape == (12, 12)
    assert isinstance(cut.detach(), VocabCut) and isinstance(torch.tanh(cut / 30.0) * 30.0, VocabCut)  # Gemma's cap
    for make in (lambda x: ForCausalLMLoss(x, labels, 12),
                 lambda x: F.cross_entropy(x[:, :-1].reshape(-1, 12), labels[:, 1:].reshape(-1), reduction="sum"),
                 lambda x: F.cross_entropy(torch.tanh(x / 3.0).mul(3.0).flatten(0, 1), labels.flatten(),
                                           label_smoothing=0.1)):
        plain.grad = local.grad = None
        expected = make(plain)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a gather of the whole logits warns: none here
            got = make(cut)
        assert type(got) is torch.Tensor
        torch.testing.assert_close(got, expected)
        expected.backward()
        got.backward()
        torch.testing.assert_close(local.grad, plain.grad)


def test_vocab_cut_gathers_for_other_uses_and_says_so(group: TPGroup, tmp_path) -> None:
    """argmax, softmax, printing, saving: the whole logits (gathered; a warning names the operation once), with
    gradients into this rank's columns; FSDP2's pre-backward hook on a unit's output reaches the columns."""
    from lightning_tpp.core import vocab_cut as vc

    vc._WARNED.clear()
    plain = torch.randn(3, 5, requires_grad=True)
    local = plain.detach().clone().requires_grad_()
    cut = _cut(local, group)
    with pytest.warns(UserWarning, match="gathered whole on every cp rank for softmax"):
        probs = cut.softmax(-1)
    assert type(probs) is torch.Tensor
    torch.testing.assert_close(probs, plain.softmax(-1))
    (probs[:, 0].sum()).backward()
    plain.softmax(-1)[:, 0].sum().backward()
    torch.testing.assert_close(local.grad, plain.grad)
    assert torch.equal(cut.argmax(-1), plain.argmax(-1))
    fired = []
    cut.register_hook(lambda g: fired.append(g.shape))
    F.cross_entropy(cut, torch.tensor([0, 1, 4])).backward()
    assert fired == [(3, 5)]
    torch.save({"pred": cut}, tmp_path / "p.pt")
    back = torch.load(tmp_path / "p.pt", weights_only=True)["pred"]
    assert type(back) is torch.Tensor and torch.equal(back, plain.detach())
    assert "VocabCut(shape=(3, 5)" in repr(cut)
    moved = cut.to("meta")  # another device: leaving the step (predictions to the CPU), whole there
    assert type(moved) is torch.Tensor and moved.shape == (3, 5)
