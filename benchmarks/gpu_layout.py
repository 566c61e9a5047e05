"""Issue #32, item 6, on one GPU: the block-time model calibrated for a ~1 B-parameter Llama at tp = pp = 1 (bf16),
and ``estimate_memory`` for that one rank against ``torch.cuda.max_memory_allocated``.

What it runs, in one process:

1. the blocks, the ends (embedding, final norm, head, loss) and an AdamW step timed as ``layout="auto"`` times them
   at setup (``layout.strategy.block_times``), and each block's forward and backward FLOP rate against the
   datasheet peak that the paper tables assume (``DeviceSpec.flops * efficiency``);
2. a plain PyTorch loop (forward, backward, AdamW, no Lightning) at the same batch: its step time and peak;
3. ``Trainer(strategy=TensorPipeStrategy(layout="auto"), precision="bf16-true")``: the chosen layout, its predicted
   step time by part beside the measured step (median after warm-up, each hook's span), and the peak memory of the
   steps against ``estimate_memory`` of that layout (and the search's own arithmetic, ``LayoutMemory``).

``python benchmarks/gpu_layout.py --out DIR`` (a GPU); ``--tiny`` runs the same on CPU with a small Llama (what
CI's machine can check). Every phase is written to ``DIR/gpu_layout.json`` as soon as it ends, so a phase that
fails leaves the others' figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# Llama-3.2-1B's shape (1.24 B parameters, the embedding tied to the head); --tiny: a small one for CPU
FULL = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8)
TINY = dict(vocab_size=1024, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2)


def build(args: argparse.Namespace, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = TINY if args.tiny else FULL
    config = LlamaConfig(**shape, max_position_embeddings=args.seq, tie_word_embeddings=True, rope_theta=500000.0,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


def lit(args: argparse.Namespace, dtype: torch.dtype) -> Any:
    from layout import lit_module  # benchmarks/layout.py: this script's folder is on sys.path

    return lit_module(build(args, dtype), args.batch, args.seq, lr=1e-5)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if s else float("nan")


def phase_blocks(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, out: dict) -> None:
    from lightning_tpp.layout import DEVICES, profile_model
    from lightning_tpp.layout.strategy import block_times

    module = lit(args, dtype)
    profile = profile_model(module, seq_len=args.seq, dtype=dtype)
    start = time.perf_counter()
    times = block_times(module, profile, args.batch, device=device, dtype=dtype, local_processes=1, together=False)
    spent = time.perf_counter() - start
    peak = DEVICES["h200"].flops
    rows = []
    for (kind, mb), (f, b) in sorted(times.measured.items()):
        flops = next(p.flops.whole for p in profile.blocks if p.kind == kind) * mb
        rows.append({"kind": kind, "sequences": mb, "forward_ms": f * 1e3, "backward_ms": b * 1e3,
                     "forward_tflops": flops / f / 1e12 if f else None,
                     "backward_tflops": 2 * flops / b / 1e12 if b else None,
                     "forward_of_peak": flops / f / peak if f else None,
                     "backward_of_peak": 2 * flops / b / peak if b else None})
    ends = {mb: {"forward_ms": f * 1e3, "backward_ms": b * 1e3} for mb, (f, b) in sorted(times.ends.items())}
    whole_flops = sum(p.flops.whole for p in profile.blocks) + profile.end_flops.whole
    out["blocks"] = {"timing_seconds": spent, "blocks": rows, "ends": ends, "n_blocks": profile.n_blocks,
                     "block_flops_per_sequence": profile.blocks[0].flops.whole,
                     "end_flops_per_sequence": profile.end_flops.whole, "model_flops_per_sequence": whole_flops,
                     "optimizer": times.optimizer, "copy_s_per_byte": times.copy,
                     "whole_params": profile.whole_params}


def phase_plain(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, out: dict) -> None:
    model = build(args, dtype).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    steps = []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    static = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    for i in range(args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
        sync(device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        steps.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    out["plain"] = {"step_ms": median(steps[args.warmup:]) * 1e3, "steps_ms": [s * 1e3 for s in steps],
                    "peak_bytes": peak, "params_bytes_at_start": static}
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()


def phase_strategy(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, out: dict) -> None:
    import lightning as L

    from lightning_tpp import TensorPipeStrategy
    from lightning_tpp.memory import estimate_memory

    marks: list[dict] = []
    peaks: list[int] = []

    class Timer(L.Callback):  # the step and its parts as Lightning's hooks cut it; the peak of each step
        def _mark(self, key: str) -> None:
            sync(device)
            marks[-1][key] = time.perf_counter()

        def on_train_batch_start(self, *a) -> None:
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            marks.append({"start": time.perf_counter()})

        def on_before_backward(self, *a) -> None:
            self._mark("backward")

        def on_after_backward(self, *a) -> None:
            self._mark("reduce")

        def on_before_optimizer_step(self, *a) -> None:
            self._mark("optimizer")

        def on_train_batch_end(self, *a) -> None:
            self._mark("end")
            peaks.append(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0)

    module = lit(args, dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, module.model.config.vocab_size, (args.batch * (args.steps + 1), args.seq), generator=g)
    strategy = TensorPipeStrategy(layout="auto", print_plan=False, pipeline_metrics=False)
    trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, strategy=strategy,
                        precision="bf16-true", max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Timer()],
                        limit_val_batches=0, num_sanity_val_steps=0)
    start = time.perf_counter()
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=args.batch))
    fit_seconds = time.perf_counter() - start
    ranking = strategy.layout_ranking
    best = ranking.best
    kept = marks[args.warmup:] or marks
    order = ("start", "backward", "reduce", "optimizer", "end")
    parts = {}
    for a, b in zip(order, order[1:]):
        spans = [m[b] - m[a] for m in kept if a in m and b in m]
        parts[a if a != "start" else "forward"] = median(spans) * 1e3 if spans else None
    step = median([m["end"] - m["start"] for m in kept]) * 1e3
    chosen = best.layout
    out["strategy"] = {"fit_seconds": fit_seconds, "table": ranking.table(top=5), "why": ranking.why(),
                       "chosen": chosen.describe(), "predicted_step_ms": best.time.total * 1e3,
                       "predicted_parts_ms": {k: v * 1e3 for k, v in best.time.__dict__.items() if k != "samples"},
                       "measured_step_ms": step, "measured_parts_ms": parts,
                       "predicted_over_measured": best.time.total * 1e3 / step,
                       "recorded": str(trainer.strategy.parallel_state.layout.describe()),
                       "peak_bytes": max(peaks[args.warmup:] or peaks), "peaks": peaks,
                       "search_memory_bytes": best.memory.total,
                       "search_memory_parts": {k: v for k, v in best.memory.__dict__.items()}}
    write(out, args)
    with torch.device("meta"):
        meta = build(args, dtype)
    report = estimate_memory(meta, tp=chosen.tp, pp=chosen.pp, dp=chosen.dp, batch_size=args.batch,
                             seq_len=args.seq, param_dtype=dtype, optimizer="adamw",
                             activation_checkpointing=chosen.activation_checkpointing,
                             backend="nccl" if device.type == "cuda" else "gloo")
    rank = report.largest
    measured = out["strategy"]["peak_bytes"]
    out["estimate"] = {"report": str(report), "total_bytes": rank.total,
                       "over_measured": rank.total / measured if measured else None,
                       "search_over_measured": best.memory.total / measured if measured else None}


def write(out: dict, args: argparse.Namespace) -> None:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_layout.json").write_text(json.dumps(out, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tiny", action="store_true", help="a small Llama on CPU (the script's own check)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--phases", default="blocks,plain,strategy")
    args = parser.parse_args()
    args.batch = args.batch or (2 if args.tiny else 4)
    args.seq = args.seq or (32 if args.tiny else 2048)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.bfloat16
    import lightning
    import transformers
    out: dict = {"versions": {"torch": torch.__version__, "lightning": lightning.__version__,
                              "transformers": transformers.__version__},
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "shape": {**(TINY if args.tiny else FULL), "batch": args.batch, "seq": args.seq}, "errors": {}}
    phases: dict[str, Callable] = {"blocks": phase_blocks, "plain": phase_plain, "strategy": phase_strategy}
    for name in args.phases.split(","):
        start = time.perf_counter()
        try:
            phases[name](args, device, dtype, out)
        except Exception:  # the other phases' figures still come back
            out["errors"][name] = traceback.format_exc()
            print(out["errors"][name], file=sys.stderr, flush=True)
        out.setdefault("seconds", {})[name] = time.perf_counter() - start
        write(out, args)
        print(f"phase {name}: {time.perf_counter() - start:.1f} s", flush=True)
    print(json.dumps({k: v for k, v in out.items() if k not in ("errors",)}, indent=1, default=str)[:6000])
    for name, err in out["errors"].items():
        print(f"--- {name} failed:\n{err[-2000:]}")


if __name__ == "__main__":
    main()
