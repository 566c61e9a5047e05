"""Pipeline benchmark (not a test): ratios measured side by side in one run on this machine.

    python benchmarks/pipeline.py            # about 16 minutes on 2 cores (3 rounds)
    python benchmarks/pipeline.py --quick    # one round, fewer steps
    python benchmarks/pipeline.py --eval     # 3. only (about 10 minutes; --quick: 3)
    DS_PYTHON=/tmp/dsvenv/bin/python python benchmarks/pipeline.py   # with DeepSpeed (benchmarks/deepspeed_pipeline.py)

1. Step time of one GPT-style model (the one in examples/gpt.py, larger) with pp=2 and 8 micro-batches:
   - TensorPipeStrategy under the Trainer, with 1F1B, zero-bubble, zb-drain, zb-lead and "auto", the default (which
     measures its first three steps with zb-drain, then runs the schedule it chose),
   - hand-written torch.distributed.pipelining (PipelineStage + Schedule1F1B) on the same split, no Trainer,
   - DeepSpeed's PipelineEngine on the same split, when a python with deepspeed is given (DS_PYTHON),
   - one process (Trainer, no strategy).
   Every process uses one thread, so pp=2 uses 2 cores and one process 1 core: the ideal speedup at m=8 is
   2 / (1 + 1/8) = 1.78.
2. The measured bubble (idle fraction per rank) of each schedule, with blocks whose forward and weight gradient are
   one square matrix product each and whose input gradient sleeps as long (F = I = W), against the theory
   (p-1)/(m*v+p-1), or the schedule simulator for zero-bubble, zb-drain and zb-lead.
   Then the fixed schedules once more, alternated step by step in one run (``--role alternate``): each ratio
   compares steps seconds apart, which this machine's drift between runs minutes apart does not move.
3. ``--eval``: time per validation batch of the same GPT with pp=2: the whole batch as one micro-batch through the
   stages one after the other (``TPP_EVAL_WHOLE_BATCH=1``, the path before evaluation was micro-batched) against
   8 micro-batches (the stages at work at once), and one process; first with stages of controlled cost (sleeps in
   proportion to the micro-batch's samples), which other work on the machine does not change.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS, WARMUP = 9, 3
SHAPE = dict(vocab=512, block_size=128, n_embd=256, n_head=8, n_layer=8)
BATCH, MICRO = 64, 8
LR = 3e-3


# ----------------------------------------------------------------------------------------------------------------
# launching


def _launch(role: str, nprocs: int, out: Path, extra: list[str], *, name: str | None = None,
            independent: bool = False, timeout: float = 600, python: str = sys.executable, script: str = __file__,
            env: dict[str, str] | None = None) -> list[dict]:
    """``nprocs`` ranks of one job, or (``independent``) ``nprocs`` separate one-process jobs at the same time; each
    rank runs ``python script --role role`` and writes ``{name or role}.{rank}.json`` to ``out``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(nprocs):
        rank_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                    "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs), "NODE_RANK": "0", "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'examples'}{os.pathsep}{ROOT / 'benchmarks'}",
                    **(env or {})}
        if nprocs == 1 or independent:
            for k in ("MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
                rank_env.pop(k)
            rank_env["BENCH_JOB"] = str(rank)
        procs.append(subprocess.Popen([python, script, "--role", role, "--out", str(out), *extra],
                                      env=rank_env, start_new_session=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
            raise SystemExit(f"{role} timed out")
    if any(p.returncode for p in procs):
        raise SystemExit(f"{role} failed:\n" + "\n".join(o[-3000:] for o in outputs))
    return [json.loads((out / f"{name or role}.{r}.json").read_text()) for r in range(nprocs)]


def _save(out: Path, role: str, rank: int, data: dict) -> None:
    (out / f"{role}.{rank}.json").write_text(json.dumps(data))


# ----------------------------------------------------------------------------------------------------------------
# roles (each runs in its own processes)


def _data(steps: int):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SHAPE["vocab"], (BATCH * steps, SHAPE["block_size"] + 1), generator=g)
    return torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])


class _StepTimer:
    def __init__(self) -> None:
        self.times: list[float] = []

    def callback(self):
        import lightning as L

        timer = self

        class StepTimer(L.Callback):
            def on_train_batch_start(self, *args) -> None:
                timer._start = time.perf_counter()

            def on_train_batch_end(self, *args) -> None:
                timer.times.append(time.perf_counter() - timer._start)

        return StepTimer()


def role_trainer(args: argparse.Namespace) -> None:
    """One process (no strategy) or TensorPipeStrategy(pp=2) under the Trainer."""
    import lightning as L
    import torch
    from gpt import GPT

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    model = GPT(**SHAPE)
    timer = _StepTimer()
    strategy, devices = "auto", 1
    if args.role == "ours":
        from lightning_tpp import TensorPipeStrategy

        strategy = TensorPipeStrategy(pp=2, microbatches=MICRO, schedule=args.schedule, print_plan=False,
                                      virtual_stages=2 if args.schedule == "interleaved-1f1b" else 1)
        devices = 2
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer.callback()])
    trainer.fit(model, torch.utils.data.DataLoader(_data(args.steps), batch_size=BATCH))
    engine = getattr(trainer.strategy, "_engine", None)  # the schedule that ran last ("auto": the one it chose)
    _save(Path(args.out), args.role, int(os.environ.get("BENCH_JOB", trainer.global_rank)),
          {"step": timer.times, "schedule": getattr(engine, "schedule", None)})


def role_eval(args: argparse.Namespace) -> None:
    """``trainer.validate`` of the GPT (its validation_step: the loss, logged) with pp=2, or in one process."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from gpt import GPT

    class EvalGPT(GPT):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x).flatten(0, 1), y.flatten()), sync_dist=True)

    class Timer(L.Callback):
        def on_validation_batch_start(self, *args) -> None:
            self.start = time.perf_counter()

        def on_validation_batch_end(self, *args) -> None:
            times.append(time.perf_counter() - self.start)

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    times: list[float] = []
    strategy, devices = "auto", 1
    if args.role == "eval-ours":
        from lightning_tpp import TensorPipeStrategy

        strategy, devices = TensorPipeStrategy(pp=2, microbatches=MICRO, print_plan=False), 2
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Timer()])
    trainer.validate(EvalGPT(**SHAPE), torch.utils.data.DataLoader(_data(args.steps), batch_size=BATCH),
                     verbose=False)
    _save(Path(args.out), args.name or args.role, int(os.environ.get("BENCH_JOB", trainer.global_rank)),
          {"step": times})


def role_eval_sleep(args: argparse.Namespace) -> None:
    """``trainer.validate`` with pp=2 of 4 blocks whose forward sleeps in proportion to its micro-batch's samples
    (``args.product_seconds`` for the whole batch): a stage's cost that other work on this machine cannot change."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lightning_tpp import TensorPipeStrategy

    seconds = args.product_seconds

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.eye(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(seconds * x.shape[0] / BATCH)
            return F.linear(x, self.weight)

    class Blocks(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(4)])

        def validation_step(self, batch, batch_idx):
            x = batch[0]
            for b in self.blocks:
                x = b(x)
            self.log("val_loss", F.mse_loss(x, torch.zeros_like(x)))

    class Timer(L.Callback):
        def on_validation_batch_start(self, *a) -> None:
            self.start = time.perf_counter()

        def on_validation_batch_end(self, *a) -> None:
            times.append(time.perf_counter() - self.start)

    times: list[float] = []
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=TensorPipeStrategy(pp=2, microbatches=MICRO,
                                                                                  print_plan=False),
                        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Timer()])
    data = torch.utils.data.TensorDataset(torch.randn(BATCH * args.steps, 4))
    trainer.validate(Blocks(), torch.utils.data.DataLoader(data, batch_size=BATCH), verbose=False)
    _save(Path(args.out), args.name, trainer.global_rank, {"step": times})


def run_eval_benchmark(out: Path, steps: int, rounds: int) -> None:
    """Rounds of (whole batch, micro-batched, one process) one after the other; medians over rounds."""
    warm = 2
    med = lambda runs: max(statistics.median(r["step"][warm:]) for r in runs)  # noqa: E731 - slowest rank
    extra = ["--steps", "6", "--product-seconds", "0.2"]
    sleep = {name: med(_launch("eval-sleep", 2, out, extra + ["--name", name], name=name, env=env))
             for name, env in (("sleep-whole", {"TPP_EVAL_WHOLE_BATCH": "1"}), ("sleep-micro", {}))}
    print(f"Validation with pp=2, stages of controlled cost (2 blocks each, sleeping 0.2 s per block and batch of "
          f"{BATCH}, in proportion to a micro-batch's samples): whole batch {sleep['sleep-whole'] * 1000:.1f} ms, "
          f"{MICRO} micro-batches {sleep['sleep-micro'] * 1000:.1f} ms; speedup "
          f"{sleep['sleep-whole'] / sleep['sleep-micro']:.3f} (limit 2 / (1 + 1/{MICRO}) = {2 / (1 + 1 / MICRO):.3f})",
          flush=True)
    rows = []
    for r in range(rounds):
        extra = ["--steps", str(steps)]
        row = {"whole": med(_launch("eval-ours", 2, out, extra + ["--name", "whole"], name="whole",
                                    env={"TPP_EVAL_WHOLE_BATCH": "1"})),
               "micro": med(_launch("eval-ours", 2, out, extra + ["--name", "micro"], name="micro")),
               "single": med(_launch("eval-single", 1, out, extra))}
        rows.append(row)
        print(f"  round {r}: " + "  ".join(f"{k} {v * 1000:.1f} ms" for k, v in row.items()), flush=True)
    t = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    print(f"Validation, GPT {SHAPE}, batch {BATCH}, pp=2, one thread per process; time per validation batch")
    print(f"  pp=2, whole batch as one micro-batch (before)   {t['whole'] * 1000:8.1f} ms")
    print(f"  pp=2, {MICRO} micro-batches                       {t['micro'] * 1000:8.1f} ms")
    print(f"  one process                                     {t['single'] * 1000:8.1f} ms")
    print(f"  micro-batched speedup over whole batch = {statistics.median(r['whole'] / r['micro'] for r in rows):.3f}"
          f" (per round {[round(r['whole'] / r['micro'], 3) for r in rows]}); over one process "
          f"{statistics.median(r['single'] / r['micro'] for r in rows):.3f}, whole batch over one process "
          f"{statistics.median(r['single'] / r['whole'] for r in rows):.3f}")


ALTERNATED = ("1f1b", "zb-drain", "zb-lead", "zero-bubble")


def role_alternate(args: argparse.Namespace) -> None:
    """One run of TensorPipeStrategy(pp=2) switching schedule every step, in turn through :data:`ALTERNATED` (the
    engine switches between steps as ``"auto"`` does): each schedule's step times, after two warm-up steps."""
    import lightning as L
    import torch
    from gpt import GPT

    from lightning_tpp import TensorPipeStrategy

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    times: dict[str, list[float]] = {s: [] for s in ALTERNATED}

    class Alternate(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.schedule = ALTERNATED[batch_idx % len(ALTERNATED)]
            trainer.strategy._engine.switch(self.schedule)
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx >= 2:
                times[self.schedule].append(time.perf_counter() - self.start)

    steps = 2 + args.steps * len(ALTERNATED)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_checkpointing=False,
                        strategy=TensorPipeStrategy(pp=2, microbatches=MICRO, schedule="1f1b", print_plan=False),
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Alternate()])
    trainer.fit(GPT(**SHAPE), torch.utils.data.DataLoader(_data(steps), batch_size=BATCH))
    _save(Path(args.out), args.role, trainer.global_rank, times)


def role_torchpp(args: argparse.Namespace) -> None:
    """Hand-written torch.distributed.pipelining on the same split (blocks 0-3 | 4-7 + head), same optimizer."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from gpt import GPT
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(**SHAPE)
    half = SHAPE["n_layer"] // 2

    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe, self.blocks = model.wte, model.wpe, model.blocks[:half]

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for b in self.blocks:
                x = b(x)
            return x

    class Last(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks, self.ln_f, self.lm_head = model.blocks[half:], model.ln_f, model.lm_head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return self.lm_head(self.ln_f(x))

    module = First() if rank == 0 else Last()
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=MICRO,
                            loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(_data(args.steps), batch_size=BATCH)
    times = []
    for x, y in loader:
        start = time.perf_counter()
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        opt.step()
        times.append(time.perf_counter() - start)
    _save(Path(args.out), args.role, rank, {"step": times})
    dist.destroy_process_group()


def role_bubble(args: argparse.Namespace) -> None:
    """Blocks whose forward and weight gradient are one square matrix product each (the same size: F = W) and whose
    input gradient sleeps as long (I = F). The activations sent between stages are tiny."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lightning_tpp import TensorPipeStrategy

    size, i_seconds = args.size, args.product_seconds

    class InputGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            time.sleep(i_seconds)
            return g

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(size, size) / size)
            self.register_buffer("operand", torch.randn(size, size))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # the product is only on the weight's path: its weight gradient is W work, the sleep is the input path's
            return InputGrad.apply(x) + 0.0 * F.linear(self.operand, self.weight).sum()

    class Blocks(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(4)])
            self.scale = nn.Parameter(torch.ones(()))  # so that the first block's input needs a gradient too

        def training_step(self, batch, batch_idx):
            x = batch[0] * self.scale
            for b in self.blocks:
                x = b(x)
            return F.mse_loss(x, torch.zeros_like(x))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    torch.set_num_threads(1)
    virtual = 2 if args.schedule == "interleaved-1f1b" else 1
    strategy = TensorPipeStrategy(pp=2, microbatches=MICRO, schedule=args.schedule, virtual_stages=virtual,
                                  print_plan=False)
    steps = 4
    data = torch.utils.data.TensorDataset(torch.randn(MICRO * steps, 4))

    class Trace(L.Callback):
        def on_train_batch_start(self, trainer, *a) -> None:
            trainer.strategy._engine.record_trace(True)

        def on_train_batch_end(self, trainer, *a) -> None:
            trace = trainer.strategy._engine.trace
            span = torch.tensor([min(t[3] for t in trace), -max(t[4] for t in trace)], dtype=torch.float64)
            torch.distributed.all_reduce(span, op=torch.distributed.ReduceOp.MIN)  # the step on every rank
            busy = sum(t[4] - t[3] - t[5] for t in trace)
            idle.append(1.0 - busy / float(-span[1] - span[0]))

    idle: list[float] = []
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Trace()])
    trainer.fit(Blocks(), torch.utils.data.DataLoader(data, batch_size=MICRO))
    _save(Path(args.out), f"bubble-{args.schedule}", trainer.global_rank, {"idle": idle[1:]})


def _product_size(seconds: float) -> tuple[int, float]:
    """The side of a square matrix product that takes about ``seconds`` on one thread here (the time grows as its
    cube), and what it takes."""
    import torch

    torch.set_num_threads(1)
    side, took = 256, seconds
    for _ in range(4):
        a = torch.randn(side, side)
        a @ a  # noqa: B018 - warm-up
        start = time.perf_counter()
        for _ in range(5):
            a @ a  # noqa: B018
        took = (time.perf_counter() - start) / 5
        side = max(32, round(side * (seconds / took) ** (1 / 3)))
    return side, took


# ----------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="main")
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=512, help="bubble blocks: side of the square product")
    parser.add_argument("--product-seconds", type=float, default=0.01, help="bubble blocks: what the product takes")
    parser.add_argument("--eval", action="store_true", help="only the validation benchmark (3.)")
    parser.add_argument("--name", default=None, help="the name a role's results are saved under")
    args = parser.parse_args()
    if args.role in ("single", "ours"):
        return role_trainer(args)
    if args.role in ("eval-single", "eval-ours"):
        return role_eval(args)
    if args.role == "eval-sleep":
        return role_eval_sleep(args)
    if args.role == "torchpp":
        return role_torchpp(args)
    if args.role == "bubble":
        return role_bubble(args)
    if args.role == "alternate":
        return role_alternate(args)

    steps = 6 if args.quick else args.steps
    warm = 2 if args.quick else WARMUP
    out = Path(tempfile.mkdtemp(prefix="tpp-bench-"))
    if args.eval:
        return run_eval_benchmark(out, steps, 1 if args.quick else args.rounds)
    med = lambda runs: max(statistics.median(r["step"][warm:]) for r in runs)  # noqa: E731 - slowest rank
    from deepspeed_pipeline import run_deepspeed

    # rounds of (ours, hand-written, DeepSpeed) one after the other: each ratio compares runs minutes apart at most,
    # and the median over rounds damps this machine's drift
    rows: list[dict[str, float]] = []
    for r in range(1 if args.quick else args.rounds):
        row = {"ours": med(_launch("ours", 2, out, ["--steps", str(steps)])),
               "torch": med(_launch("torchpp", 2, out, ["--steps", str(steps)])),
               "ours-zb": med(_launch("ours", 2, out, ["--steps", str(steps), "--schedule", "zero-bubble"])),
               "ours-zbd": med(_launch("ours", 2, out, ["--steps", str(steps), "--schedule", "zb-drain"])),
               "ours-zbl": med(_launch("ours", 2, out, ["--steps", str(steps), "--schedule", "zb-lead"])),
               "ours-auto": med(auto := _launch("ours", 2, out, ["--steps", str(steps), "--schedule", "auto"])),
               "single": med(_launch("single", 1, out, ["--steps", str(steps)]))}
        ds = run_deepspeed(out / f"ds{r}", steps, warm)
        if ds is not None:
            row["deepspeed"] = ds
        rows.append(row)
        print(f"  round {r}: " + "  ".join(f"{k} {v * 1000:.1f} ms" for k, v in row.items())
              + f"  (auto chose {auto[0].get('schedule')})", flush=True)
    t_single = statistics.median(row["single"] for row in rows)
    # what two processes can do on this machine at all: two independent one-process runs at the same time
    t_pair = med(_launch("single", 2, out, ["--steps", str(steps)], independent=True))
    t_ours = statistics.median(row["ours"] for row in rows)
    vs_torch = statistics.median(row["ours"] / row["torch"] for row in rows)
    print(f"GPT {SHAPE}, batch {BATCH}, pp=2, {MICRO} micro-batches, one thread per process")
    print(f"  step time  TensorPipeStrategy+Trainer {t_ours * 1000:8.1f} ms")
    print(f"             torch pipelining by hand   {statistics.median(r['torch'] for r in rows) * 1000:8.1f} ms")
    print(f"             one process (Trainer)      {t_single * 1000:8.1f} ms")
    print(f"  ours / hand-written pipelining = {vs_torch:.3f}   (goal <= 1.03; per round "
          f"{[round(r['ours'] / r['torch'], 3) for r in rows]})")
    for name, key in (("zero-bubble", "ours-zb"), ("zb-drain", "ours-zbd"), ("zb-lead", "ours-zbl"),
                      ("auto", "ours-auto")):
        print(f"             ours, {name:11s} schedule {statistics.median(r[key] for r in rows) * 1000:8.1f} ms   "
              f"(ours 1F1B / {name} = {statistics.median(r['ours'] / r[key] for r in rows):.3f}; per round "
              f"{[round(r['ours'] / r[key], 3) for r in rows]})")
    if all("deepspeed" in r for r in rows):
        t_ds = statistics.median(r["deepspeed"] for r in rows)
        print(f"             DeepSpeed PipelineEngine   {t_ds * 1000:8.1f} ms   (1F1B, its only schedule)")
        for name, key in (("1F1B", "ours"), ("zero-bubble", "ours-zb"), ("zb-drain", "ours-zbd"),
                          ("zb-lead", "ours-zbl"), ("auto", "ours-auto")):
            goal = "goal >= 1.05 for the default, auto; " if key == "ours-auto" else ""
            print(f"  DeepSpeed / ours ({name:11s}) = {statistics.median(r['deepspeed'] / r[key] for r in rows):.3f}"
                  f"   ({goal}per round {[round(r['deepspeed'] / r[key], 3) for r in rows]})")
    else:
        print("  DeepSpeed PipelineEngine: not installed (see benchmarks/deepspeed_pipeline.py; DS_PYTHON=...)")
    print(f"             one process, two at once   {t_pair * 1000:8.1f} ms")
    speedup = statistics.median(r["single"] / r["ours"] for r in rows)
    print(f"  speedup over one process       = {speedup:.3f}   (goal >= 1.70, limit 1.78 for 1F1B; per round "
          f"{[round(r['single'] / r['ours'], 3) for r in rows]}); hand-written "
          f"{statistics.median(r['single'] / r['torch'] for r in rows):.3f}, zero-bubble "
          f"{statistics.median(r['single'] / r['ours-zb'] for r in rows):.3f}, zb-drain "
          f"{statistics.median(r['single'] / r['ours-zbd'] for r in rows):.3f}, auto "
          f"{statistics.median(r['single'] / r['ours-auto'] for r in rows):.3f}")
    fixed = min(("ours", "ours-zb", "ours-zbd", "ours-zbl"), key=lambda k: statistics.median(r[k] for r in rows))
    print(f"  auto / best fixed schedule ({fixed}) = "
          f"{statistics.median(r['ours-auto'] / r[fixed] for r in rows):.3f}   (goal <= 1.00; per round "
          f"{[round(r['ours-auto'] / r[fixed], 3) for r in rows]})")
    print(f"  this machine's two-process throughput = {2 * t_single / t_pair:.3f} x one process; pipeline "
          f"efficiency against it = {speedup / (2 * t_single / t_pair):.3f}")

    # slowest rank per step (the ranks' steps end together within milliseconds): ratios of steps in the same cycle
    alternated = _launch("alternate", 2, out, ["--steps", str(4 if args.quick else 12)])
    per_step = {s: [max(r[s][k] for r in alternated) for k in range(len(alternated[0][s]))] for s in ALTERNATED}
    print(f"\nAlternated step by step in one run ({len(per_step['1f1b'])} steps each), median step and 1F1B / schedule "
          f"(median over cycles of the ratio of steps in the same cycle):")
    for s in ALTERNATED:
        ratio = statistics.median(a / b for a, b in zip(per_step["1f1b"], per_step[s]))
        print(f"  {s:12s} {statistics.median(per_step[s]) * 1000:8.1f} ms   1F1B / {s} = {ratio:.3f}")

    from lightning_tpp.pipeline.schedule import actions, simulate, theoretical_bubble

    size, took = _product_size(0.010)
    print(f"\nBubble (idle fraction per rank), pp=2, m={MICRO}, stages of 2 blocks: F and W one {size}x{size} matrix "
          f"product each ({took * 1000:.1f} ms here), I a sleep as long")
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zb-drain", "zb-lead"):
        v = 2 if schedule == "interleaved-1f1b" else 1
        runs = _launch("bubble", 2, out, ["--schedule", schedule, "--size", str(size), "--product-seconds", str(took)],
                       name=f"bubble-{schedule}")
        measured = [statistics.median(r["idle"]) for r in runs]
        # a schedule that splits backwards: the simulator (F = I = W); the formula otherwise
        split = any(kind == "I" for kind, _, _ in actions(schedule, 1, 2, MICRO, v))
        theory = simulate(schedule, 2, MICRO, v).bubble if split else [theoretical_bubble(2, MICRO, v)] * 2
        print(f"  {schedule:17s} measured {[f'{m:.3f}' for m in measured]}  theory {[f'{t:.3f}' for t in theory]}")


if __name__ == "__main__":
    main()
