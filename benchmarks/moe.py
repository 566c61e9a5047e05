"""Mixture-of-experts benchmark (not a test): a Mixtral-style LM (transformers 5, 8 experts, top-2) trained a few
steps in 4 CPU processes, side by side: experts kept whole on every rank, expert tensor parallelism (tp=4), expert
parallelism (ep=4 over dp=4, its dense parameters FSDP2-sharded over dp or replicated; ep=2 over dp=4, each expert's
2 replicas sharding it (expert data parallelism) or holding it whole (``no_shard``); and ep=2 over the tp pairs of
dp=2 x tp=2, whose experts are sharded over their 2 dp replicas).

    python benchmarks/moe.py              # about 4 minutes on 2 cores
    python benchmarks/moe.py --steps 12

Every layout trains on the same 8 samples per step (a process's batch is 8 / dp). Per layout: the experts'
parameters a rank holds as a fraction of all experts' (goal: 1/tp under expert-TP, 1/ep under EP, 1/(ep x replicas)
where the replicas shard them, within 5%), all parameters per rank as a fraction of the model's (FSDP2-sharded dense
parameters counted whole), the median step time of the steps after the first two (the slowest rank's) as a
ratio to the replicated layout's and to expert-TP's in the same run, and under EP the bytes rank 0's exchanges sent to
other ranks per step against the analytic count (each (token, slot) row of H fp32 values goes out to its expert's rank
and its output comes back, forward and backward: 4 x rows x (ep - 1) / ep x H x 4 bytes per MoE layer, for routing
spread evenly).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

from pipeline import _launch as launch  # the benchmarks' one way to start ranks (this folder is on sys.path)

LAYOUTS = {"experts replicated (tp=4)": {"tp": 4, "tp_plan": {"model.model.layers.*.mlp.experts": "replicate"}},
           "expert-TP (tp=4)": {"tp": 4},
           "EP (ep=4, dp=4)": {"ep": 4},
           "EP (ep=4, dp=4, dense no_shard)": {"ep": 4, "dp_sharding": "no_shard"},
           "EP (ep=2, dp=4, 2 replicas)": {"ep": 2},
           "EP (ep=2, dp=4, no_shard)": {"ep": 2, "dp_sharding": "no_shard"},
           "EP (ep=2 x tp=2, dp=2)": {"tp": 2, "ep": 2}}
VOCAB, SEQ, BATCH, HIDDEN, LAYERS, TOP_K = 1024, 128, 8, 256, 4, 2


class MoELM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        import transformers

        cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512,
                                         num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4,
                                         num_local_experts=8, num_experts_per_tok=TOP_K, max_position_embeddings=SEQ,
                                         output_router_logits=True, router_aux_loss_coef=0.01)
        self.model = transformers.MixtralForCausalLM(cfg)
        self.times: list[float] = []
        self._t = 0.0
        self.sent: list[int] = []  # bytes the token exchanges sent before each step

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def on_train_batch_start(self, batch, batch_idx) -> None:
        group = self.trainer.strategy.parallel_state.groups.ep
        self.sent.append(group.traffic.bytes if group is not None else 0)
        self._t = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._t)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def rank(args: argparse.Namespace) -> None:
    from lightning_tpp import TensorPipeStrategy

    L.seed_everything(0, verbose=False)
    layout = LAYOUTS[args.layout]
    module = MoELM()
    whole = {n: p.numel() for n, p in module.named_parameters()}
    experts_whole = sum(v for n, v in whole.items() if ".experts." in n)
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (BATCH * args.steps, SEQ)))
    strategy = TensorPipeStrategy(**layout, print_plan=False)
    dp = 4 // layout.get("tp", 1)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH // dp))
    from lightning_tpp.core.dp_shard import local as local_part

    local = {n: p.numel() for n, p in module.named_parameters()}
    held = {n: local_part(p).numel() for n, p in module.named_parameters() if ".experts." in n}
    ep = layout.get("ep", 1)
    replicas = dp * layout.get("tp", 1) // ep if ep > 1 and layout.get("dp_sharding") != "no_shard" else 1
    rows = BATCH // dp * SEQ // layout.get("tp", 1) * TOP_K  # (token, slot) rows a rank sends per MoE layer
    if "tp_plan" in layout:  # kept whole
        goal = 1.0
    else:
        goal = 1 / layout.get("tp", 1) if ep == 1 else 1 / (ep * replicas)
    result = {"experts": sum(held.values()) / experts_whole, "goal": goal,
              "params": sum(local.values()) / sum(whole.values()), "times": module.times,
              "sent": (module.sent[-1] - module.sent[2]) / (len(module.sent) - 3) if ep > 1 else 0.0,
              "analytic": 4 * rows * (ep - 1) / ep * HIDDEN * 4 * LAYERS}
    (Path(args.out) / f"{args.name}.{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", default="driver", choices=("driver", "rank"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layout", default=None)
    parser.add_argument("--name", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.role == "rank":
        return rank(args)
    out = Path(tempfile.mkdtemp())
    rows = {}
    for i, name in enumerate(LAYOUTS):
        ranks = launch("rank", 4, out, ["--layout", name, "--name", f"l{i}", "--steps", str(args.steps)],
                       name=f"l{i}", script=__file__)
        step = statistics.median(max(r["times"][s] for r in ranks) for s in range(2, args.steps))
        rows[name] = (ranks[0]["experts"], ranks[0]["goal"], ranks[0]["params"], step, ranks[0]["sent"],
                      ranks[0]["analytic"])
    base, tp = rows["experts replicated (tp=4)"][3], rows["expert-TP (tp=4)"][3]
    print(f"{'layout':32} {'experts/rank':>12} {'/ goal':>6} {'params/rank':>11} {'step (s)':>8} {'/ repl.':>7} "
          f"{'/ ETP':>6} {'a2a MB/step':>11} {'/ analytic':>10}")
    for name, (experts, goal, params, step, sent, analytic) in rows.items():
        traffic = f"{sent / 1e6:11.2f} {sent / analytic:10.2f}" if analytic else f"{'-':>11} {'-':>10}"
        print(f"{name:32} {experts:12.3f} {experts / goal:6.3f} {params:11.3f} {step:8.3f} {step / base:7.2f} "
              f"{step / tp:6.2f} {traffic}")
    sharded, whole = rows["EP (ep=2, dp=4, 2 replicas)"][3], rows["EP (ep=2, dp=4, no_shard)"][3]
    alone = rows["EP (ep=4, dp=4)"][3]
    print(f"ep=2 over dp=4, experts sharded over their replicas: step / no_shard (experts and dense parameters whole) "
          f"{sharded / whole:.3f} (goal <= 1.10); / ep=4 over dp=4 (the same dense FSDP2, experts never gathered) "
          f"{sharded / alone:.3f}")


if __name__ == "__main__":
    main()
