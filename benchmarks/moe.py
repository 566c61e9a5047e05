"""Mixture-of-experts benchmark (not a test): a Mixtral-style LM (transformers 5, 8 experts, top-2) trained a few
steps in 4 CPU processes, side by side: experts kept whole on every rank, expert tensor parallelism (tp=4), expert
parallelism (ep=4 over dp=4, its dense parameters FSDP2-sharded over dp or replicated; ep=2 over dp=4, each expert's
2 replicas sharding it (expert data parallelism) or holding it whole (``no_shard``); and ep=2 over the tp pairs of
dp=2 x tp=2, whose experts are sharded over their 2 dp replicas). The layout before expert sharding (ep=2 over dp=4,
experts whole on their replicas and their gradients all-reduced, dense parameters FSDP2-sharded) has no switch of its
own: its rank processes turn setup's decision to shard the banks off (``steps._experts_over_replicas``), so that the
step-time goal (sharded experts at most 1.10x the replicated ones) compares like with like.

    python benchmarks/moe.py              # about 4 minutes on 2 cores
    python benchmarks/moe.py --steps 12
    python benchmarks/moe.py --layouts "EP (ep=2, dp=4, 2 replicas);EP (ep=2, dp=4, experts whole)" --repeat 3

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
           "EP (ep=2, dp=4, experts whole)": {"ep": 2, "experts_whole": True},
           "EP (ep=2, dp=4, 2 replicas, shard_grad_op)": {"ep": 2, "dp_sharding": "shard_grad_op"},
           "EP (ep=2, dp=4, experts whole, shard_grad_op)": {"ep": 2, "dp_sharding": "shard_grad_op",
                                                              "experts_whole": True},
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
    layout = dict(LAYOUTS[args.layout])
    if layout.pop("experts_whole", False):  # the behaviour before expert sharding: banks whole on their replicas
        import lightning_tpp.steps

        lightning_tpp.steps._experts_over_replicas = lambda s: None
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
    sharded = layout.get("dp_sharding") != "no_shard" and not LAYOUTS[args.layout].get("experts_whole")
    replicas = dp * layout.get("tp", 1) // ep if ep > 1 and sharded else 1
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
    parser.add_argument("--layouts", default=";".join(LAYOUTS), help="separated by ';': " + "; ".join(LAYOUTS))
    parser.add_argument("--repeat", type=int, default=1, help="run the chosen layouts this many times, in turn")
    args = parser.parse_args()
    if args.role == "rank":
        return rank(args)
    out = Path(tempfile.mkdtemp())
    chosen = [name for name in LAYOUTS if name in args.layouts.split(";")]
    runs: dict[str, list[tuple]] = {name: [] for name in chosen}
    for turn in range(args.repeat):  # in turn, so that the machine's load falls on every layout alike
        for name in chosen:
            job = f"l{list(LAYOUTS).index(name)}r{turn}"
            ranks = launch("rank", 4, out, ["--layout", name, "--name", job, "--steps", str(args.steps)],
                           name=job, script=__file__)
            step = statistics.median(max(r["times"][s] for r in ranks) for s in range(2, args.steps))
            runs[name].append((ranks[0]["experts"], ranks[0]["goal"], ranks[0]["params"], step, ranks[0]["sent"],
                               ranks[0]["analytic"]))
    rows = {name: (*r[0][:3], statistics.median(x[3] for x in r), *r[0][4:]) for name, r in runs.items()}
    if args.repeat > 1:
        for name, r in runs.items():
            print(f"{name:46} step (s) per run: {', '.join(f'{x[3]:.3f}' for x in r)}")
    base = rows.get("experts replicated (tp=4)", (0, 0, 0, float("nan")))[3]
    tp = rows.get("expert-TP (tp=4)", (0, 0, 0, float("nan")))[3]
    print(f"{'layout':46} {'experts/rank':>12} {'/ goal':>6} {'params/rank':>11} {'step (s)':>8} {'/ repl.':>7} "
          f"{'/ ETP':>6} {'a2a MB/step':>11} {'/ analytic':>10}")
    for name, (experts, goal, params, step, sent, analytic) in rows.items():
        traffic = f"{sent / 1e6:11.2f} {sent / analytic:10.2f}" if analytic else f"{'-':>11} {'-':>10}"
        print(f"{name:46} {experts:12.3f} {experts / goal:6.3f} {params:11.3f} {step:8.3f} {step / base:7.2f} "
              f"{step / tp:6.2f} {traffic}")
    step = {name: row[3] for name, row in rows.items()}
    sharded = step.get("EP (ep=2, dp=4, 2 replicas)", float("nan"))
    print(f"ep=2 over dp=4, experts sharded over their replicas, step time / experts whole on their replicas (the "
          f"same dense FSDP2) {sharded / step.get('EP (ep=2, dp=4, experts whole)', float('nan')):.3f} (goal <= 1.10); "
          f"/ no_shard (experts and dense parameters whole) "
          f"{sharded / step.get('EP (ep=2, dp=4, no_shard)', float('nan')):.3f}; / ep=4 over dp=4 (the same dense "
          f"FSDP2, experts never gathered) {sharded / step.get('EP (ep=4, dp=4)', float('nan')):.3f}")
    kept = step.get("EP (ep=2, dp=4, 2 replicas, shard_grad_op)", float("nan"))
    kept_whole = step.get("EP (ep=2, dp=4, experts whole, shard_grad_op)", float("nan"))
    print(f"the same with dp_sharding='shard_grad_op' (parameters kept gathered from forward to backward: one "
          f"all-gather less), sharded / whole {kept / kept_whole:.3f}; / full_shard with experts whole "
          f"{kept / step.get('EP (ep=2, dp=4, experts whole)', float('nan')):.3f}")


if __name__ == "__main__":
    main()
