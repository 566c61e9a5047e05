"""Mixture-of-experts benchmark (not a test): a Mixtral-style LM (transformers 5, 8 experts, top-2) trained a few
steps in 4 CPU processes, experts kept whole on every rank against expert tensor parallelism, side by side.

    python benchmarks/moe.py              # about 2 minutes on 2 cores
    python benchmarks/moe.py --steps 12

Per layout: the experts' parameters a rank holds as a fraction of all experts' (goal under expert-TP: 1/tp), all
parameters per rank as a fraction of the model's, and the median step time of the steps after the first two (the
slowest rank's), with expert-TP's as a ratio to the replicated layout's in the same run. Expert parallelism (``ep=``,
whole experts per rank and an all-to-all of tokens) is not built yet: no row for it.
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
import torch.nn.functional as F

from pipeline import _launch as launch  # the benchmarks' one way to start ranks (this folder is on sys.path)

LAYOUTS = {"experts replicated (tp=4)": {"tp": 4, "tp_plan": {"model.model.layers.*.mlp.experts": "replicate"}},
           "expert-TP (tp=4)": {"tp": 4}}
VOCAB, SEQ, BATCH = 1024, 128, 8


class MoELM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        import transformers

        cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                         num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                                         num_experts_per_tok=2, max_position_embeddings=SEQ,
                                         output_router_logits=True, router_aux_loss_coef=0.01)
        self.model = transformers.MixtralForCausalLM(cfg)
        self.times: list[float] = []
        self._t = 0.0

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def on_train_batch_start(self, batch, batch_idx) -> None:
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
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=TensorPipeStrategy(**layout, print_plan=False),
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
    local = {n: p.numel() for n, p in module.named_parameters()}
    result = {"experts": sum(v for n, v in local.items() if ".experts." in n) / experts_whole,
              "params": sum(local.values()) / sum(whole.values()), "times": module.times}
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
        rows[name] = (ranks[0]["experts"], ranks[0]["params"], step)
    base = next(iter(rows.values()))[2]
    print(f"{'layout':28} {'experts/rank':>13} {'params/rank':>12} {'step (s)':>9} {'ratio':>6}")
    for name, (experts, params, step) in rows.items():
        print(f"{name:28} {experts:13.3f} {params:12.3f} {step:9.3f} {step / base:6.2f}")


if __name__ == "__main__":
    main()
