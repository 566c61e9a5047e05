"""``TensorPipeConfig``: what the user asked of :class:`~lightning_tpp.strategy.TensorPipeStrategy`, as one frozen,
self-validating object. The strategy keeps it as one attribute (``strategy.config``); ``layout="auto"`` resolves it
into a new config with the chosen degrees (:meth:`TensorPipeConfig.with_layout`); the parallel state is built from
it, and a module already cut adopts a strategy whose config cuts it alike (:meth:`TensorPipeConfig.cutting`)."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Mapping, Optional, Sequence, Union

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_tpp.checkpoint.async_save import check_async_save
from lightning_tpp.data_parallel import DPSharding, normalize_sharding
from lightning_tpp.core.mesh import resolve_dims
from lightning_tpp.core.token_mean import LossNormalization, check_normalization
from lightning_tpp.experts.expert_parallel import check_ep
from lightning_tpp.pipeline.auto import AUTO as AUTO_SCHEDULE
from lightning_tpp.pipeline.auto import settle_auto
from lightning_tpp.pipeline.schedule import ScheduleLike
from lightning_tpp.pipeline.schedule_input import normalize as normalize_schedule
from lightning_tpp.pipeline.schedule_input import resolve as resolve_schedule
from lightning_tpp.pipeline.schedule import validate as validate_schedule

# the arguments that decide how a model is cut and run: a module already cut adopts only a strategy that agrees on
# them (a second Trainer, a second fit); the others (print_plan, timeout, metrics, ...) may differ
CUTTING = ("tp", "pp", "dp", "ep", "cp", "cp_mode", "microbatches", "schedule", "virtual_stages", "tp_plan", "balance",
           "split_points", "blocks", "save_distributed_checkpoint", "on_nonfinite", "weights", "weights_prefix",
           "activation_checkpointing", "dp_sharding", "vocab_exchange", "sequence_parallel")
_BOOLS = ("verify", "activation_checkpointing", "loss_parallel", "sequence_parallel", "vocab_exchange", "print_plan",
          "save_distributed_checkpoint", "pipeline_metrics")


AUTO = "auto"


class AutoLayoutError(ValueError):
    """``layout="auto"`` cannot decide: what it needs is missing or contradicts a fixed argument."""


@dataclass(frozen=True)
class AutoRequest:
    """What the user left to the search (``None``: searched) and the budget."""

    tp: Optional[int]
    pp: Optional[int]
    activation_checkpointing: Optional[bool]
    dp_sharding: Optional[str]
    device_memory: Optional[float]
    global_batch: Optional[int]
    margin: float = 0.1
    ep: Optional[int] = None  # searched (layout="auto", where the model has experts), else the given one
    cp: Optional[int] = 1  # searched (layout="auto" with cp=1, where context parallelism can run), else the given one
    cp_mode: Optional[str] = "allgather"  # the strategy's, which the search charges cp by (None: searched)


def auto_request(*, tp: Any, pp: Any, dp: Any, layout: Optional[str], device_memory: Optional[Union[float, str]],
                 global_batch: Optional[int], activation_checkpointing: bool, dp_sharding: str, ep: int = 1,
                 cp: int = 1, cp_mode: str = "allgather") -> Optional[AutoRequest]:
    """The request the strategy's arguments make, or ``None`` when every degree is given (the search is off).
    ``layout="auto"`` searches ep too, and cp unless one above 1 is given; ``tp="auto"`` / ``pp="auto"`` keep the
    given ``ep`` and ``cp``; ``ep="auto"`` searches ep alone (and dp, micro-batches, schedule), keeping the rest."""
    if layout not in (None, AUTO):
        raise AutoLayoutError(f"layout={layout!r} must be 'auto' or None (tp, pp and dp given)")
    if layout is None and AUTO not in (tp, pp, ep):
        if device_memory is not None or global_batch is not None:
            raise AutoLayoutError("device_memory= and global_batch= are budgets for the layout search; pass "
                                  "layout='auto' (or tp='auto' / pp='auto' / ep='auto') with them")
        return None
    if dp != AUTO:
        raise AutoLayoutError(f"dp={dp!r} with a searched layout: dp is what tp and pp leave; pass dp='auto'")
    if global_batch is not None and (not isinstance(global_batch, int) or global_batch < 1):
        raise AutoLayoutError(f"global_batch={global_batch!r} must be a positive number of samples per optimizer step")
    whole = layout == AUTO
    return AutoRequest(tp=None if whole or tp == AUTO else tp, pp=None if whole or pp == AUTO else pp,
                       activation_checkpointing=None if whole else activation_checkpointing,
                       dp_sharding=None if whole else dp_sharding, device_memory=_bytes(device_memory),
                       global_batch=global_batch, ep=None if whole or ep == AUTO else ep,
                       cp=None if whole and cp == 1 else cp, cp_mode=None if cp_mode == "auto" else cp_mode)


COMPILE_OPTIONS = ("backend", "mode", "options", "dynamic", "fullgraph")


def check_compile(value: Any) -> None:
    """``compile=``: True, False, or a dict of ``torch.compile`` options."""
    if isinstance(value, bool):
        return
    if not isinstance(value, Mapping):
        raise TypeError(f"compile={value!r} must be True, False or a dict of torch.compile options, e.g. "
                        f"{{'backend': 'aot_eager'}}")
    unknown = [k for k in value if k not in COMPILE_OPTIONS]
    if unknown:
        raise ValueError(f"compile={dict(value)!r}: {unknown} not among the torch.compile options it passes on "
                         f"{list(COMPILE_OPTIONS)}")


def _bytes(value: Optional[Union[float, str]]) -> Optional[float]:
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    try:
        return parse_bytes(value, name="device_memory=")
    except ValueError as err:
        raise AutoLayoutError(f"{err} (or bytes as a number)") from None


def parse_bytes(text: str, *, name: str = "--device-memory") -> float:
    """``80GB`` -> 80e9, ``80GiB`` -> 80 * 2**30 (also KB/MB/TB and their binary forms, or a plain number of bytes)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"{name} {text!r} must look like 80GB, 80GiB or a number of bytes")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    power = " KMGT".index(unit[0]) if unit != "B" else 0
    return number * ((1024 if "I" in unit else 1000) ** power)



@dataclass(frozen=True)
class TensorPipeConfig:
    """The arguments of :class:`~lightning_tpp.strategy.TensorPipeStrategy` (the same names, defaults and meaning),
    validated and normalised once, at construction.

    Args:
        tp: tensor-parallel size (ranks that split each layer; keep it within a node), or ``"auto"`` (searched
            with dp, micro-batches and schedule; pp, activation checkpointing and dp sharding as given).
        pp: pipeline-parallel size (stages), or ``"auto"`` (as ``tp="auto"``).
        layout: ``"auto"``: choose tp, pp, dp, micro-batches, schedule, activation checkpointing and dp sharding at
            setup from a cost model of one step and the memory planner (``docs/layout.md``): one block of each kind
            timed on this device on the shape of one per-process batch of token ids (rank 0 reads the first batch of
            the run's data: the loader given to ``fit``, or the ``train_dataloader()`` of the module or datamodule;
            the module's ``example_input_array``, where set, overrides it), the links measured; the top candidates
            and why the winner won are logged on rank 0, the choice is ``trainer.strategy.parallel_state.layout``.
        device_memory: with a searched layout, the memory budget per device in bytes (or ``"80GB"``); default what
            the device has (on CPU, this process's share of the machine's memory). Layouts the planner finds above
            it (less a 10% margin) are dropped.
        global_batch: with a searched layout, samples per optimizer step kept fixed: gradient accumulation is set
            to ``global_batch / (dp x per-process batch)`` and layouts are ranked at that batch.
        dp: data-parallel size, or ``"auto"`` for ``world_size // (tp * pp)``.
        ep: expert parallelism for mixture-of-experts models: each rank holds ``experts / ep`` whole experts of
            every bank and the tokens travel to them by all-to-all (dropless). The ep group is drawn from the
            data-parallel and tensor-parallel ranks of a stage (``ep`` must divide ``dp * tp``); expert gradients
            are averaged over the ranks holding the same experts (and, where FSDP2 shards, the experts are sharded
            over them). Searched with ``layout="auto"`` where the model has experts, or alone with ``ep="auto"``
            (``docs/layout.md``). See ``docs/experts.md``.
        microbatches: micro-batches per step for the pipeline (default ``2 * pp``).
        schedule: pipeline schedule, one of ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``, ``"zero-bubble"``,
            ``"zb-drain"``, ``"zb-lead"`` (see ``docs/pipeline.md``: zero-bubble splits every backward, zb-drain a
            few, zb-lead as zb-drain with upstream ranks one forward ahead), a name added with
            ``register_schedule``, a ``Schedule``, one list per rank of ``(kind, microbatch, chunk)`` actions, or
            ``torch.distributed.pipelining``'s ``ScheduleGPipe``/``Schedule1F1B``/``ScheduleInterleaved1F1B``.
            ``"auto"`` (the default) runs zb-drain for three steps, timing each stage's forward, backward and split
            backward and how much they vary, then simulates 1F1B, zb-drain, zero-bubble and zb-lead with those
            costs, varying as measured, and keeps the fastest (a tie: the simpler), logging its choice on rank 0
            (the choice is not saved in checkpoints: a resumed run measures again). Where the layout decides, it
            measures nothing: ``"interleaved-1f1b"`` for ``virtual_stages`` > 1, ``"gpipe"`` for fewer micro-batches
            than ``pp``, ``"1f1b"`` when FSDP2 shards the parameters over dp (a split backward would keep the
            stage's parameters and gradients gathered until the step ends).
        virtual_stages: model chunks per pipeline rank (``"interleaved-1f1b"`` needs 2 or more).
        balance: ``"params"`` (balance stages by parameter count, a routed layer's experts counted as a token runs
            through them: top-k of E), ``"time"`` (by measured block time on the
            module's ``example_input_array``), or blocks per stage, e.g. ``[3, 5]``.
        split_points: names of the blocks that start stages 1.., e.g. ``["model.layers.12"]`` (overrides balance).
        blocks: name of the module holding the blocks to pipeline, or names of several run one after the other
            (an encoder's layers, then a decoder's); found automatically when omitted.
        tp_plan: ``"auto"``, or a mapping of module-name globs to styles (``"colwise"``, ``"rowwise"``,
            ``"colwise_gather"``, ``"vocab"``, ``"mha"``, ``"replicate"``) laid over the automatic plan.
        verify: check each parallelised block against the original on its first call.
        activation_checkpointing: recompute each block's activations in backward instead of keeping them
            (``torch.utils.checkpoint``, non-reentrant; the blocks are the repeated block sequence the pipeline
            partitioner finds, or ``blocks``, also without a pipeline). Same results, less activation memory, about
            one more forward of the blocks per step. See ``docs/pipeline.md``.
        loss_parallel: ``F.cross_entropy`` of a vocabulary-parallel LM head's logits is computed from each rank's
            shard of the vocabulary (the logits are still gathered for any other use), so neither the
            cross-entropy's saved log-softmax nor the logits' gradient is ever whole. Not for a head that FSDP2
            gathers (``vocab_exchange=False`` under dp sharding). See ``docs/tensor_parallel.md``.
        cp: context parallelism for long sequences: the blocks of the model's block sequence run on ``1/cp`` of
            each sample's positions (two chunks per rank, head and tail, so that causal attention costs every rank
            the same); each attention gathers the keys and values of the whole sequence over cp and runs the
            model's own attention call on this rank's query rows with the matching rows of its mask, so every mask
            stays exact. The cp ranks of a replica read the same batch and hold the same weights (FSDP2 shards them
            over ``dp x cp``). Each block is checked against its unsplit forward on its first call; a block that
            mixes positions outside its attention (a scan, a convolution over time) is refused. See
            ``docs/context_parallel.md``.
        cp_mode: how each attention sees the whole sequence under cp: ``"allgather"`` (keys and values all-gathered
            over cp, the model's call on this rank's query rows; any attention, any mask) or ``"a2a"`` (Ulysses:
            an all-to-all gives each rank ``1/cp`` of the heads over the whole sequence before each
            ``scaled_dot_product_attention`` call and returns its output after; query heads per tp rank must divide
            by cp, key/value heads are repeated when fewer; less traffic per rank for many-headed attention, no
            recompute). Attention that is not an SDPA call runs as ``"allgather"``, with a warning. ``"auto"``: the
            layout search chooses between them (with ``layout="auto"``, ``tp="auto"``, ``pp="auto"`` or
            ``ep="auto"``), by its cost of each; a mode whose heads do not divide is costed as ``"allgather"``.
        sequence_parallel: with tp > 1, Megatron's sequence parallelism: the blocks of the model's block sequence
            run norms, dropout and residual adds on this rank's part of the sequence (dim 1), gathering it before
            each attention/MLP and reduce-scattering after it (the bytes of the all-reduces they replace), so those
            activations take ``1/tp`` of the memory. Needs a sequence length divisible by ``tp``. Each block is
            checked against the original on its first call. See ``docs/tensor_parallel.md``.
        save_distributed_checkpoint: write checkpoints as a folder of shards (torch.distributed.checkpoint, each
            rank writing its own; ``lightning-tpp consolidate`` makes one file of it) instead of one whole-model
            file written by rank 0. Both load into any layout.
        async_save: write sharded checkpoints saved during ``fit`` in the background
            (``torch.distributed.checkpoint.async_save``): the step waits only for this rank's shards to be copied
            to host memory; the folder is published when every rank's shards are written, so a crash meanwhile
            leaves the previous checkpoint. The next save and the teardown wait for it and raise its failure on
            every rank (``AsyncCheckpointError``). See ``docs/checkpoints_and_failures.md``.
        dp_sharding: with dp > 1, how parameters, gradients and optimizer state are spread over the data-parallel
            ranks (torch's FSDP2, ``fully_shard`` on the dp mesh axis, a unit per block): ``"full_shard"`` (each
            rank holds 1/dp of them; parameters gathered per block for forward and again for backward),
            ``"shard_grad_op"`` (the same, parameters kept gathered from forward to backward: one all-gather less
            per block and step, more memory) or ``"no_shard"`` (replicated, gradients all-reduced). Lightning's
            spellings (``"FULL_SHARD"``, ...) are accepted. See ``docs/large_models.md``.
        vocab_exchange: with dp sharding, the vocabulary matrices (an embedding or LM head larger than a block)
            stay cut by rows over dp and each rank computes with its rows on every dp rank's tokens (tokens are
            exchanged, the matrix is never gathered: FSDP2's gather of it set the peak). ``False``: FSDP2 gathers
            them like every other unit. See ``docs/large_models.md``.
        loss_normalization: how a loss that is a mean over tokens (``F.cross_entropy``/``F.nll_loss`` with
            ``reduction="mean"``, Hugging Face's own losses: targets of ``ignore_index`` not counted) is averaged when
            a batch runs as micro-batches: ``"batch"`` (default) over every counted token of the replica's batch, as
            one process computes it; ``"global"`` over every token of every dp replica (as torchtitan; also without
            a pipeline); ``"microbatch"`` each micro-batch's mean weighted by its share of the samples. A reduction
            written by hand is named in a warning where micro-batches count different tokens. See
            ``docs/pipeline.md``.
        print_plan: print the plan table on global rank 0 at setup.
        process_group_backend: ``"gloo"``/``"nccl"``; default by device.
        timeout: how long a collective may wait, and how long a silent peer is tolerated before every rank stops
            with a message naming it (the latter capped at 60 s).
        on_nonfinite: a NaN/inf loss on any rank: ``"raise"`` on every rank, ``"skip"`` the step everywhere, or
            ``"warn"`` and go on. All ranks take the same decision.
        pipeline_metrics: with pp > 1, log ``pipeline/`` metrics (measured and theoretical bubble, stage imbalance,
            per-stage compute/send/receive/wait seconds, samples per second) through Lightning's loggers every
            ``log_every_n_steps``; timing costs two clock reads per action, the values one all-gather per logging
            step. See ``docs/pipeline_observability.md``.
        compile: ``True`` (or a dict of ``torch.compile`` options: ``backend``, ``mode``, ``options``, ``dynamic``,
            ``fullgraph``) compiles each of this rank's blocks after tensor, sequence, context and expert
            parallelism and activation checkpointing, before FSDP2 (regional compilation); the first-call checks
            run eagerly. Schedules that split backward (zero-bubble and its variants) do not run compiled blocks:
            refused at setup, and ``schedule="auto"`` takes 1F1B. Dynamo's counters are logged under
            ``compile/``. See ``docs/compile.md``.
        weights: a file or folder of weights loaded into the model at the end of setup, each rank reading only
            its own slices: a Hugging Face ``model.safetensors``, a folder with it or with
            ``model.safetensors.index.json`` (sharded), a consolidated Lightning ``.ckpt``, or a sharded
            checkpoint folder (model weights only). Missing, unexpected and mis-shaped keys raise one
            ``WeightsMismatchError`` on every rank (the module's ``strict_loading = False`` skips missing and
            unexpected ones). ``trainer.fit(ckpt_path=...)`` still restores over them.
        weights_prefix: the module path put before the file's keys to name the model's parameters
            (``"model."`` for a Hugging Face model held as ``self.model``); ``"auto"`` finds it.
        start_method: ``"auto"`` (``"fork"`` in notebooks, else ``"popen"``: the script is run again per rank),
            ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``.
    """

    tp: Union[int, Literal["auto"]] = 1
    pp: Union[int, Literal["auto"]] = 1
    dp: Union[int, Literal["auto"]] = "auto"
    ep: Union[int, Literal["auto"]] = 1
    cp: int = 1
    cp_mode: Literal["allgather", "a2a", "auto"] = "allgather"
    layout: Optional[Literal["auto"]] = None
    device_memory: Optional[Union[float, str]] = None
    global_batch: Optional[int] = None
    microbatches: Optional[int] = None  # None: the default (2 * pp, or what a fixed schedule runs), set at construction
    schedule: ScheduleLike = "auto"
    virtual_stages: int = 1
    balance: Union[Literal["params", "time"], Sequence[int]] = "params"
    split_points: Optional[Sequence[str]] = None
    blocks: Optional[Union[str, Sequence[str]]] = None
    tp_plan: Union[Literal["auto"], Mapping[str, str]] = "auto"
    verify: bool = True
    activation_checkpointing: bool = False
    loss_parallel: bool = True
    sequence_parallel: bool = False
    dp_sharding: DPSharding = "full_shard"
    vocab_exchange: bool = True
    loss_normalization: LossNormalization = "batch"
    print_plan: bool = True
    save_distributed_checkpoint: bool = True
    async_save: bool = False
    on_nonfinite: Literal["raise", "skip", "warn"] = "raise"
    pipeline_metrics: bool = True
    compile: Union[bool, Mapping[str, Any]] = False
    process_group_backend: Optional[str] = None
    timeout: Optional[timedelta] = default_pg_timeout
    start_method: Literal["auto", "popen", "spawn", "fork", "forkserver"] = "auto"
    weights: Optional[Union[str, "os.PathLike[str]"]] = None
    weights_prefix: str = "auto"

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - normalising a frozen field
        set_("dp_sharding", normalize_sharding(self.dp_sharding))
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be True or False")
        request = auto_request(tp=self.tp, pp=self.pp, dp=self.dp, layout=self.layout,
                               device_memory=self.device_memory, global_batch=self.global_batch,
                               activation_checkpointing=self.activation_checkpointing,
                               dp_sharding=self.dp_sharding, ep=self.ep, cp=self.cp, cp_mode=self.cp_mode)
        # a searched degree is decided at setup (with_layout); until then the layout is checked as tp = pp = 1
        tp, pp = (1, 1) if request is not None else (self.tp, self.pp)
        tp = 1 if tp == "auto" else tp
        pp = 1 if pp == "auto" else pp
        resolve_dims(tp * pp * self.cp * (self.dp if isinstance(self.dp, int) else 1), tp, pp, self.dp,
                     self.cp)  # types and ranges
        if self.cp_mode not in ("allgather", "a2a", "auto"):
            raise ValueError(f"cp_mode={self.cp_mode!r} must be 'allgather' (keys and values all-gathered), 'a2a' "
                             f"(Ulysses: positions exchanged for heads) or 'auto' (the layout search chooses)")
        if self.cp_mode == "auto" and request is None:
            raise ValueError("cp_mode='auto' is chosen by the layout search: pass layout='auto' (or tp='auto' / "
                             "pp='auto' / ep='auto') with it, or cp_mode='allgather' or 'a2a'")
        auto = isinstance(self.schedule, str) and self.schedule == AUTO_SCHEDULE
        set_("schedule", AUTO_SCHEDULE if auto else normalize_schedule(self.schedule))
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise ValueError(f"microbatches={self.microbatches!r} must be a positive integer")
        if self.tp_plan != "auto" and not isinstance(self.tp_plan, Mapping):
            raise TypeError(f"tp_plan must be 'auto' or a mapping of module globs to styles, got {self.tp_plan!r}")
        if self.ep != AUTO:  # its type and range; that it divides dp*tp is checked with the world
            check_ep(self.ep, dp=self.ep, tp=1)
        fixed = None if auto else resolve_schedule(self.schedule).fixed  # action lists: for one micro-batch count
        if self.microbatches is None:
            set_("microbatches", fixed[1] if fixed else 2 * pp)
        if pp > 1:
            if auto:
                settle_auto(pp, self.microbatches, self.virtual_stages)  # raises for a layout no schedule fits
            else:
                validate_schedule(self.schedule, pp, self.microbatches, self.virtual_stages)
        if isinstance(self.balance, str) and self.balance not in ("params", "time"):
            raise ValueError(f"balance={self.balance!r} must be 'params', 'time' or a list of blocks per stage")
        if self.sequence_parallel and request is None and tp < 2:
            raise ValueError(f"sequence_parallel=True cuts the sequence over the tensor-parallel ranks and needs "
                             f"tp >= 2, got tp={tp}")
        set_("loss_normalization", check_normalization(self.loss_normalization))
        check_async_save(self.async_save, sharded=self.save_distributed_checkpoint)
        if self.on_nonfinite not in ("raise", "skip", "warn"):
            raise ValueError(f"on_nonfinite={self.on_nonfinite!r} must be 'raise', 'skip' or 'warn'")
        if self.weights is not None:
            set_("weights", os.fspath(self.weights))
        check_compile(self.compile)

    def auto_request(self) -> Any:
        """What ``layout="auto"`` / ``tp="auto"`` / ``pp="auto"`` leave to the search (an ``AutoRequest``), or None
        when every degree is given."""
        return auto_request(tp=self.tp, pp=self.pp, dp=self.dp, layout=self.layout, device_memory=self.device_memory,
                            global_batch=self.global_batch, activation_checkpointing=self.activation_checkpointing,
                            dp_sharding=self.dp_sharding, ep=self.ep, cp=self.cp, cp_mode=self.cp_mode)

    def with_layout(self, layout: Any) -> "TensorPipeConfig":
        """The config the search chose (a ``lightning_tpp.layout.Layout``): the degrees, micro-batches, schedule,
        activation checkpointing and dp sharding given, as a user could have written them."""
        return dataclasses.replace(
            self, tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep, cp=layout.cp,
            cp_mode=layout.cp_mode if self.cp_mode == "auto" else self.cp_mode,
            microbatches=layout.microbatches, virtual_stages=1,
            schedule=layout.schedule if layout.pp > 1 else self.schedule,
            activation_checkpointing=layout.activation_checkpointing, dp_sharding=layout.dp_sharding, layout=None,
            device_memory=None, global_batch=None)

    def cutting(self) -> dict[str, str]:
        """The arguments that decide how the model is cut and run (``CUTTING``), as compared on adoption."""
        return {k: repr(getattr(self, k)) for k in CUTTING}

    def agreement(self) -> dict[str, str]:
        """Every argument the ranks must agree on: all but ``print_plan`` (``print_plan=rank == 0`` is usual)."""
        return {f.name: repr(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "print_plan"}


def planning_config(tp: int, pp: int, virtual: int = 1, *, balance: Union[str, Sequence[int]] = "params",
                    split_points: Optional[Sequence[str]] = None, blocks: Optional[Union[str, Sequence[str]]] = None,
                    tp_plan: Union[str, Mapping[str, str]] = "auto", ep: int = 1, cp: int = 1,
                    cp_mode: str = "allgather") -> TensorPipeConfig:
    """The config the memory planner and the layout profile cut a meta copy with (``steps.run``): the cut
    of a run at these degrees, no first-call checks (a meta copy computes nothing)."""
    return TensorPipeConfig(tp=tp, pp=pp, ep=ep, cp=cp, cp_mode=cp_mode, microbatches=pp, virtual_stages=virtual,
                            schedule="interleaved-1f1b" if virtual > 1 else "1f1b", balance=balance,
                            split_points=split_points, blocks=blocks, tp_plan=tp_plan, verify=False, print_plan=False)
