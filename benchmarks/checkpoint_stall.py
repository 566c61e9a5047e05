"""Checkpoint stall benchmark (not a test): how long a save holds up the training step, synchronous vs
``async_save=True``, side by side in one run.

    python benchmarks/checkpoint_stall.py                # Llama-style, ~25 M parameters + AdamW, tp=2 (2 CPU processes)
    python benchmarks/checkpoint_stall.py --model gpt    # GPT of ~25 M parameters: its fused qkv is gathered in the step
    python benchmarks/checkpoint_stall.py --quick        # ~1.6 M parameters: a smoke test

Each run trains ``--steps`` steps of ``examples/hf_causal_lm.py``'s ``LitLlama`` (q, k, v, o, gate, up and down
projections: every tensor-parallel shard is saved as it is) or ``examples/gpt.py``'s GPT (a fused ``[q | k | v]``
projection, which a save gathers whole over tp, in the step, before DCP writes it once) and saves a sharded checkpoint every ``--every``
steps from a callback (``trainer.save_checkpoint`` in ``on_train_batch_end``, as ``ModelCheckpoint`` does). The
stall of a save is the wall time of that call, on the slowest rank: for a synchronous save, writing every shard,
``meta.pt`` and the publish; for an asynchronous one, waiting for the previous save (if still in flight), copying
this rank's shards to host memory and starting the background write. The time the background write takes is
measured too (from the save to its publish, seen at the next save or at the end), and the step time of the steps
between saves, so that a write that slows the steps it overlaps is seen.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from pipeline import _launch as launch  # the benchmarks' one way to start ranks (this folder is on sys.path)

GPT = {"full": dict(vocab=64, block_size=64, n_embd=512, n_head=8, n_layer=8),
       "quick": dict(vocab=64, block_size=64, n_embd=128, n_head=4, n_layer=8)}
LLAMA = {"full": dict(vocab_size=256, hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=8, seq_len=64),
         "quick": dict(vocab_size=256, hidden_size=128, num_layers=8, num_heads=4, num_kv_heads=4, seq_len=64)}


def _model(name: str, size: str) -> tuple[L.LightningModule, int, int]:
    """The module, its vocabulary and its sequence length."""
    if name == "gpt":
        from gpt import GPT as Module  # examples/ is on sys.path
        shape = GPT[size]
        return Module(**shape), shape["vocab"], shape["block_size"]
    from hf_causal_lm import LitLlama
    shape = LLAMA[size]
    return LitLlama(**shape), shape["vocab_size"], shape["seq_len"]


class StallMeter(L.Callback):
    def __init__(self, folder: Path, every: int) -> None:
        self.folder, self.every = folder, every
        self.stalls: list[float] = []
        self.steps: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.append(time.perf_counter() - self._t)
        if trainer.global_step % self.every == 0:
            start = time.perf_counter()
            trainer.save_checkpoint(self.folder / f"step{trainer.global_step}.ckpt")
            self.stalls.append(time.perf_counter() - start)


def role_train(args: argparse.Namespace) -> None:
    from lightning_tpp import TensorPipeStrategy

    L.seed_everything(0, verbose=False)
    model, vocab, seq = _model(args.model, "quick" if args.quick else "full")
    folder = Path(args.out) / args.mode
    meter = StallMeter(folder, args.every)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[meter],
                        strategy=TensorPipeStrategy(tp=2, print_plan=False, async_save=args.mode == "async"))
    data = torch.randint(0, vocab, (4 * args.steps, seq + 1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
    start = time.perf_counter()
    trainer.fit(model, loader)  # the teardown waits for the last background write
    total = time.perf_counter() - start
    saved = sum(f.stat().st_size for f in (folder / f"step{args.steps}.ckpt").iterdir())
    out = {"stalls": meter.stalls, "steps": meter.steps, "total": total, "bytes": saved}
    (Path(args.out) / f"{args.mode}.{trainer.global_rank}.json").write_text(json.dumps(out))


def _summary(ranks: list[dict]) -> dict[str, float]:
    stalls = [max(r["stalls"][i] for r in ranks) for i in range(len(ranks[0]["stalls"]))]
    steps = [max(r["steps"][i] for r in ranks) for i in range(len(ranks[0]["steps"]))]
    return {"stall_median": statistics.median(stalls), "stall_max": max(stalls),
            "step_median": statistics.median(steps[1:]), "total": max(r["total"] for r in ranks),
            "bytes": ranks[0]["bytes"], "saves": len(stalls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="main")
    parser.add_argument("--out", default=None)
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", choices=("llama", "gpt"), default="llama")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    args = parser.parse_args()
    if args.role == "train":
        return role_train(args)
    extra = ["--steps", str(args.steps), "--every", str(args.every), "--model", args.model] + \
        (["--quick"] if args.quick else [])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        results = {mode: _summary(launch("train", 2, out, extra + ["--mode", mode], name=mode, script=__file__))
                   for mode in ("sync", "async")}
    sync, asyn = results["sync"], results["async"]
    print(f"{args.model}: checkpoint of {sync['bytes'] / 2 ** 20:.0f} MiB (the whole sharded folder), tp=2 on 2 CPU processes, "
          f"{sync['saves']} saves in {args.steps} steps")
    print(f"{'':24}{'sync':>10}{'async':>10}{'async/sync':>12}")
    for key, label in (("stall_median", "stall per save (median)"), ("stall_max", "stall per save (max)"),
                       ("step_median", "step time (median)"), ("total", "fit, saves included")):
        print(f"{label:24}{sync[key]:>9.3f}s{asyn[key]:>9.3f}s{asyn[key] / sync[key]:>12.2f}")


if __name__ == "__main__":
    main()
