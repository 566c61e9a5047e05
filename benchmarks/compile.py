"""``compile=`` benchmark (not a test): compiled against eager step time, side by side in one run, at tp=2, pp=2 and
tp=2 x pp=2 on a Llama-shaped model (Hugging Face ``LlamaForCausalLM``: hidden 256, 4 layers, 8 heads / 4 kv, 128
tokens, batch 8, AdamW), on this machine's CPUs with inductor's C++ backend.

    python benchmarks/compile.py                     # inductor; several minutes on 2 cores (its C++ compile)
    python benchmarks/compile.py --backend aot_eager  # dynamo + AOTAutograd only: the graph breaks' cost, no codegen

Per layout and mode: the slowest rank's median step time over the steps after the first compiled one (the strategy
compiles the blocks after the first training step), the compiled / eager ratio (goal on CPU: <= 0.95 in at least
one layout, never above 1.05), and on its own line the compile time: the first compiled step less a steady one.
Also printed: the graphs and graph breaks of rank 0, the ratio and compile time with ``dynamic=False`` (no size
marked dynamic: an epoch's short last batch then recompiles), and the bytes autograd saves for backward in one
step's forward (the largest rank), eager and compiled: under sequence parallelism eager keeps the gathered stream
saved as this rank's shard, which the compiled graph does not (docs/compile.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import lightning as L
import torch

from pipeline import _StepTimer  # the benchmarks' step-time callback
from pipeline import _launch as launch  # the benchmarks' one way to start ranks (this folder is on sys.path)

LAYOUTS = {"tp=2": {"tp": 2}, "pp=2": {"pp": 2, "schedule": "1f1b"}, "tp=2 x pp=2": {"tp": 2, "pp": 2,
                                                                                  "schedule": "1f1b"},
           "tp=2 sp": {"tp": 2, "sequence_parallel": True}}
SAVED_STEP = 5  # the step whose forward's saved tensors are counted
VOCAB, SEQ, BATCH, HIDDEN, LAYERS = 1024, 128, 8, 256, 4


class LlamaLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                                       num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4,
                                       max_position_embeddings=SEQ)
        self.model = transformers.LlamaForCausalLM(cfg)

        self.saved = 0  # bytes autograd saved for backward in step SAVED_STEP's forward (this rank)

    def training_step(self, batch, batch_idx):
        if batch_idx != SAVED_STEP:
            return self.model(input_ids=batch[0], labels=batch[0]).loss
        storages: dict[int, int] = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.saved = sum(storages.values())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def rank(args: argparse.Namespace) -> None:
    from lightning_tpp import TensorPipeStrategy
    from lightning_tpp.integration.compile_metrics import dynamo_counts

    L.seed_everything(0, verbose=False)
    layout = LAYOUTS[args.layout]
    module = LlamaLM()
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (BATCH * args.steps, SEQ)))
    compile = {"backend": args.backend, **({"dynamic": False} if args.static else {})} if args.compiled else False
    strategy = TensorPipeStrategy(**layout, compile=compile, print_plan=False)
    timer = _StepTimer()
    trainer = L.Trainer(accelerator="cpu", devices=layout.get("tp", 1) * layout.get("pp", 1), strategy=strategy,
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer.callback()])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
    graphs, breaks, _ = dynamo_counts()
    (Path(args.out) / f"{args.name}.{trainer.global_rank}.json").write_text(
        json.dumps({"times": timer.times, "graphs": graphs, "breaks": breaks, "saved": module.saved}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", default="driver", choices=("driver", "rank"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--layout", default=None)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--static", action="store_true", help="compile={..., 'dynamic': False}: no size marked dynamic")
    parser.add_argument("--name", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: " + ", ".join(LAYOUTS))
    args = parser.parse_args()
    if args.role == "rank":
        return rank(args)
    out = Path(tempfile.mkdtemp())
    print(f"{'layout':14} {'eager (s)':>9} {'compiled (s)':>12} {'ratio':>6} {'compile (s)':>11} {'graphs':>6} "
          f"{'breaks':>6} {'static ratio':>12} {'static compile (s)':>18} {'saved MiB eager':>15} "
          f"{'compiled':>8}")
    for i, (name, layout) in enumerate(LAYOUTS.items()):
        if name not in args.layouts.split(","):
            continue
        n = layout.get("tp", 1) * layout.get("pp", 1)
        step = {}
        for mode in ("eager", "compiled", "static"):  # static: dynamic=False, sizes compiled as constants
            extra = ["--layout", name, "--name", f"l{i}{mode}", "--steps", str(args.steps), "--backend",
                     args.backend] + (["--compiled"] if mode != "eager" else []) + (["--static"] if mode == "static"
                                                                                     else [])
            ranks = launch("rank", n, out, extra, name=f"l{i}{mode}", script=__file__, timeout=1800)
            slowest = [max(r["times"][s] for r in ranks) for s in range(args.steps)]
            step[mode] = (statistics.median(slowest[2:]), slowest[1], ranks[0], max(r["saved"] for r in ranks))
        eager = step["eager"][0]
        (compiled_step, first, info, saved), (static_step, static_first, _, _) = step["compiled"], step["static"]
        print(f"{name:14} {eager:9.3f} {compiled_step:12.3f} {compiled_step / eager:6.3f} "
              f"{first - compiled_step:11.1f} {info['graphs']:6d} {info['breaks']:6d} {static_step / eager:12.3f} "
              f"{static_first - static_step:18.1f} {step['eager'][3] / 2**20:15.2f} {saved / 2**20:8.2f}")


if __name__ == "__main__":
    main()
