"""Expert parallelism's pure parts, in one process: which ranks form an ep group and which hold the same experts,
and the clear errors for what it cannot split (the token exchange itself runs in tests/distributed/test_moe_ep.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_tpp.core.comm import TPGroup
from lightning_tpp.core.params import ShardIndex
from lightning_tpp.experts import ExpertParallelConfigError, find_experts
from lightning_tpp.experts.expert_parallel import check_ep, ep_grid, split_experts
from models import MODELS
from test_experts import Routed, TitanExperts


def _grid(dp: int, pp: int, tp: int, ep: int) -> list:
    return ep_grid(torch.arange(dp * pp * tp).view(dp, pp, tp), ep).tolist()


def test_ep_groups_are_drawn_from_dp_and_tp_of_one_stage() -> None:
    assert _grid(dp=2, pp=1, tp=2, ep=2) == [[[0, 1], [2, 3]]]  # the tp pairs; replicas 0+2, 1+3
    assert _grid(dp=2, pp=1, tp=2, ep=4) == [[[0, 1, 2, 3]]]
    assert _grid(dp=2, pp=2, tp=1, ep=2) == [[[0, 2]], [[1, 3]]]  # per stage: the dp ranks
    assert _grid(dp=4, pp=1, tp=1, ep=2) == [[[0, 1], [2, 3]]]


def test_ep_must_divide_dp_times_tp() -> None:
    check_ep(4, dp=2, tp=2)
    with pytest.raises(ValueError, match=r"ep=3 must divide dp\*tp = 2\*2 = 4.*choose ep in \[1, 2, 4\]"):
        check_ep(3, dp=2, tp=2)
    with pytest.raises(ValueError, match="ep=0 must be a positive integer"):
        check_ep(0, dp=2, tp=2)


def test_experts_split_by_ep_keep_their_whole_shapes_on_record() -> None:
    model = Routed(TitanExperts())
    shards = ShardIndex()
    assert split_experts(model, find_experts(model), TPGroup(None, 1, 2), TPGroup(None, 0, 1), shards,
                         verify=False) == ["experts"]
    assert tuple(model.experts.w1.shape) == (2, 12, 8)
    assert shards.full_shape(model.experts.w1) == (4, 12, 8) and shards.spec(model.experts.w1).over.rank == 1


def test_ep_not_dividing_the_experts() -> None:
    model = Routed(TitanExperts())
    with pytest.raises(ExpertParallelConfigError, match=r"ep=3 must divide the 4 experts of experts; choose ep in "
                                                        r"\[1, 2, 4\]"):
        split_experts(model, find_experts(model), TPGroup(None, 0, 3), TPGroup(None, 0, 1), ShardIndex())


def test_list_experts_are_refused_with_the_fix() -> None:
    model = MODELS["list_moe"]()
    with pytest.raises(ExpertParallelConfigError, match=r"ep=2: the experts of .* are a list of 4 modules .* Cut "
                                                        r"these experts with tp instead \(ep=1\)"):
        split_experts(model, find_experts(model), TPGroup(None, 0, 2), TPGroup(None, 0, 1), ShardIndex())


def test_a_bank_parameter_not_indexed_by_expert_is_refused() -> None:
    experts = TitanExperts()
    experts.scale = nn.Parameter(torch.ones(8))
    model = Routed(experts)
    with pytest.raises(ExpertParallelConfigError, match=r"experts.scale of shape \(8,\) is not indexed by expert"):
        split_experts(model, find_experts(model), TPGroup(None, 0, 2), TPGroup(None, 0, 1), ShardIndex())


def test_a_bank_called_otherwise_is_refused_before_any_exchange() -> None:
    model = Routed(TitanExperts())
    split_experts(model, find_experts(model), TPGroup(None, 0, 2), TPGroup(None, 0, 1), ShardIndex(), verify=False)
    counts = torch.tensor([3, 1])
    with pytest.raises(ExpertParallelConfigError, match=r"called with \[\(4, 8\), \(2,\)\].*\(hidden \(T, H\), "
                                                        r"expert index \(T, k\), routing weights \(T, k\)\)"):
        model.experts(torch.randn(4, 8), counts)


def test_planner_counts_experts_split_over_ep_and_their_exchange() -> None:
    """``estimate_memory(ep=2)`` at dp=4: the experts split over ep and sharded over their 2 replicas (expert data
    parallelism), the dense parameters sharded over dp; with ``dp_shard=False`` the experts whole on their replicas;
    the exchange's buffers among the activations (the rows sent and received for each (token, slot) pair, routing
    spread evenly on meta). At dp = 1 with ep2 over tp4, sharded over their 2 tp replicas."""
    from lightning_tpp import estimate_memory

    model = MODELS["hf_mixtral_labels"]()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    kwargs = dict(tp=1, pp=1, dp=4, batch_size=8, seq_len=16)
    plain, split = (estimate_memory(MODELS["hf_mixtral_labels"](), ep=ep, **kwargs).ranks[0] for ep in (1, 2))
    assert abs(plain.param_count - total / 4) < 0.01 * total
    assert abs(split.param_count - (experts / 4 + (total - experts) / 4)) < 0.01 * total
    assert split.activations > plain.activations  # the exchanged rows
    # FSDP2's most, a bank's backward: the bank (a layer's experts / ep, fp32) gathered with its gradient, inside its
    # block (gathered), beside the block before prefetched and the block after's reduce-scatter input, or its own
    # output (1 / its 2 replicas) at its reduce-scatter, the larger
    layer = model.model.model.layers[0]
    bank = sum(p.numel() for n, p in layer.named_parameters() if ".experts." in n) / 2 * 4
    block = sum(p.numel() for p in layer.parameters()) * 4 - 2 * bank
    assert bank > block
    gathered = estimate_memory(MODELS["hf_mixtral_labels"](), ep=2, vocab_exchange=False, **kwargs).ranks[0].gathered
    assert gathered == pytest.approx(2 * bank + 2 * block + max(block, bank / 2))
    whole = estimate_memory(MODELS["hf_mixtral_labels"](), ep=2, dp_shard=False, **kwargs).ranks[0]
    assert abs(whole.param_count - (experts / 2 + total - experts)) < 0.01 * total
    # dp = 1, ep2 over tp4: each expert's 2 replicas are tp ranks, over which its parameters are sharded too
    over_tp = dict(tp=4, pp=1, dp=1, batch_size=2, seq_len=16, ep=2)
    tp_sharded, tp_whole = (estimate_memory(MODELS["hf_mixtral_labels"](), dp_shard=shard, **over_tp).ranks[0]
                            for shard in (True, False))
    assert tp_whole.param_count - tp_sharded.param_count == pytest.approx(experts / 4, rel=0.01)
    assert tp_sharded.gathered > 0 == tp_whole.gathered  # a bank gathered over its replicas in backward
    # the banks alone are FSDP2 units there: at a bank's post-backward it is gathered with its gradient, beside the
    # bank after's reduce-scatter input and the bank before prefetched (one bank per layer: a layer's experts / ep,
    # fp32); over gloo the bank and its gradient alone
    bank = experts / model.model.config.num_hidden_layers / 2 * 4
    assert tp_sharded.gathered == pytest.approx(4 * bank)
    gloo = estimate_memory(MODELS["hf_mixtral_labels"](), backend="gloo", **over_tp).ranks[0]
    assert gloo.gathered == pytest.approx(2 * bank)
    with pytest.raises(ValueError, match=r"ep=3 must divide dp\*tp = 4\*1 = 4"):
        estimate_memory(model, ep=3, **kwargs)


def test_ep_with_context_parallelism_divides_dp_cp_tp() -> None:
    """With cp the ep group is drawn from the dp, cp and tp ranks of a stage: ep divides their product, and the
    error names the three degrees."""
    check_ep(4, dp=1, tp=2, cp=2)
    with pytest.raises(ValueError, match=r"ep=8 must divide dp\*cp\*tp = 1\*2\*2 = 4: .*context-parallel.* choose ep "
                                         r"in \[1, 2, 4\]"):
        check_ep(8, dp=1, tp=2, cp=2)
    ranks = torch.arange(8).view(2, 1, 2, 2)  # (dp, pp, cp, tp)
    grid = ep_grid(ranks, 4)  # (pp, replicas, ep): tp fastest, then cp, then dp
    assert grid.tolist() == [[[0, 1, 2, 3], [4, 5, 6, 7]]]
    assert ep_grid(torch.arange(8).view(2, 2, 2), 2).tolist() == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]  # (dp, pp, tp)
