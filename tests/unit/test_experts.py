"""Mixture-of-experts detection and expert tensor parallelism, in one process: every tp rank's partial output of a
bank, computed from its shards, sums to the original bank's output."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_tpp.core.comm import TPGroup
from lightning_tpp.core.params import ShardIndex
from lightning_tpp.experts import ExpertParallelConfigError, expert_bank, find_experts, shard_banks
from models import MODELS


class TitanExperts(nn.Module):
    """torchtitan's layout: three banks w1, w3 (E, F, D) and w2 (E, D, F), a loop over the experts' token groups."""

    def __init__(self, experts: int = 4, dim: int = 8, hidden: int = 12) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) * 0.3)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) * 0.3)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) * 0.3)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            token, slot = torch.where(chosen == e)
            h = F.silu(x[token] @ self.w1[e].T) * (x[token] @ self.w3[e].T)
            out.index_add_(0, token, (h @ self.w2[e].T) * weights[token, slot, None])
        return out


class Routed(nn.Module):
    def __init__(self, experts: nn.Module, count: int = 4, dim: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(dim, count, bias=False)
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.router(x).softmax(-1).topk(2, dim=-1)
        return self.experts(x, chosen, weights)


def _hf_bank(kind: str) -> nn.Module:
    model = MODELS[f"hf_{kind}_labels"]()
    return model.get_submodule(find_experts(model)[0].experts)


def _partials_sum(root: nn.Module, tp: int, *args: torch.Tensor) -> torch.Tensor:
    """The sum over ``tp`` ranks of each one's partial output, each computed from its own shards."""
    total = 0
    for rank in range(tp):
        shard = copy.deepcopy(root)
        shard_banks(shard, find_experts(shard), TPGroup(None, rank, tp), ShardIndex(), verify=False)
        bank = next(m for m in shard.modules() if hasattr(m, "_tpp_experts"))
        real = type(bank)._local_forward  # this rank's partial sum, without the all-reduce
        bank.forward = lambda *a, _b=bank, _f=real, **k: _f(_b, a, k)  # type: ignore[method-assign]
        with torch.no_grad():
            total = total + shard(*args)
    return total


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_hf_banks_partials_sum_to_the_original(kind: str, implementation: str) -> None:
    """transformers 5's banks (packed [gate | up], or gpt-oss's transposed interleaved pairs with biases), through
    its loop over the experts and its grouped matmul: the ranks' partial sums add up to the original's output."""
    torch.manual_seed(0)
    bank = _hf_bank(kind)
    bank.config._experts_implementation = implementation
    for p in bank.parameters():  # random values everywhere (some families start biases at zero)
        p.data.normal_(0, 0.3)
    x, chosen = torch.randn(6, 32), torch.randint(0, 4, (6, 2))
    weights = torch.rand(6, 2)
    with torch.no_grad():
        want = bank(x, chosen, weights)
    for tp in (2, 4):
        torch.testing.assert_close(_partials_sum(bank, tp, x, chosen, weights), want, rtol=1e-4, atol=1e-5)


def test_torchtitan_three_banks() -> None:
    torch.manual_seed(0)
    moe = Routed(TitanExperts())
    bank = expert_bank(moe.experts)
    assert bank is not None and bank.up == ["w1", "w3"] and bank.down == "w2" and not bank.packed
    assert not bank.transposed and (bank.hidden, bank.intermediate) == (8, 12)
    x = torch.randn(5, 8)
    with torch.no_grad():
        want = moe(x)
    torch.testing.assert_close(_partials_sum(moe, 2, x), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(_partials_sum(moe, 4, x), want, rtol=1e-4, atol=1e-5)


def test_detects_the_families_layers() -> None:
    mixtral = find_experts(MODELS["hf_mixtral_labels"]())
    assert [(l.name, l.kind, l.count) for l in mixtral] == [("model.model.layers.0.mlp", "bank", 4),
                                                            ("model.model.layers.1.mlp", "bank", 4)]
    assert mixtral[0].router == "model.model.layers.0.mlp.gate" and mixtral[0].shared == []
    qwen = find_experts(MODELS["hf_qwen2_moe_labels"]())[0]
    assert qwen.shared == ["model.model.layers.0.mlp.shared_expert", "model.model.layers.0.mlp.shared_expert_gate"]
    deepseek = find_experts(MODELS["hf_deepseek_v3_labels"]())  # the first layer is dense
    assert [l.name for l in deepseek] == ["model.model.layers.1.mlp", "model.model.layers.2.mlp"]
    oss = find_experts(MODELS["hf_gpt_oss_labels"]())[0].bank
    assert oss is not None and oss.transposed and not oss.concatenated and oss.up_biases == ["gate_up_proj_bias"]
    assert oss.down_biases == ["down_proj_bias"]
    listed = find_experts(MODELS["list_moe"]())
    assert [(l.name, l.kind, l.count, l.router) for l in listed] == [
        ("blocks.0.moe", "list", 4, "blocks.0.moe.gate"), ("blocks.1.moe", "list", 4, "blocks.1.moe.gate")]


@pytest.mark.parametrize("name", ["nanogpt", "llama", "hf_llama", "encoder", "nested_lists", "litgpt"])
def test_dense_models_have_no_experts(name: str) -> None:
    """A list of blocks has no router for that many entries: not experts."""
    assert find_experts(MODELS[name]()) == []


def test_intermediate_width_not_divisible() -> None:
    moe = Routed(TitanExperts(hidden=6))
    with pytest.raises(ExpertParallelConfigError, match=r"tp=4 must divide the intermediate width 6 of every expert "
                                                        r"of experts .*tp_plan=\{'experts': 'replicate'\}"):
        shard_banks(moe, find_experts(moe), TPGroup(None, 0, 4), ShardIndex(), verify=False)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_tokens_per_expert_are_logged(tmp_path: Path, compiled: bool) -> None:
    """``moe/`` values through the Trainer's loggers: every routed token counted once per expert it went to (top-2
    of 4 experts: 2 x 4 x 16 tokens a step), for a bank (counted from its expert indices) and a list of experts
    (from the rows each expert receives). Compiled (``compile=``, from the second step on): the last step's count
    comes from the blocks' graphs, and a bank's count breaks no graph (nor does Hugging Face's router-logit
    recording)."""
    import torch.distributed as dist

    from lightning_tpp.integration.compile_metrics import dynamo_counts

    for name, layer in [("hf_mixtral_labels", "model.model.model.layers.1.mlp"), ("list_moe", "model.blocks.1.moe")]:
        graphs, breaks, _ = dynamo_counts()
        try:
            trainer = _fit_logging(name, tmp_path, compiled)
        finally:
            if dist.is_initialized():  # the strategy's one-process group: later tests start their own
                dist.destroy_process_group()
        metrics = trainer.callback_metrics
        counts = [float(metrics[f"moe/{layer}/expert{e}"]) for e in range(4)]
        assert sum(counts) == 2 * 4 * 16, (name, counts)
        assert float(metrics[f"moe/{layer}/imbalance"]) == pytest.approx(max(counts) / (sum(counts) / 4))
        assert float(metrics["moe/imbalance"]) >= float(metrics[f"moe/{layer}/imbalance"])
        assert float(metrics[f"moe/{layer}/idle_experts"]) == sum(c == 0 for c in counts)
        if compiled and name == "hf_mixtral_labels":
            assert trainer.strategy.parallel_state.compiled and dynamo_counts()[0] > graphs
            assert dynamo_counts()[1] == breaks, dynamo_counts()[2]


def _fit_logging(name: str, tmp_path: Path, compiled: bool = False) -> "L.Trainer":
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_tpp import TensorPipeStrategy
    from models import LitLM, token_dataset

    strategy = TensorPipeStrategy(compile={"backend": "aot_eager"} if compiled else False)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3 if compiled else 2,
                        log_every_n_steps=1, logger=CSVLogger(tmp_path, name=name), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LitLM(name), torch.utils.data.DataLoader(token_dataset(8), batch_size=4))
    return trainer


def test_summarize_sums_the_ranks_that_counted() -> None:
    from lightning_tpp.integration.expert_load import summarize

    values = summarize([{"a": [1, 3]}, {}, {"a": [1, 1], "b": [0, 4]}])  # a rank that did not count sends {}
    assert values["moe/a/expert0"] == 2 and values["moe/a/expert1"] == 4
    assert values["moe/a/imbalance"] == pytest.approx(4 / 3) and values["moe/b/idle_experts"] == 1
    assert values["moe/imbalance"] == pytest.approx(2.0)
    assert summarize([{}, {}]) == {}


def test_planner_counts_the_experts_cut_over_tp() -> None:
    """``estimate_memory`` on a transformers 5 MoE (its default grouped matmul, fp32 on meta): the experts' parameters
    and the activations they save are cut over tp as the strategy cuts them."""
    from lightning_tpp import estimate_memory

    one, two = (estimate_memory(MODELS["hf_mixtral_labels"](), tp=tp, pp=1, dp=1, batch_size=4, seq_len=16).ranks[0]
                for tp in (1, 2))
    assert two.params <= 0.51 * one.params  # experts and attention cut, embedding and head by vocabulary
    assert two.activations < 0.7 * one.activations


def test_pipeline_balance_counts_experts_as_they_run() -> None:
    """A block's cost for balancing stages: its experts count top-k / E of their parameters (each token runs
    through k of them), so a dense layer is not outweighed by a routed layer's idle experts."""
    from lightning_tpp.experts import active_parameters, top_k
    from lightning_tpp.pipeline.partition import plan_partition

    model = MODELS["hf_deepseek_v3_labels"]()  # layer 0 dense, layers 1-2 routed (4 experts, top-2)
    layers = model.model.model.layers
    layer = find_experts(model)[0]
    assert top_k(model, layer) == 2 and layer.count == 4
    experts = sum(p.numel() for p in layers[1].mlp.experts.parameters())
    whole = sum(p.numel() for p in layers[1].parameters())
    assert active_parameters(layers[1]) == whole - experts / 2
    assert active_parameters(layers[0]) == sum(p.numel() for p in layers[0].parameters())
    import transformers  # three dense layers, then three routed ones of 16 experts (top-2)

    cfg = transformers.DeepseekV3Config(vocab_size=64, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
                                        num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=16,
                                        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
                                        topk_group=1, first_k_dense_replace=3, q_lora_rank=16, kv_lora_rank=16,
                                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                                        max_position_embeddings=16, tie_word_embeddings=False)
    deep = transformers.DeepseekV3ForCausalLM(cfg)
    assert plan_partition(deep, 2).bounds == ((0, 4), (4, 6))  # by parameters: the idle experts weigh
    assert plan_partition(deep, 2, weight=active_parameters).bounds == ((0, 3), (3, 6))
