"""DeepSpeed PipelineEngine on the work of benchmarks/pipeline.py (not a test), to compare our pipeline with it.

Same GPT (examples/gpt.py, SHAPE below), batch 64 in 8 micro-batches, pp=2 split 4/4 blocks (embeddings with the
first stage, final norm and head with the last), AdamW(lr=3e-3), fp32, no ZeRO, one thread per process, gloo on
CPU. As in the hand-written torch pipelining of benchmarks/pipeline.py, the tied embedding/head weight is one copy
per stage, not synchronised. DeepSpeed's schedule (TrainSchedule) is 1F1B.

DeepSpeed goes in its own venv so that the system torch stays as it is (the constraint keeps pip from pulling
another torch; no ops are built at install, DeepSpeed JIT-builds its shared-memory comm op with g++ on first use):

    python -m venv --system-site-packages /tmp/dsvenv
    echo "torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])')" > /tmp/ds-constraints.txt
    /tmp/dsvenv/bin/pip install -c /tmp/ds-constraints.txt deepspeed

    /tmp/dsvenv/bin/python benchmarks/deepspeed_pipeline.py --out /tmp/ds.json       # STEPS/WARMUP of pipeline.py
    /tmp/dsvenv/bin/python benchmarks/deepspeed_pipeline.py --steps 3 --warmup 1     # smoke run

From another interpreter: ``run_deepspeed(out_dir, steps, warmup, python="/tmp/dsvenv/bin/python")`` (or set
DS_PYTHON) returns the median step time of the slowest rank in seconds, or None if that python has no deepspeed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline import BATCH, LR, MICRO, SHAPE, STEPS, WARMUP, _launch  # the same work as benchmarks/pipeline.py


def _has_deepspeed(python: str) -> bool:
    if python == sys.executable:
        return importlib.util.find_spec("deepspeed") is not None
    return subprocess.run([python, "-c", "import importlib.util as u; assert u.find_spec('deepspeed')"],
                          capture_output=True, check=False).returncode == 0


def run_deepspeed(out_dir: Path, steps: int = STEPS, warmup: int = WARMUP, *, python: str | None = None,
                  timeout: float = 600) -> float | None:
    """Launch 2 ranks of the DeepSpeed pipeline; the slowest rank's median step time (s), None without deepspeed."""
    python = python or os.environ.get("DS_PYTHON", sys.executable)
    if not _has_deepspeed(python):
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = _launch("worker", 2, out_dir, ["--steps", str(steps)], name="deepspeed", python=python, script=__file__,
                   env={"DS_ACCELERATOR": "cpu"}, timeout=timeout)
    return max(statistics.median(r["step"][warmup:]) for r in runs)


def _worker(args: argparse.Namespace) -> None:
    """One rank: PipelineModule(embeddings + blocks 0-3 | blocks 4-7 + norm + head), engine.train_batch per step."""
    import deepspeed
    import torch
    import torch.nn.functional as F
    from deepspeed.pipe import PipelineModule
    from torch import nn

    from gpt import GPT

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = GPT(**SHAPE)

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = model.wte, model.wpe

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.ln_f(x))

    layers = [Embed(), *model.blocks, Head()]  # 10 layers, uniform: [Embed, 4 blocks] | [4 blocks, Head]
    module = PipelineModule(layers=layers, num_stages=2, partition_method="uniform",
                            loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    assert module.parts == [0, 5, 10], module.parts
    config = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": BATCH // MICRO, "zero_optimization": {"stage": 0},
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=LR)
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=config)

    g = torch.Generator().manual_seed(0)  # the data of benchmarks/pipeline.py, fed as micro-batches
    ids = torch.randint(0, SHAPE["vocab"], (BATCH * args.steps, SHAPE["block_size"] + 1), generator=g)
    data = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])
    data_iter = iter(torch.utils.data.DataLoader(data, batch_size=MICRO))
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = engine.train_batch(data_iter)
        times.append(time.perf_counter() - start)
    rank = int(os.environ["RANK"])
    (Path(args.out) / f"deepspeed.{rank}.json").write_text(json.dumps({"step": times, "loss": float(loss)}))
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="main")
    parser.add_argument("--out", default=None, help="main: JSON file for the result; worker: folder")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    args = parser.parse_args()
    if args.role == "worker":
        return _worker(args)
    median = run_deepspeed(Path(tempfile.mkdtemp(prefix="ds-bench-")), args.steps, args.warmup)
    if median is None:
        print("deepspeed is not installed in this python; see the docstring (python benchmarks/deepspeed_pipeline.py "
              "--help) for the install command. Nothing measured.")
        return
    result = {"deepspeed_pipeline_median_step_s": median, "steps": args.steps, "warmup": args.warmup,
              "batch": BATCH, "microbatches": MICRO, "pp": 2, "shape": SHAPE}
    print(f"DeepSpeed PipelineEngine, GPT {SHAPE}, batch {BATCH}, pp=2, {MICRO} micro-batches, one thread per "
          f"process: median step {median * 1000:.1f} ms (slowest rank, {args.steps - args.warmup} timed steps)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
