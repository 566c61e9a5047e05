"""Checkpoint stall benchmark (not a test): how long a save holds up the training step, synchronous vs
``async_save=True``, side by side in one run.

    python benchmarks/checkpoint_stall.py                # Llama-style, ~25 M parameters + AdamW, tp=2 (2 CPU processes)
    python benchmarks/checkpoint_stall.py --model gpt    # GPT of ~25 M parameters: its fused qkv is gathered in the step
    python benchmarks/checkpoint_stall.py --quick        # ~1.6 M parameters: a smoke test
    python benchmarks/checkpoint_stall.py --profile      # and the parts of each stall (median, slowest rank)

Each run trains ``--steps`` steps of ``examples/hf_causal_lm.py``'s ``LitLlama`` (q, k, v, o, gate, up and down
projections: every tensor-parallel shard is saved as it is) or ``examples/gpt.py``'s GPT (a fused ``[q | k | v]``
projection, which a save gathers whole over tp, in the step, before DCP writes it once) and saves a sharded checkpoint every ``--every``
steps from a callback (``trainer.save_checkpoint`` in ``on_train_batch_end``, as ``ModelCheckpoint`` does). The
stall of a save is the wall time of that call, on the slowest rank: for a synchronous save, writing every shard,
``meta.pt`` and the publish; for an asynchronous one, waiting for the previous save (if still in flight), copying
this rank's shards to host memory and starting the background write. The time the background write takes is
measured too (from the save to its publish, seen at the next save or at the end), and the step time of the steps
between saves, so that a write that slows the steps it overlaps is seen. A save that comes while the previous write
is still in flight waits for it: that wait is part of the stall and is also printed on its own line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
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


class Parts:
    """Seconds spent in named functions, per save: the step's (main thread) parts of the stall, and the background
    writer's. Installed by wrapping module attributes in this benchmark's processes only."""

    def __init__(self) -> None:
        self.main: dict[str, float] = {}
        self.background: list[dict[str, float]] = []  # one per background write, appended as each starts

    def wrap(self, owner: Any, name: str, label: str, *, background: bool = False) -> None:
        real = getattr(owner, name, None)
        if real is None:  # not in this version of lightning_tpp
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            if background == (threading.current_thread() is threading.main_thread()):
                return real(*args, **kwargs)  # a synchronous save's planning is in the stall itself; DCP's
                # collectives in the writer's thread are not
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                into = self.background[-1] if background and self.background else self.main
                end = time.perf_counter()
                into[label] = into.get(label, 0.0) + end - start
                if background:
                    into["total"] = end - into["start"]

        setattr(owner, name, timed)


def install_parts(trainer: L.Trainer) -> Parts:
    """Time the pieces of ``trainer.save_checkpoint`` (see ``--profile`` in the module docstring)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.utils import _DistWrapper

    import lightning_tpp.checkpoint.async_save as saver_module
    import lightning_tpp.checkpoint.dcp as dcp_module
    import lightning_tpp.integration.checkpointing as glue

    parts = Parts()
    parts.wrap(trainer._checkpoint_connector, "dump_checkpoint", "lightning dump_checkpoint")
    parts.wrap(dist, "all_gather_object", "all_gather_object (rng states, failures, path)")
    parts.wrap(dist, "broadcast_object_list", "broadcast (path)")
    parts.wrap(glue, "named_param_groups", "param groups")
    parts.wrap(saver_module.AsyncSaver, "settle", "wait for the previous save")
    parts.wrap(glue, "sharded_state", "sharded_state (wrap; tp gather incl.)")
    parts.wrap(glue, "sharded_entries", "sharded_entries (names, optimizer state)")
    parts.wrap(dcp_module, "gather_with_spec", "  of which tp gather (fused qkv)")
    parts.wrap(glue, "partial_dir", "partial_dir (rmtree + barrier)")
    parts.wrap(glue, "clear_partial", "clear .partial (rank 0)")
    parts.wrap(glue, "sharded_meta", "meta (rank 0)")
    parts.wrap(saver_module.AsyncSaver, "save", "AsyncSaver.save (meta copy, host copy, start)")
    parts.wrap(saver_module, "host_copy", "  of which host copy")
    parts.wrap(dcp, "async_save", "  of which dcp.async_save call")
    parts.wrap(glue, "save_sharded", "dcp.save + meta + publish (sync)")
    parts.wrap(type(trainer.strategy), "barrier", "lightning barrier")
    parts.wrap(_DistWrapper, "reduce_scatter", "planning (local plan, gather, global plan)", background=True)
    parts.wrap(_DistWrapper, "all_reduce", "write shards + .metadata", background=True)
    parts.wrap(saver_module, "_publish", "meta.pt + publish", background=True)
    # a background write starts at its host copy (its own thread) or at dcp.async_save (DCP's thread)
    owner, name = (saver_module, "host_copy") if hasattr(saver_module.AsyncSaver, "_write") else (dcp, "async_save")
    real_start = getattr(owner, name)

    def start_background(*args: Any, **kwargs: Any) -> Any:
        parts.background.append({"start": time.perf_counter()})
        return real_start(*args, **kwargs)

    setattr(owner, name, start_background)
    return parts


class StallMeter(L.Callback):
    def __init__(self, folder: Path, every: int, profile: bool) -> None:
        self.folder, self.every, self.profile = folder, every, profile
        self.stalls: list[float] = []
        self.waits: list[float] = []  # of each stall: waiting for the previous save's background write
        self.parts: list[dict[str, float]] = []
        self.steps: list[float] = []
        self._t = 0.0
        self._parts: Any = None

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._parts = install_parts(trainer) if self.profile else None
        if self._parts is None:  # the wait for the previous save is always measured
            self._parts = Parts()
            import lightning_tpp.checkpoint.async_save as saver_module
            self._parts.wrap(saver_module.AsyncSaver, "settle", "wait for the previous save")

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.append(time.perf_counter() - self._t)
        if trainer.global_step % self.every == 0:
            self._parts.main = {}
            start = time.perf_counter()
            trainer.save_checkpoint(self.folder / f"step{trainer.global_step}.ckpt")
            self.stalls.append(time.perf_counter() - start)
            self.waits.append(self._parts.main.get("wait for the previous save", 0.0))
            self.parts.append(self._parts.main)
            self._parts.main = {}  # the teardown's wait is not a save's


def role_train(args: argparse.Namespace) -> None:
    from lightning_tpp import TensorPipeStrategy

    L.seed_everything(0, verbose=False)
    model, vocab, seq = _model(args.model, "quick" if args.quick else "full")
    folder = Path(args.out) / args.mode
    meter = StallMeter(folder, args.every, args.profile)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[meter],
                        strategy=TensorPipeStrategy(tp=2, print_plan=False, async_save=args.mode == "async"))
    data = torch.randint(0, vocab, (4 * args.steps, seq + 1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
    start = time.perf_counter()
    trainer.fit(model, loader)  # the teardown waits for the last background write
    total = time.perf_counter() - start
    saved = sum(f.stat().st_size for f in (folder / f"step{args.steps}.ckpt").iterdir())
    background = [{k: v for k, v in b.items() if k != "start"} for b in meter._parts.background]
    out = {"stalls": meter.stalls, "waits": meter.waits, "parts": meter.parts, "background": background,
           "steps": meter.steps, "total": total, "bytes": saved}
    (Path(args.out) / f"{args.mode}.{trainer.global_rank}.json").write_text(json.dumps(out))


def _summary(ranks: list[dict]) -> dict[str, Any]:
    saves = range(len(ranks[0]["stalls"]))
    slowest = [max(ranks, key=lambda r: r["stalls"][i]) for i in saves]  # the rank each save's stall is read on
    stalls = [r["stalls"][i] for i, r in zip(saves, slowest)]
    waits = [r["waits"][i] for i, r in zip(saves, slowest)]
    steps = [max(r["steps"][i] for r in ranks) for i in range(len(ranks[0]["steps"]))]
    background = [max(r["background"][i].get("total", 0.0) for r in ranks)
                  for i in range(len(ranks[0]["background"]))]
    parts = {k: statistics.median(r["parts"][i].get(k, 0.0) for i, r in zip(saves, slowest))
             for k in dict.fromkeys(k for r in slowest for p in r["parts"] for k in p)}
    written = {k: statistics.median(b.get(k, 0.0) for r in ranks for b in r["background"])
               for k in dict.fromkeys(k for r in ranks for b in r["background"] for k in b)}
    return {"stall_median": statistics.median(stalls), "stall_max": max(stalls),
            "wait_median": statistics.median(waits), "wait_max": max(waits),
            "rest_median": statistics.median(s - w for s, w in zip(stalls, waits)),
            "write_median": statistics.median(background) if background else float("nan"),
            "step_median": statistics.median(steps[1:]), "total": max(r["total"] for r in ranks),
            "bytes": ranks[0]["bytes"], "saves": len(stalls), "stalls": stalls, "parts": parts, "written": written}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="main")
    parser.add_argument("--out", default=None)
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", choices=("llama", "gpt"), default="llama")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.role == "train":
        return role_train(args)
    extra = ["--steps", str(args.steps), "--every", str(args.every), "--model", args.model] + \
        (["--quick"] if args.quick else []) + (["--profile"] if args.profile else [])
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        results = {mode: _summary(launch("train", 2, out, extra + ["--mode", mode], name=mode, script=__file__))
                   for mode in ("sync", "async")}
    print(f"load average (1 min) before the run {load:.2f}, after it {os.getloadavg()[0]:.2f}")
    sync, asyn = results["sync"], results["async"]
    print(f"{args.model}: checkpoint of {sync['bytes'] / 2 ** 20:.0f} MiB (the whole sharded folder), tp=2 on 2 CPU processes, "
          f"{sync['saves']} saves in {args.steps} steps")
    print(f"{'':44}{'sync':>10}{'async':>10}{'async/sync':>12}")
    for key, label in (("stall_median", "stall per save (median)"), ("stall_max", "stall per save (max)"),
                       ("wait_median", "  of which waiting for the previous save"),
                       ("rest_median", "  the stall without that wait (median)"),
                       ("step_median", "step time (median)"), ("total", "fit, saves included")):
        ratio = asyn[key] / sync[key] if sync[key] else float("nan")
        print(f"{label:44}{sync[key]:>9.3f}s{asyn[key]:>9.3f}s{ratio:>12.2f}")
    print(f"{'background write, save to publish (median)':44}{'':>10}{asyn['write_median']:>9.3f}s")
    print(f"stalls, save by save: sync {' '.join(f'{s:.3f}' for s in sync['stalls'])}; "
          f"async {' '.join(f'{s:.3f}' for s in asyn['stalls'])}")
    if args.profile:
        for mode, res in results.items():
            print(f"{mode}: parts of the stall (slowest rank, median over saves)")
            for key, value in res["parts"].items():
                print(f"  {key:52}{value:>8.3f}s")
            for key, value in res["written"].items():
                print(f"  background: {key:40}{value:>8.3f}s")


if __name__ == "__main__":
    main()
