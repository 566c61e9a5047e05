"""Context-parallel benchmark (not a test): memory and step time of ``cp=1, 2, 4`` on 4 processes, side by side.

    python benchmarks/context_parallel.py                 # seq 8192, 4 steps (1 warm-up); about 7 minutes on 2 cores
    python benchmarks/context_parallel.py --quick         # seq 2048, 2 steps: a smoke test (about 5 minutes)
    python benchmarks/context_parallel.py --layouts dp4,tp4,cp2xdp2,cp4   # the four the issue asks for (5 minutes)
    python benchmarks/context_parallel.py --seq 16384 --layouts tp4,cp4 --no-plan   # the step-time ratio, longer
    python benchmarks/context_parallel.py --layouts ""    # the planner only (seconds)

A Hugging Face ``LlamaForCausalLM`` (``_attn_implementation = "sdpa"``: every attention is a call of
``F.scaled_dot_product_attention``, which cp takes over) of tiny width and a long sequence (hidden 128, 4 layers,
4 heads, 2 key/value heads, vocabulary 1024; batch 1 per replica), trained with AdamW through
``Trainer(accelerator="cpu", devices=4, strategy=TensorPipeStrategy(..., verify=False, print_plan=False))`` in 4
CPU processes (gloo, one thread each, so 4 processes share this machine's 2 cores), the same seed on every rank
(``lightning.seed_everything``). One launch per layout, one after the other:

- cp=1: ``dp4`` (each rank the whole sequence, as one process: the reference of the activation ratios at tp=1),
  ``tp4`` (one sequence per step over 4 ranks: the reference of the step-time ratio), ``tp2xdp2`` (the reference at
  tp=2);
- cp=2: ``cp2xdp2``, ``cp2xtp2``;
- cp=4: ``cp4`` (one sequence per step over 4 ranks);
- ``cp_mode="a2a"`` (Ulysses: positions exchanged for heads in each attention): ``cp2xdp2-a2a``, ``cp4-a2a`` (the
  4 query heads, 1 per rank at cp4; the 2 key/value heads repeated to 4);
- on request (``--layouts``): any ``tpN/ppN/cpN`` product of 4 (dp the rest; a pipeline needs as many micro-batches
  as its schedule, which batch 1 does not give).

Per rank (the table gives the largest over the 4 ranks):

- block activ.: the bytes the block stack (``model.model.layers``) saves for backward, counted in the first step by a
  ``saved_tensors_hooks`` around each block's forward (each storage once, parameters excepted). All of what cp's
  attention keeps is counted: on CPU its causal attention saves this rank's queries, keys and values, the output and
  the log-sum-exp, as one process's SDPA does, and gathers the keys and values again in backward;
- peak RSS: ``ru_maxrss`` at the end minus the resident memory at the start of ``fit`` (``MALLOC_MMAP_THRESHOLD_=65536``
  as docs/memory.md advises CPU users, so that freed large blocks leave RSS; set here unless the environment has it):
  everything the rank allocated at its most, the embeddings, head and loss on the whole sequence included (cp cuts
  only the blocks);
- step: the median over the timed steps (after the warm-up ones) of the slowest rank; "per seq." divides it by the
  sequences one step trains (dp of them); "cp attn": of it, the seconds in the attention calls cp takes over
  (forward only: the key/value all-gathers and the per-chunk attention; ``Traffic.attention_seconds``), and the
  bytes each rank sends in them per step.

Ratios: block activations at cp=c over the cp=1 layout of the same tp (goal <= 1.10 / c), and step time of cp4 (each
mode) over the best cp=1 layout that trains one sequence per step on 4 ranks (tp4; goal <= 1.2). Then, with
``estimate_memory`` (the planner, activation checkpointing on, AdamW, fp32, states sharded over dp x cp), the longest
sequence that fits a fixed per-rank budget at dp4 (cp=1), cp2 x dp2 and cp4 (each rank: one sequence's share), found
by bisection, and its growth over cp=1 (goal >= 0.9 x c).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memory import _rss  # resident bytes, read as the memory benchmark reads them
from pipeline import _launch as launch  # the benchmarks' one way to start ranks (this folder is on sys.path)

SHAPE = dict(vocab_size=1024, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
LAYOUTS = "dp4,tp4,tp2xdp2,cp2xdp2,cp2xtp2,cp4,cp2xdp2-a2a,cp4-a2a"
WORLD = 4


def parse_layout(name: str) -> dict[str, Any]:
    """``"cp2xtp2"`` -> ``{"tp": 2, "pp": 1, "dp": 1, "cp": 2}`` (dp takes what the others leave of 4 ranks); a name
    ending in ``-a2a`` adds ``cp_mode="a2a"``."""
    dims: dict[str, Any] = {"tp": 1, "pp": 1, "cp": 1}
    if name.endswith("-a2a"):
        dims["cp_mode"] = "a2a"
    for axis, size in re.findall(r"(tp|pp|dp|cp)(\d+)", name):
        dims[axis] = int(size)
    dims["dp"] = WORLD // (dims["tp"] * dims["pp"] * dims["cp"])
    return dims


class LlamaLM(L.LightningModule):
    """An ordinary LightningModule around a Hugging Face Llama (SDPA attention), built in ``__init__``."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(**SHAPE, max_position_embeddings=seq, tie_word_embeddings=False)
        config._attn_implementation = "sdpa"
        self.model = transformers.LlamaForCausalLM(config)

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids).logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, SHAPE["vocab_size"]), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# measuring inside a rank


def _storage(t: Tensor) -> Any:
    return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()


class _Held:
    """What the saved-tensor hook returns: releases its storage's count when autograd drops it."""

    __slots__ = ("t", "key", "tracker")

    def __init__(self, t: Tensor, key: int, tracker: "BlockActivations") -> None:
        self.t, self.key, self.tracker = t, key, tracker

    def __del__(self) -> None:
        self.tracker.release(self.key)


class BlockActivations:
    """Bytes of the storages the blocks save for backward, alive at once (each storage once, parameters excepted):
    a ``saved_tensors_hooks`` entered by a forward pre-hook and left by a forward hook on each block."""

    def __init__(self) -> None:
        self.params: set[int] = set()
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.now = self.peak = 0
        self.active = False
        self._ctx: Optional[Any] = None

    def attach(self, module: nn.Module, blocks: list[str]) -> None:
        self.params = {_storage(p).data_ptr() for p in module.parameters()}
        for name in blocks:
            block = module.get_submodule(name)
            block.register_forward_pre_hook(self._enter)
            block.register_forward_hook(self._leave)

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self.active and torch.is_grad_enabled() and self._ctx is None:
            self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self._ctx.__enter__()

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def pack(self, t: Tensor) -> Any:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):  # FSDP2's gathered ones included
            return t
        key = _storage(t).data_ptr()
        if key in self.params or key == 0:
            return t
        if self.refs.get(key, 0) == 0:
            self.size[key] = _storage(t).nbytes()
            self.now += self.size[key]
            self.peak = max(self.peak, self.now)
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Held(t, key, self)

    def release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.now -= self.size.pop(key)

    @staticmethod
    def unpack(held: Any) -> Tensor:
        return held.t if isinstance(held, _Held) else held


class Measure(L.Callback):
    """Step times, the block stack's saved bytes in the first step, and the resident peak, written per rank."""

    def __init__(self, out: Path, role: str) -> None:
        self.out, self.role = out, role
        self.start_rss = 0
        self.times: list[float] = []
        self.attention: list[dict[str, float]] = []  # cp's attention calls per step (Traffic)
        self.blocks = BlockActivations()
        self.traffic: Optional[Any] = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.start_rss = _rss()  # before the strategy's setup

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.blocks.attach(pl_module, list(trainer.strategy.parallel_state.blocks))
        context = trainer.strategy.parallel_state.context
        self.traffic = context.traffic if context is not None else None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self.blocks.active = idx == 0  # counted in the first (warm-up) step only: the timed steps run without hooks
        if self.traffic is not None:
            self.traffic.take()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:
        self.times.append(time.perf_counter() - self.start)
        self.blocks.active = False
        if self.traffic is not None:
            self.attention.append(self.traffic.take())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.start_rss
        context = getattr(trainer.strategy.parallel_state, "context", None)
        layout = getattr(context, "layout", None)
        result = dict(step=self.times, attention=self.attention, block_saved=self.blocks.peak, peak=peak,
                      rank=trainer.global_rank,
                      local=layout.local if layout is not None else None)
        (self.out / f"{self.role}.{trainer.global_rank}.json").write_text(json.dumps(result))


def run_rank(args: argparse.Namespace) -> None:
    from lightning_tpp import TensorPipeStrategy

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    dims = parse_layout(args.layout)
    strategy = TensorPipeStrategy(**dims, verify=args.verify, print_plan=False)
    module = LlamaLM(args.seq)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, SHAPE["vocab_size"], (args.steps * dims["dp"], args.seq + 1), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]), batch_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Measure(Path(args.out), args.layout)])
    trainer.fit(module, loader)


# ----------------------------------------------------------------------------------------------------------------
# the planner: the longest sequence a fixed budget holds


def longest_fitting(dims: dict[str, int], budget: float, step: int, ceiling: int) -> tuple[int, Any]:
    """The longest multiple of ``step`` tokens whose ``estimate_memory`` total (largest rank) fits ``budget``
    bytes, by doubling then bisection; with its report."""
    from lightning_tpp import estimate_memory

    with torch.device("meta"):
        module = LlamaLM(step)

    def report(seq: int) -> Any:
        return estimate_memory(module, **dims, batch_size=dims["dp"], seq_len=seq, activation_checkpointing=True,
                               backend="gloo")

    lo, hi = 0, step
    while hi <= ceiling and report(hi).fits(budget):
        lo, hi = hi, 2 * hi
    if lo == 0:
        return 0, None
    hi = min(hi, ceiling + step)
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if report(mid).fits(budget) else (lo, mid)
    return lo, report(lo)


def plan(args: argparse.Namespace) -> None:
    mib = 2 ** 20
    budget = args.budget_mib * mib
    print(f"\nplanner (estimate_memory, activation checkpointing on, AdamW fp32, states sharded over dp x cp, 4 ranks, "
          f"one sequence per replica): the longest sequence that fits {args.budget_mib:.0f} MiB per rank "
          f"(multiples of {args.plan_step} tokens)", flush=True)
    print(f"  {'layout':>8} {'cp':>3} | {'longest seq':>11} {'x cp=1':>6} {'goal':>14} | {'states':>6} "
          f"{'activ.':>6} {'saved':>6} {'recomp.':>7} {'loss':>6} {'gathered':>8} {'total':>6} MiB | {'s':>4}")
    base = None
    for name in ("dp4", "cp2xdp2", "cp4"):
        dims = parse_layout(name)
        start = time.monotonic()
        try:
            seq, rep = longest_fitting(dims, budget, args.plan_step, args.plan_ceiling)
        except Exception as err:  # noqa: BLE001 - a planner failure is reported, the other layouts go on
            print(f"  {name:>8} {dims['cp']:>3} | FAILED: {type(err).__name__}: {err}", flush=True)
            continue
        if rep is None:
            print(f"  {name:>8} {dims['cp']:>3} | nothing fits (not even {args.plan_step} tokens)")
            continue
        base = seq if dims["cp"] == 1 else base
        r = rep.largest
        growth = seq / base if base else float("nan")  # nan: the cp=1 search failed
        cap = " (ceiling)" if seq + args.plan_step > args.plan_ceiling else ""
        goal = f">= {0.9 * dims['cp']:.1f}" + ("" if dims["cp"] == 1 else " met" if growth >= 0.9 * dims["cp"]
                                                else " NOT met")
        print(f"  {name:>8} {dims['cp']:>3} | {seq:>11}{cap} {growth:6.2f} {goal:>14} | {r.states / mib:6.1f} "
              f"{r.activations / mib:6.1f} {(r.activations - r.recompute - r.transient) / mib:6.1f} "
              f"{r.recompute / mib:7.1f} {r.transient / mib:6.1f} {r.gathered / mib:8.1f} {r.total / mib:6.1f}     | "
              f"{time.monotonic() - start:4.0f}", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# the driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="driver", choices=("driver", "rank"))
    parser.add_argument("--out", default=None)
    parser.add_argument("--layout", default=None, help="(a rank's) the layout it runs")
    parser.add_argument("--layouts", default=LAYOUTS, help=f"comma-separated, from tpN, ppN, cpN, dp the rest of 4 "
                        f"ranks (default {LAYOUTS})")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 8192; --quick 2048)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per layout (default 4; --quick 2)")
    parser.add_argument("--warmup", type=int, default=1, help="of which untimed (the first counts block activations)")
    parser.add_argument("--verify", action="store_true", help="TensorPipeStrategy(verify=True): the first call of each "
                        "block checked against the whole sequence (slow at long sequences; off by default)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-plan", dest="plan", action="store_false", help="skip the planner's longest sequence")
    parser.add_argument("--budget-mib", type=float, default=1024.0, help="the planner's per-rank budget (MiB)")
    parser.add_argument("--plan-step", type=int, default=1024, help="the planner's sequence granularity (tokens)")
    parser.add_argument("--plan-ceiling", type=int, default=2 ** 21, help="the longest sequence the planner tries")
    args = parser.parse_args()
    args.seq = args.seq or (2048 if args.quick else 8192)
    args.steps = args.steps or (2 if args.quick else 4)
    if args.role == "rank":
        return run_rank(args)
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps {args.steps} leaves no timed step after --warmup {args.warmup}")
    # resident memory that follows what tensors hold on CPU (the user's opt-in, docs/memory.md): the ranks inherit it
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    total_start = time.monotonic()
    names = [n for n in args.layouts.split(",") if n]
    mib = 2 ** 20
    print(f"Hugging Face LlamaForCausalLM (sdpa): hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, "
          f"{SHAPE['num_attention_heads']} heads, {SHAPE['num_key_value_heads']} kv heads, vocabulary "
          f"{SHAPE['vocab_size']}; sequence {args.seq} tokens, batch 1 per replica, AdamW fp32, {args.steps} steps "
          f"({args.warmup} warm-up); 4 CPU processes (gloo, one thread each, on {os.cpu_count()} cores); "
          f"verify={args.verify}")
    print("block activ. = bytes the block stack saves for backward (first step); peak RSS = ru_maxrss over the RSS at "
          "fit's start; step = median of the timed steps, slowest rank; largest rank shown", flush=True)
    results: dict[str, dict[str, Any]] = {}
    header = (f"  {'layout':>11} {'tp':>2} {'dp':>2} {'cp':>2} {'blk pos':>7} | {'block activ. MiB':>16} "
              f"{'peak RSS MiB':>12} | {'step s':>7} {'seq/step':>8} {'per seq. s':>10} {'cp attn s':>9} "
              f"{'cp MB':>6} | {'launch s':>8}")
    print(header, flush=True)
    for name in names:
        dims = parse_layout(name)
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            extra = ["--layout", name, "--seq", str(args.seq), "--steps", str(args.steps),
                     *(["--verify"] if args.verify else [])]
            try:
                ranks = launch("rank", WORLD, Path(tmp), extra, name=name, timeout=1200, script=__file__)
            except SystemExit as err:  # report the failing layout, go on with the others
                print(f"  {name:>11}: FAILED\n{err}", flush=True)
                continue
        step = max(statistics.median(r["step"][args.warmup:]) for r in ranks)
        row = dict(dims=dims, step=step, per_seq=step / dims["dp"], block=max(r["block_saved"] for r in ranks),
                   peak=max(r["peak"] for r in ranks), local=ranks[0]["local"] or args.seq)
        timed = [a for r in ranks for a in r["attention"][args.warmup:]]  # cp's attention calls (cp > 1 only)
        attn = (max(statistics.median(a["attention_seconds"] for a in r["attention"][args.warmup:]) for r in ranks)
                if timed else None)
        sent = max(a["bytes"] for a in timed) / 1e6 if timed else None
        results[name] = row
        print(f"  {name:>11} {dims['tp']:>2} {dims['dp']:>2} {dims['cp']:>2} {row['local']:>7} | "
              f"{row['block'] / mib:16.1f} {row['peak'] / mib:12.1f} | {step:7.2f} {dims['dp']:>8} "
              f"{row['per_seq']:10.2f} {'-' if attn is None else format(attn, '.2f'):>9} "
              f"{'-' if sent is None else format(sent, '.1f'):>6} | {time.monotonic() - start:8.0f}", flush=True)

    print("\nblock activations per rank, cp=c over the cp=1 layout of the same tp (goal <= 1.10 / c):")
    for name, row in results.items():
        d = row["dims"]
        if d["cp"] == 1:
            continue
        ref = next((n for n, r in results.items() if r["dims"]["cp"] == 1 and r["dims"]["tp"] == d["tp"]
                    and r["dims"]["pp"] == d["pp"]), None)
        if ref is None:
            print(f"  {name}: no cp=1 layout with tp={d['tp']} ran")
            continue
        ratio = row["block"] / results[ref]["block"]
        goal = 1.10 / d["cp"]
        print(f"  {name:>11} / {ref:<8} = {ratio:.3f}   (goal <= {goal:.3f}: "
              f"{'met' if ratio <= goal else 'NOT met'}; "
              f"peak RSS {row['peak'] / results[ref]['peak']:.3f})")
    one_seq = {n: r for n, r in results.items() if r["dims"]["cp"] == 1 and r["dims"]["dp"] == 1}
    for cp4 in [n for n in ("cp4", "cp4-a2a") if n in results and one_seq]:
        best = min(one_seq, key=lambda n: one_seq[n]["step"])
        ratio = results[cp4]["step"] / one_seq[best]["step"]
        print(f"\nstep time at {args.seq} tokens (every layout fits here), {cp4} / best cp=1 layout of one sequence "
              f"per step ({best}): {ratio:.3f}   (goal <= 1.2: {'met' if ratio <= 1.2 else 'NOT met'})")
        for name, row in results.items():
            if row["dims"]["cp"] == 1 and row["dims"]["dp"] > 1:
                print(f"  per sequence, {cp4} / {name} ({row['dims']['dp']} sequences per step, each rank the whole "
                      f"sequence): {results[cp4]['per_seq'] / row['per_seq']:.3f}")
    if args.plan:
        plan(args)
    print(f"\ntotal {time.monotonic() - total_start:.0f} s")


if __name__ == "__main__":
    main()
