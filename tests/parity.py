"""The one parity helper: train in a layout and in one process from the same weights and batches, then compare
per-step losses, per-parameter gradients (by original name) and the updated parameters, naming what differs."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from models import LitLM, token_dataset
import models_stacks  # noqa: F401,E402 - registers its families in models.MODELS
import models_cp  # noqa: F401,E402 - and the context-parallel ones

FP32 = dict(rtol=1e-5, atol=1e-6)


@dataclass
class Record:
    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, Tensor]] = field(default_factory=list)
    params: dict[str, Tensor] = field(default_factory=dict)
    logged: dict[str, float] = field(default_factory=dict)
    local_fraction: float = 1.0  # this rank's parameter elements / the whole model's (tensor-parallel shards)
    expert_fraction: float = 1.0  # under ep: this rank's expert elements (parameters, optimizer state) / all experts'
    expert_state_fraction: float = 1.0
    # running statistics of normalisation layers (running_mean/var, num_batches_tracked) after each step
    buffers: list[dict[str, Tensor]] = field(default_factory=list)
    rng: list[str] = field(default_factory=list)  # where the user's CPU generator stands after each step (a digest)


RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


def _full(t: Tensor, p: Tensor, trainer: L.Trainer) -> Tensor:
    from lightning_tpp.core.comm import gather_with_spec
    from lightning_tpp.core.dp_shard import gather_dp

    t = gather_dp(t)  # a part sharded over dp (FSDP2): the tensor-parallel shard
    state = getattr(trainer.strategy, "_state", None)  # None in the one-process reference run
    spec = state.shards.spec(p) if state is not None else None
    if spec is None:
        return t.detach().float().clone()
    return gather_with_spec(t.detach(), spec, trainer.strategy.tp_group).float()


class Recorder(Callback):
    def __init__(self) -> None:
        self.record = Record()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"].detach().float().clone()
        self.record.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))
        self.record.buffers.append({n: b.detach().double().clone() for n, b in pl_module.named_buffers()
                                    if n.rpartition(".")[2] in RUNNING_STATS})
        self.record.rng.append(hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16])

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.record.grads.append({n: _full(p.grad, p, trainer)
                                  for n, p in pl_module.named_parameters(remove_duplicate=False) if p.grad is not None})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record.params = {n: _full(p, p, trainer) for n, p in pl_module.named_parameters(remove_duplicate=False)}
        self.record.logged = {k: float(v) for k, v in trainer.callback_metrics.items()}


def train(name: str, *, strategy: Any = "auto", devices: int = 1, dp: int = 1, steps: int = 5, batch_size: int = 4,
          accumulate: int = 1, clip: Optional[float] = None, precision: str = "32-true", lr: float = 0.1,
          optimizer: str = "sgd", accelerator: str = "cpu", in_order_receives: bool = False,
          meta: bool = False, prepare: Optional[Callable[[LitLM], None]] = None,
          after_fit: Optional[Callable[[L.Trainer], None]] = None, seed: int = 0,
          replicas_apart: bool = False, callbacks: tuple[Callback, ...] | list[Callback] = (),
          seq: Optional[int] = None) -> Record:
    """Train ``name`` for ``steps`` optimizer steps. In one process (with or without a strategy) each batch is the
    union of what ``dp`` replicas draw from Lightning's shuffling DistributedSampler (seed 0, epoch 0) at that step.
    ``prepare`` sees the module before training (e.g. loads weights), ``after_fit`` the Trainer after it. ``seed``
    reseeds torch's generator before the model is built (a rank whose process was seeded by other means: the strategy
    must give every rank rank 0's weights; ``seed_everything`` itself must agree across ranks). ``replicas_apart``:
    each replica's part of a step is a batch of its own, one after the other (with ``accumulate=dp``: what dp replicas
    compute when the loss is not a mean over samples, e.g. a mixture of experts' load-balancing loss). ``seq``: the
    positions of each sample (``models.SEQ`` by default)."""
    L.seed_everything(0, verbose=False)
    torch.manual_seed(seed)
    module = LitLM(name, lr=lr, optimizer=optimizer, build_in_configure_model=meta)  # meta: built in configure_model
    if prepare is not None:
        prepare(module)
    data = token_dataset() if seq is None else token_dataset(seq=seq)  # seq: positions per sample
    one_process = devices == 1  # with or without the strategy: reads what the dp replicas read together
    if one_process:
        perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
        per_replica = [perm[r::dp] for r in range(dp)]
        batches = [[i for r in range(dp) for i in per_replica[r][s * batch_size:(s + 1) * batch_size]]
                   for s in range(len(per_replica[0]) // batch_size)]
        if replicas_apart:
            batches = [per_replica[r][s * batch_size:(s + 1) * batch_size]
                       for s in range(len(per_replica[0]) // batch_size) for r in range(dp)]
        loader = torch.utils.data.DataLoader(data, batch_sampler=batches)
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False)
    recorder = Recorder()
    callbacks = [recorder, *callbacks]  # the caller's (e.g. a measurement) after the recorder
    if in_order_receives:  # NCCL's way (messages of a pair matched in posting order), exercised on gloo
        class InOrder(L.Callback):
            def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
                transport = trainer.strategy._engine.transport
                # set where the transport reads it (a renamed attribute would leave gloo's order untested, silently)
                assert "early" in vars(transport) and transport.early is True, vars(transport).keys()
                transport.early = False

        callbacks.append(InOrder())
    trainer = L.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                        precision=precision, limit_val_batches=0, num_sanity_val_steps=0,
                        use_distributed_sampler=not one_process)
    trainer.fit(module, loader)
    if after_fit is not None:
        after_fit(trainer)
    return recorder.record


def load_record(path: Path) -> Record:
    return Record(**torch.load(path, weights_only=True))


def merge_stages(records: list[Record]) -> Record:
    """One record from the ranks of a pipeline (each holds its stages' parameters); losses must agree."""
    merged = Record(losses=records[0].losses, logged=records[0].logged)
    for i, r in enumerate(records):
        assert r.losses == records[0].losses, f"rank {i} losses {r.losses} differ from rank 0's {records[0].losses}"
    merged.grads = [{} for _ in records[0].grads]
    merged.buffers = [{} for _ in records[0].buffers]
    for r in records:
        assert len(r.grads) == len(merged.grads)
        for step, g in enumerate(r.grads):
            merged.grads[step].update(g)
        for step, b in enumerate(r.buffers):
            merged.buffers[step].update(b)
        merged.params.update(r.params)
    return merged


def compare_layout(tmp: Path, models: list[str], *, tp: int = 1, pp: int = 1, dp: int = 1, steps: int = 3,
                   extra: tuple = ()) -> None:
    """Train ``models`` in one launch of the layout (this file's ``main`` on every rank) and each in one process on
    the same batches; the ranks of every pipeline, joined, at parity with it."""
    from launch import ROOT, run_ranks

    args = ["--models", ",".join(models), "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--out", str(tmp),
            "--steps", str(steps), *extra]
    run_ranks(ROOT / "tests" / "parity.py", tp * pp * dp, args, timeout=400).check()
    for name in models:
        ref = train(name, dp=dp, steps=steps)
        for d in range(dp):
            for t in range(tp):
                ranks = [(d * pp + s) * tp + t for s in range(pp)]
                got = merge_stages([load_record(tmp / f"{name}.rank{r}.pt") for r in ranks])
                assert_parity(got, ref, where=f"{name} tp={tp} pp={pp} dp={dp} ranks {ranks}")


def _close(a: Tensor, b: Tensor, what: str, rtol: float, atol: float) -> None:
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != reference {tuple(b.shape)}")
    if not torch.allclose(a, b, rtol=rtol, atol=atol):
        diff = (a - b).abs().max()
        raise AssertionError(f"{what}: max abs difference {float(diff):.3g} (rtol={rtol}, atol={atol})")


def assert_parity(got: Record, ref: Record, *, rtol: float = FP32["rtol"], atol: float = FP32["atol"],
                  param_atol: float | None = None, where: str = "") -> None:
    assert len(got.losses) == len(ref.losses) > 0, f"{where}: {len(got.losses)} steps vs {len(ref.losses)}"
    _close(torch.tensor(got.losses), torch.tensor(ref.losses), f"{where} losses {got.losses} vs {ref.losses}",
           rtol, atol)
    assert len(got.grads) == len(ref.grads), f"{where}: {len(got.grads)} optimizer steps vs {len(ref.grads)}"
    for step, (g, r) in enumerate(zip(got.grads, ref.grads)):
        assert g.keys() == r.keys(), f"{where} step {step}: gradient names differ: {set(g) ^ set(r)}"
        for name in r:
            _close(g[name], r[name], f"{where} step {step} gradient of {name}", rtol, atol)
    assert got.params.keys() == ref.params.keys(), (
        f"{where}: parameter names differ: {set(got.params) ^ set(ref.params)}")
    for name in ref.params:
        _close(got.params[name], ref.params[name], f"{where} updated parameter {name}", rtol,
               atol if param_atol is None else param_atol)
    assert_same_buffers(got, ref, steps=len(ref.buffers), rtol=rtol, atol=atol, where=where)


def assert_same_buffers(got: Record, ref: Record, *, steps: int, rtol: float = FP32["rtol"],
                        atol: float = FP32["atol"], where: str = "") -> None:
    """Running statistics of normalisation layers after each of the first ``steps`` steps, by name."""
    assert len(got.buffers) >= steps and len(ref.buffers) >= steps, f"{where}: buffers of fewer than {steps} steps"
    for step in range(steps):
        g, r = got.buffers[step], ref.buffers[step]
        assert g.keys() == r.keys(), f"{where} step {step}: running statistics differ in names: {set(g) ^ set(r)}"
        for name in r:
            _close(g[name], r[name], f"{where} step {step} running statistic {name}", rtol, atol)


def main() -> None:  # a rank of a parallel run (see tests/launch.py)
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    # a name, or "lists:NAME" for NAME's orders as action lists; several names, comma-separated, train each model
    # once per schedule (records NAME.SCHEDULE.rankR.pt; --virtual applies to the interleaved ones only)
    parser.add_argument("--schedule", default="1f1b")
    # several, comma-separated: each model trained once per count (records NAME.mM.rankR.pt)
    parser.add_argument("--microbatches", default=None)
    parser.add_argument("--virtual", type=int, default=1)
    parser.add_argument("--blocks", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--in-order-receives", action="store_true")
    parser.add_argument("--meta", action="store_true", help="build the model in configure_model (meta device)")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--dp-sharding", default="full_shard")
    parser.add_argument("--no-vocab-exchange", dest="vocab_exchange", action="store_false",
                        help="FSDP2 gathers the embedding and head too (vocab_exchange=False)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--no-verify", dest="verify", action="store_false", help="verify=False: no first-call checks")
    parser.add_argument("--loss-normalization", default="batch")
    parser.add_argument("--seed-by-rank", action="store_true", help="each rank builds its model from seed = rank")
    parser.add_argument("--compile", default=None, help="compile= with this torch.compile backend (e.g. aot_eager)")
    args = parser.parse_args()
    from lightning_tpp import TensorPipeStrategy

    rank = int(os.environ["LOCAL_RANK"])
    schedules = args.schedule.split(",") if not args.schedule.startswith("lists:") else [args.schedule]
    for schedule_name in schedules:
        schedule, virtual = schedule_name, args.virtual if "interleaved" in schedule_name or len(schedules) == 1 else 1
        if schedule.startswith("lists:"):  # a user's per-rank action lists, copied from a built-in schedule's
            from lightning_tpp.pipeline.schedule import actions

            m = int(args.microbatches or 2 * args.pp)
            schedule = [actions(schedule[len("lists:"):], r, args.pp, m, virtual) for r in range(args.pp)]
        counts = [int(m) for m in args.microbatches.split(",")] if args.microbatches else [None]
        for name, microbatches in ((n, m) for n in args.models.split(",") for m in counts):
            strategy = TensorPipeStrategy(tp=args.tp, pp=args.pp, ep=args.ep, schedule=schedule,
                                          microbatches=microbatches,
                                          virtual_stages=virtual, blocks=args.blocks,
                                          activation_checkpointing=args.activation_checkpointing,
                                          dp_sharding=args.dp_sharding, vocab_exchange=args.vocab_exchange,
                                          sequence_parallel=args.sequence_parallel, verify=args.verify,
                                          loss_normalization=args.loss_normalization,
                                          compile={"backend": args.compile} if args.compile else False,
                                          print_plan=rank == 0 and name == "nanogpt")
            record = train(name, strategy=strategy, devices=args.tp * args.dp * args.pp, dp=args.dp,
                           steps=args.steps, batch_size=args.batch_size, accumulate=args.accumulate, clip=args.clip,
                           precision=args.precision, optimizer=args.optimizer, lr=args.lr,
                           accelerator=args.accelerator, in_order_receives=args.in_order_receives,
                           meta=args.meta, seed=rank if args.seed_by_rank else 0)
            if args.dp > 1 and args.dp_sharding != "no_shard":  # FSDP2 must have sharded (nearly) everything
                from lightning_tpp.data_parallel import sharded_numel

                from lightning_tpp.experts.expert_parallel import expert_parameters

                total, sharded = sharded_numel(strategy.lightning_module)
                total -= sum(p.numel() for p in expert_parameters(strategy.lightning_module))  # split over ep
                if sharded < 0.9 * total:
                    raise AssertionError(f"{name}: only {sharded} of {total} parameters are sharded over dp: "
                                         f"{strategy.parallel_state.dp}")
            if args.ep > 1:  # the experts' parameters and optimizer state held here, against all of them
                from lightning_tpp.core.dp_shard import local
                from lightning_tpp.experts.expert_parallel import expert_parameters

                experts = expert_parameters(strategy.lightning_module)  # none: experts cut over tp instead
                shards = strategy.parallel_state.shards
                whole = sum(shards.full_numel(p) for p in experts) or 1
                record.expert_fraction = sum(local(p).numel() for p in experts) / whole
                states = strategy.lightning_module.trainer.optimizers[0].state
                held = [v for p in experts for v in states.get(p, {}).values() if isinstance(v, torch.Tensor)
                        and v.dim() > 0]
                record.expert_state_fraction = sum(local(v).numel() for v in held) / whole if held else 0.0
            if (args.tp > 1 or args.ep > 1) and args.pp == 1 and (args.dp == 1 or args.dp_sharding == "no_shard"):
                shards = strategy.parallel_state.shards
                params = list(strategy.lightning_module.parameters())
                record.local_fraction = sum(p.numel() for p in params) / sum(shards.full_numel(p) for p in params)
            if args.sequence_parallel and not strategy.parallel_state.sequence:
                raise AssertionError(f"{name}: sequence_parallel=True but no block runs on sequence shards")
            idle = [st.name for st in strategy.parallel_state.sequence or () if not st.ran]
            if idle:
                raise AssertionError(f"{name}: sequence_parallel=True but blocks {idle} never ran on shards")
            if args.activation_checkpointing and not strategy.parallel_state.recomputed:
                raise AssertionError(f"{name}: activation_checkpointing=True but no block is recomputed")
            stem = name if len(schedules) == 1 else f"{name}.{schedule_name}"
            stem = stem if len(counts) == 1 else f"{stem}.m{microbatches}"
            if args.compile:  # what dynamo compiled, and since the first step (recompiles)
                from lightning_tpp.integration.compile_metrics import dynamo_counts

                graphs, breaks, _ = dynamo_counts()
                compiled = strategy._compiled
                (Path(args.out) / f"{stem}.compile.rank{rank}.json").write_text(json.dumps(
                    {"compiled": strategy.parallel_state.compiled, "graphs": graphs, "breaks": breaks,
                     "recompiles": compiled.recompiles if compiled is not None else None}))
            torch.save(asdict(record), Path(args.out) / f"{stem}.rank{rank}.pt")


if __name__ == "__main__":
    main()
