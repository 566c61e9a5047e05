"""Memory benchmark (not a test): what each rank holds, measured, beside what ``estimate_memory`` says.

    python benchmarks/memory.py            # Llama-style ~150 M parameters; about 10 minutes on 2 cores
    python benchmarks/memory.py --quick    # a ~7 M-parameter model, one step: a smoke test
    python benchmarks/memory.py --levers   # tp=2: activations with and without sequence / loss parallelism
    python benchmarks/memory.py --quick --shape '{"num_local_experts": 4, "num_experts_per_tok": 2}'
                                           # a Mixtral-style mixture of experts of the same shape

A Llama-style model (Hugging Face ``LlamaForCausalLM`` from a ``LlamaConfig``) built in the LightningModule's
``configure_model()``, trained a few steps with AdamW through ``TensorPipeStrategy`` in CPU processes (gloo), for
tp2 x pp2 (4 processes) and tp2 x pp2 x dp2 (8 processes), with and without activation checkpointing (when the
strategy takes ``activation_checkpointing``; "n/a" otherwise). Per rank, after the last step:

- states: bytes of the rank's parameters, gradients and optimizer state (its own tensors; a DTensor's local shard);
- peak: ``ru_maxrss`` at the end minus the resident memory measured at the start of ``fit`` (the callback's
  ``setup``, before ``configure_model``, which builds on the meta device): everything the rank allocated (as a user
  runs it with ``MALLOC_MMAP_THRESHOLD_=65536``, the setting docs/memory.md gives CPU users short of resident
  memory: freed large blocks leave RSS; set by this benchmark unless the environment holds another value);
- setup: the same, at the start of the first step (after the strategy cut the model and materialised the shards);
- fixed: what setup added to the resident memory that no tensor holds (the RSS growth at the first step's start
  minus the bytes of all live tensor storages): process groups (gloo keeps buffers per peer; 8 ranks make many
  groups), modules and Python objects. It does not grow with the model (about 100-250 MiB per rank here) and lives
  in host memory, not on the accelerator; "peak-fixed" is the peak without it;
- activations: the most bytes saved for backward alive at once during a step (``saved_tensors_hooks``: each
  storage counted once while autograd holds it, parameters excepted).

Each is shown as a ratio to the ideal share (whole model's params + grads + AdamW state / world size), beside
``estimate_memory``'s figures for the same layout (states sharded over dp with FSDP2, the strategy's default) and their
ratio to the measurement. The estimate's activations are compared without the outputs a stage holds for the next
one, without checkpointing's recompute and without the loss's backward's gradients in flight, which the hooks do
not see.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline import _launch as launch  # the benchmarks' one way to start ranks (this folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
FULL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2560, num_hidden_layers=14, num_attention_heads=12,
            num_key_value_heads=4)
QUICK = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4)
LAYOUTS = [("tp2xpp2", dict(tp=2, pp=2, dp=1)), ("tp2xpp2xdp2", dict(tp=2, pp=2, dp=2)),
           ("pp2xdp2xep2", dict(tp=1, pp=2, dp=2, ep=2))]  # the last: a mixture of experts only (--shape)
MICROBATCHES, LOCAL_BATCH = 2, 2  # per dp replica: 2 micro-batches of 1 sequence


class LlamaLM(L.LightningModule):
    """An ordinary LightningModule that builds its Hugging Face model in ``configure_model``."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)
        self.model: Optional[nn.Module] = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        import transformers

        kind = "Mixtral" if "num_local_experts" in self.config else "Llama"  # --shape with experts: a mixture
        cfg = getattr(transformers, f"{kind}Config")(**{"tie_word_embeddings": False, **self.config},
                                                     max_position_embeddings=4096)
        cfg._attn_implementation = "sdpa"
        self.model = getattr(transformers, f"{kind}ForCausalLM")(cfg)

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids).logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, self.config["vocab_size"]), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# measuring inside a rank


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _nbytes(t: Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


class _Held:
    """What a saved-tensor hook returns: releases its storage's count when autograd drops it."""

    __slots__ = ("t", "key", "tracker")

    def __init__(self, t: Tensor, key: int, tracker: "SavedTracker") -> None:
        self.t, self.key, self.tracker = t, key, tracker

    def __del__(self) -> None:
        self.tracker.release(self.key)


class SavedTracker:
    """Bytes of storages saved for backward alive at once (each storage once), parameters excepted."""

    def __init__(self, params: set[int]) -> None:
        self.params, self.refs, self.size, self.now, self.peak = params, {}, {}, 0, 0

    def pack(self, t: Tensor) -> Any:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):  # FSDP2's gathered ones included
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.params or key == 0:
            return t
        if self.refs.get(key, 0) == 0:
            self.size[key] = storage.nbytes()
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


def _live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in the process (a DTensor's local part), each storage once."""
    import gc

    sizes: dict[int, int] = {}
    for o in gc.get_objects():
        if isinstance(o, Tensor) and not o.is_meta:
            try:
                storage = (o.to_local() if hasattr(o, "to_local") else o).untyped_storage()
            except (RuntimeError, NotImplementedError):  # no storage (e.g. a sparse tensor)
                continue
            if storage.data_ptr():
                sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


class Measure(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.start_rss, self.hooks, self.tracker, self.overhead = out, 0, None, None, 0
        self.activations, self.setup_peak = 0, 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.start_rss = _rss()  # before configure_model and the strategy's setup

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.setup_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.start_rss
        # what setup added that no tensor holds: process groups (gloo's buffers per peer), modules, Python objects
        self.overhead = max(_rss() - self.start_rss - _live_tensor_bytes(), 0)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
                  for p in pl_module.parameters()}
        self.tracker = SavedTracker(params)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.tracker.pack, SavedTracker.unpack)
        self.hooks.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:
        self.hooks.__exit__(None, None, None)
        self.activations = max(self.activations, self.tracker.peak)
        params = list({id(p): p for p in pl_module.parameters()}.values())
        optimizer = trainer.optimizers[0]
        state = sum(_nbytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.start_rss
        result = dict(params=sum(_nbytes(p) for p in params),
                      grads=sum(_nbytes(p.grad) for p in params if p.grad is not None),
                      optimizer=state, peak=peak, setup_peak=self.setup_peak, activations=self.activations,
                      overhead=self.overhead, rank=trainer.global_rank,
                      schedule=getattr(getattr(trainer.strategy, "_engine", None), "schedule", None))
        (self.out / f"rank.{trainer.global_rank}.json").write_text(json.dumps(result))


def run_rank(args: argparse.Namespace) -> None:
    from lightning_tpp import TensorPipeStrategy

    torch.set_num_threads(1)
    L.seed_everything(0)
    layout = dict(json.loads(args.layout))
    extra = {"activation_checkpointing": True} if args.checkpointing else {}
    extra.update(json.loads(args.extra))
    strategy = TensorPipeStrategy(**layout, microbatches=MICROBATCHES, verify=False, print_plan=False, **extra)
    config = _config(args)
    world = layout["tp"] * layout["pp"] * layout["dp"]
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, config["vocab_size"], (args.steps * LOCAL_BATCH * layout["dp"], args.seq + 1),
                         generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]),
                                         batch_size=LOCAL_BATCH)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Measure(Path(args.out))])
    trainer.fit(LlamaLM(config), loader)


# ----------------------------------------------------------------------------------------------------------------
# the driver


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """The model's Hugging Face Llama configuration: the full or quick shape, with ``--shape`` laid over it."""
    return {**(QUICK if args.quick else FULL), **json.loads(args.shape)}


def _estimate(config: dict, layout: dict, checkpointing: bool, seq: int, schedule: Optional[str] = None,
              vocab_exchange: bool = True) -> Any:
    from lightning_tpp import estimate_memory

    with torch.device("meta"):
        module = LlamaLM(config)
        module.configure_model()
    return estimate_memory(module, **layout, microbatches=MICROBATCHES, batch_size=LOCAL_BATCH * layout["dp"],
                           seq_len=seq, activation_checkpointing=checkpointing, dp_shard=True, backend="gloo",
                           vocab_exchange=vocab_exchange,
                           **({"schedule": schedule} if schedule else {}))


def _table(name: str, measured: list[dict], report: Any) -> None:
    ideal = report.ideal_share()
    mib = 2 ** 20
    print(f"  {name}: ideal share {ideal / mib:.1f} MiB (whole model's params + grads + AdamW state / "
          f"{report.dims.world_size})")
    print(f"  {'rank':>4} {'pp':>3} {'tp':>3} | {'states':>7} {'x ideal':>7} {'peak':>8} {'x ideal':>7} {'setup':>7} "
          f"{'fixed':>6} {'peak-fixed':>10} {'activ.':>7} | {'est. states':>11} {'est/meas':>8} {'est. activ.':>11} "
          f"{'est/meas':>8} {'est. total':>10} {'x ideal':>7}")
    for m in measured:
        rank = m["rank"]
        coords = report.dims.coords(rank)
        est = next(r for r in report.ranks if (r.pp_rank, r.tp_rank) == (coords["pp"], coords["tp"]))
        states = m["params"] + m["grads"] + m["optimizer"]
        est_act = est.activations - est.sent - est.recompute - est.transient
        print(f"  {rank:>4} {coords['pp']:>3} {coords['tp']:>3} | {states / mib:7.1f} {states / ideal:7.2f} "
              f"{m['peak'] / mib:8.1f} {m['peak'] / ideal:7.2f} {m['setup_peak'] / ideal:7.2f} "
              f"{m['overhead'] / mib:6.0f} {(m['peak'] - m['overhead']) / ideal:10.2f} {m['activations'] / mib:7.1f} | "
              f"{est.states / mib:11.1f} {est.states / states:8.3f} {est_act / mib:11.1f} "
              f"{est_act / max(m['activations'], 1):8.3f} {est.total / mib:10.1f} {est.total / ideal:7.2f}")


def levers(args: argparse.Namespace) -> None:
    """tp=2 (2 processes), the same model and batches, with each activation lever on and off: per rank, the most
    bytes saved for backward alive at once, and the peak (resident growth, without the fixed part)."""
    config = _config(args)
    print(f"tp=2, vocabulary {config['vocab_size']}, {MICROBATCHES} x 1 x {args.seq} tokens per step (one batch), "
          f"AdamW, {args.steps} step(s); activ. = most bytes saved for backward alive at once")
    base = None
    print(f"  {'sequence_parallel':>17} {'loss_parallel':>13} | {'activ. MiB':>10} {'x base':>6} | "
          f"{'peak-fixed MiB':>14} {'x base':>6}")
    for sp, lp in ((False, False), (True, False), (False, True), (True, True)):
        with tempfile.TemporaryDirectory() as tmp:
            extra = ["--layout", json.dumps(dict(tp=2, pp=1, dp=1)), "--steps", str(args.steps), "--seq",
                     str(args.seq), "--extra", json.dumps(dict(sequence_parallel=sp, loss_parallel=lp)),
                     "--shape", args.shape,
                     *(["--quick"] if args.quick else [])]
            measured = launch("rank", 2, Path(tmp), extra, timeout=900, script=__file__)
        act = max(m["activations"] for m in measured)
        peak = max(m["peak"] - m["overhead"] for m in measured)
        base = base or (act, peak)
        print(f"  {str(sp):>17} {str(lp):>13} | {act / 2 ** 20:10.1f} {act / base[0]:6.2f} | "
              f"{peak / 2 ** 20:14.1f} {peak / base[1]:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="driver", choices=("driver", "rank"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--layout", default=None)
    parser.add_argument("--layouts", default=None, help="run only these, e.g. tp2xpp2xdp2 (comma-separated)")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--extra", default="{}", help="more TensorPipeStrategy arguments (JSON)")
    parser.add_argument("--shape", default="{}", help="LlamaConfig arguments laid over the model's (JSON), e.g. "
                        "'{\"vocab_size\": 50304, \"tie_word_embeddings\": true}'")
    parser.add_argument("--levers", action="store_true", help="tp=2 with and without sequence/loss parallelism")
    args = parser.parse_args()
    args.steps = args.steps or (1 if args.quick else 3)
    args.seq = args.seq or (64 if args.quick else 128)
    if args.role == "rank":
        return run_rank(args)
    if args.levers:
        return levers(args)
    from lightning_tpp import TensorPipeStrategy

    # resident memory that follows what tensors hold on CPU (the user's opt-in, docs/memory.md): the ranks inherit it
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    config = _config(args)
    has_ckpt = "activation_checkpointing" in inspect.signature(TensorPipeStrategy.__init__).parameters
    whole = _estimate(config, dict(tp=1, pp=1, dp=1), False, args.seq).whole_params
    kind = "Mixtral" if "num_local_experts" in config else "Llama"
    print(f"{kind}-style model of {whole / 1e6:.1f} M parameters built in configure_model, AdamW, fp32, "
          f"{args.steps} step(s), {MICROBATCHES} micro-batches of 1 x {args.seq} tokens per dp replica, the default "
          f"schedule ('auto': zb-drain while it measures, 1F1B under FSDP2); est. for the schedule that ran")
    print("states = params + grads + optimizer state of the rank; peak = ru_maxrss increase over the RSS at the start "
          "of fit (before configure_model, which builds on the meta device); setup = the same at the first step's "
          "start (after the strategy's setup); activ. = most bytes saved "
          "for backward alive at once. est. = estimate_memory (states sharded over dp, FSDP2); est. "
          "activ. leaves out sent outputs, recompute and the loss's backward, which the hooks do not see; est. total includes them")
    for name, layout in LAYOUTS:
        if layout.get("ep", 1) > 1 and "num_local_experts" not in config:
            continue  # expert parallelism needs experts
        if args.layouts and name not in args.layouts.split(","):
            continue
        for checkpointing in (False, True):
            label = f"{name}, activation checkpointing {'on' if checkpointing else 'off'}"
            if checkpointing and not has_ckpt:
                print(f"\n  {label}: n/a (TensorPipeStrategy has no activation_checkpointing argument yet)")
                continue
            world = layout["tp"] * layout["pp"] * layout["dp"]
            start = time.monotonic()
            with tempfile.TemporaryDirectory() as tmp:
                extra = ["--layout", json.dumps(layout), "--steps", str(args.steps), "--seq", str(args.seq),
                         "--extra", args.extra, "--shape", args.shape,
                         *(["--quick"] if args.quick else []), *(["--checkpointing"] if checkpointing else [])]
                measured = launch("rank", world, Path(tmp), extra, timeout=900, script=__file__)
            ran = measured[0].get("schedule")  # the default "auto": what its measuring steps (or the layout) ran
            report = _estimate(config, layout, checkpointing, args.seq, ran,
                               json.loads(args.extra).get("vocab_exchange", True))
            print(f"\n{label}, schedule {ran!r} ({time.monotonic() - start:.0f}s)")
            _table(name, measured, report)


if __name__ == "__main__":
    main()
