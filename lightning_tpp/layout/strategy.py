"""``TensorPipeStrategy(layout="auto")`` (or ``tp="auto"`` / ``pp="auto"``): the choice made at setup, once the
processes exist and before the mesh is built from tp, pp and dp.

    every rank: profile the model on meta (deterministic), measure the link (an all-reduce, every rank)
    rank 0:     time one block of each kind per micro-batch size and an optimizer step (on CPU every rank times
                them at once: the cores are shared as in a step; each figure the median over the ranks), search,
                log the top layouts and why
    every rank: take rank 0's choice (one broadcast), set tp/pp/dp/ep, micro-batches, schedule, checkpointing,
                sharding
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import fields, is_dataclass, replace
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from lightning_tpp._compat import collect_rng_states, drop_persistent_iterator, run_data_source, set_rng_states
from lightning_tpp.layout.cost import BlockTimes
from lightning_tpp.layout.links import DEVICES, DeviceSpec, cpu_memory_share, cpu_spec, measure_link
from lightning_tpp.layout.plan import Layout
from lightning_tpp.layout.profile import profile_model
from lightning_tpp.config import AUTO, AutoLayoutError, AutoRequest, auto_request  # noqa: F401 (their home)
from lightning_tpp.layout.search import Ranking, search_layouts
from lightning_tpp.layout.timing import Meeting, time_blocks, time_copy, time_ends, time_optimizer


def batch_shape(module: nn.Module, data: Any = None) -> tuple[int, int]:
    """(sequences, tokens) of one per-process batch: the LightningModule's ``example_input_array`` (token ids) where
    set (the override), else the first batch of ``data``, the run's :func:`~lightning_tpp._compat.run_data_source`."""
    return _shape_and_origin(module, data)[:2]  # type: ignore[return-value]


def _shape_and_origin(module: nn.Module, data: Any) -> tuple[int, int, str]:
    """:func:`batch_shape` and where it came from (for the log)."""
    example = getattr(module, "example_input_array", None)
    if example is None and data is not None and data.is_defined():
        return _first_batch_shape(data)
    if isinstance(example, (tuple, list)) and example:
        example = example[0]
    if not _is_token_ids(example):
        unset = " (unset) and the run has no data to read a first batch from" if example is None else ""
        raise AutoLayoutError(
            f"layout='auto' times the model's blocks on the real batch shape and reads it from the LightningModule's "
            f"example_input_array, which must be one per-process batch of token ids (batch, tokens){unset}; got "
            f"{type(example).__name__ if not isinstance(example, Tensor) else tuple(example.shape)}. Set "
            f"self.example_input_array = torch.zeros(batch_size, seq_len, dtype=torch.long)")
    return int(example.shape[0]), int(example.shape[1]), "example_input_array"


_OVERRIDE = "set self.example_input_array = torch.zeros(batch_size, seq_len, dtype=torch.long) in the LightningModule"
_READS = "layout='auto' reads one per-process batch shape at strategy setup from the first batch of"


def _first_batch_shape(source: Any) -> tuple[int, int, str]:
    """The token ids' shape in the first batch of the run's data (the loader(s) given to the Trainer, or what the
    module's or datamodule's ``*_dataloader`` hook returns), read from a fresh iterator: the Trainer's own is not made
    yet and loses nothing. The random states are put back after, so that a shuffling sampler's draw (or the hook's)
    leaves the run as reproducible as one with ``example_input_array`` (its epoch order, ``configure_model``'s
    weights). A data hook called here is called again by Lightning, as ``reload_dataloaders_every_n_epochs`` does;
    ``setup()`` is not called early: it runs after ``prepare_data()`` (downloads), which has not run either."""
    import lightning as L
    from lightning.pytorch.utilities import CombinedLoader

    owner = type(source.instance).__name__
    hooked = isinstance(source.instance, (L.LightningModule, L.LightningDataModule))
    run = {"train_dataloader": "fit", "val_dataloader": "validate"}.get(source.name, source.name.split("_")[0])
    origin = f"{owner}.{source.name}()" if hooked else f"the {owner} given to trainer.{run}()"
    states, found = collect_rng_states(), []
    try:
        loaders = source.dataloader()
        for loader in loaders.flattened if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders).flattened:
            batch = _first_batch(loader, origin)
            ids = _token_ids(batch)
            if ids is not None:
                return int(ids.shape[0]), int(ids.shape[1]), f"the first batch of {origin}"
            found.append(_describe(batch))
    except AutoLayoutError:
        raise
    except Exception as err:
        fix = f"let {source.name}() work before setup() (build its dataset in {owner}.__init__ or in " \
              f"{source.name}() itself)" if hooked else "give data that reads"
        raise AutoLayoutError(f"{_READS} {origin}, before Lightning calls prepare_data() and setup(), and reading it "
                              f"raised {type(err).__name__}: {err}. Either {_OVERRIDE} (then no data hook is called "
                              f"early), or {fix}") from err
    finally:
        set_rng_states(states)
    raise AutoLayoutError(
        f"layout='auto' times the model's blocks on token ids (a 2-D integer tensor (batch, tokens): the batch itself, "
        f"a dict's 'input_ids', else the first such tensor in it) and found none in the first batch of {origin}: "
        f"{'; '.join(found)}. Give the model's token ids in the batch, or {_OVERRIDE}")


def _first_batch(loader: Any, origin: str) -> Any:
    """The first batch of a fresh iterator of ``loader``; none where ``loader`` is itself an iterator (read once: its
    first batch would be the Trainer's)."""
    iterator = iter(loader)
    if iterator is loader:
        raise AutoLayoutError(f"{_READS} {origin}, an iterator ({type(loader).__name__}) that is read once: its first "
                              f"batch would be taken from training. Give a DataLoader (or any re-iterable), or "
                              f"{_OVERRIDE}")
    try:
        return next(iterator)
    except StopIteration:
        raise AutoLayoutError(f"{_READS} {origin}, which is empty; give it data, or {_OVERRIDE}") from None
    finally:
        drop_persistent_iterator(loader)
        del iterator  # a worker pool's iterator shuts its workers down when collected


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() == 2 and value.dtype != torch.bool and \
        not (value.is_floating_point() or value.is_complex())


def _token_ids(batch: Any) -> Optional[Tensor]:
    """The model's input in a batch: the batch itself, a mapping's ``input_ids`` (Hugging Face collators), else the
    first 2-D integer tensor, depth first (``(x, y)``: ``x``)."""
    if _is_token_ids(batch):
        return batch
    if isinstance(batch, Mapping):
        items = [batch["input_ids"]] if "input_ids" in batch else []
        items += [v for k, v in batch.items() if k != "input_ids"]
    elif is_dataclass(batch) and not isinstance(batch, type):
        items = [getattr(batch, f.name) for f in fields(batch)]
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        return None
    return next((ids for ids in map(_token_ids, items) if ids is not None), None)


def _describe(batch: Any, depth: int = 0) -> str:
    """A batch's structure in a line, for an error."""
    if isinstance(batch, Tensor):
        return f"{str(batch.dtype).replace('torch.', '')} tensor {tuple(batch.shape)}"
    if depth < 2 and isinstance(batch, Mapping):
        return "{" + ", ".join(f"{k!r}: {_describe(v, depth + 1)}" for k, v in list(batch.items())[:8]) + "}"
    if depth < 2 and isinstance(batch, (list, tuple)):
        return f"{type(batch).__name__}(" + ", ".join(_describe(v, depth + 1) for v in batch[:8]) + ")"
    return type(batch).__name__


def shared_batch_shape(module: nn.Module, data: Any, *, rank: int, world: int) -> tuple[int, int]:
    """Rank 0's batch shape on every rank (one broadcast): the layout is rank 0's choice, timed on the same shape on
    every rank; rank 0 alone calls a data hook or reads a batch. Rank 0's error is raised on every rank."""
    found: list[Any] = [None]
    error: Optional[Exception] = None
    if rank == 0:
        try:
            batch, seq, origin = _shape_and_origin(module, data)
            found = [(batch, seq)]
            rank_zero_info(f"layout='auto': one per-process batch is {batch} x {seq} tokens ({origin})")
        except Exception as err:  # every rank raises it, instead of waiting for a rank 0 that is gone
            error, found = err, [f"{type(err).__name__}: {err}"]
    if dist.is_initialized() and world > 1:
        dist.broadcast_object_list(found, src=0)
    if error is not None:
        raise error
    if isinstance(found[0], str):
        raise AutoLayoutError(f"layout='auto' found no batch shape (rank 0): {found[0]}")
    return found[0]


def choose(module: nn.Module, request: AutoRequest, *, world: int, rank: int, local_processes: int,
           device: torch.device, model: Optional[nn.Module] = None, data: Any = None
           ) -> tuple[Layout, Optional[Ranking]]:
    """Rank 0's choice on every rank (its ranking, on rank 0 only). ``module`` (its ``example_input_array``) or else
    ``data`` (the run's data source) gives the batch shape; ``model`` (default ``module``) is what is profiled."""
    batch, seq = shared_batch_shape(module, data, rank=rank, world=world)
    target = _profiled(module) if model is None else model
    if not any(True for _ in target.parameters()):
        raise AutoLayoutError("layout='auto' profiles the model at setup and found no parameters: the "
                              "LightningModule builds no layer in __init__ and none in configure_model")
    dtype = next(p.dtype for p in target.parameters())
    profile = profile_model(target, seq_len=seq, dtype=dtype)
    link = measure_link(large=link_size(profile), device=device)  # every rank: a collective
    together = device.type == "cpu" and world > 1
    ranking = None
    chosen: list[Any] = [None]
    if together and rank != 0:
        try:
            block_times(target, profile, batch, device=device, dtype=dtype, local_processes=local_processes,
                        together=True)  # beside rank 0's timing: the cores shared as a step shares them
        except ValueError:
            pass  # rank 0 meets it too and reports it to every rank
    if rank == 0:
        try:
            times = block_times(target, profile, batch, device=device, dtype=dtype, local_processes=local_processes,
                                together=together)
            ranking = _rank(profile, request, device, link, local_processes, world, batch, times)
            chosen = [ranking.best.layout]
            rank_zero_info(f"layout='auto':\n{ranking.table(top=5)}\n{ranking.why()}")
        except ValueError as err:  # every rank raises it, instead of waiting for a rank 0 that is gone
            chosen = [f"{type(err).__name__}: {err}"]
    if dist.is_initialized() and world > 1:
        dist.broadcast_object_list(chosen, src=0)
    if isinstance(chosen[0], str):
        raise AutoLayoutError(f"layout='auto' found no layout (rank 0's search): {chosen[0]}")
    return chosen[0], ranking


def _profiled(module: nn.Module) -> nn.Module:
    """What the profile runs: the module, or where it has no ``forward`` of its own (a LightningModule that calls its
    model in ``training_step``), its child holding the most parameters."""
    import lightning as L
    if type(module).forward not in (L.LightningModule.forward, nn.Module.forward):
        return module
    children = [c for c in module.children() if any(True for _ in c.parameters())]
    if not children:
        return module
    return max(children, key=lambda c: sum(p.numel() for p in c.parameters()))


def link_size(profile: Any) -> int:
    """Elements of the link's large all-reduce: the model's gradients (1 Mi to 16 Mi elements). Measured on this
    machine's gloo: 4 MB fitted with 4 KB predicts a 14 MB all-reduce at half its time (caches), so the link is
    fitted at the size that the dp all-reduce moves."""
    return int(min(max(profile.whole_params, 1 << 20), 1 << 24))


def block_times(target: nn.Module, profile: Any, batch: int, *, device: torch.device, dtype: torch.dtype,
                local_processes: int, together: bool) -> BlockTimes:
    """One block of each kind timed per micro-batch size of ``batch``, the ends, an optimizer step and a copy. ``together``:
    every process of the machine times at the same moment, meeting at a barrier before each (CPU processes share
    its cores, and whatever else runs there: what a step meets), taken as measured, with the waits at those
    barriers (``Meeting.straggle``), each figure the median over the processes (:func:`pooled`); else the time
    alone, scaled by processes per core."""
    sizes = sorted({batch // m for m in range(1, batch + 1) if batch % m == 0})
    sync = Meeting() if together and dist.is_initialized() and dist.get_world_size() > 1 else None
    measured = time_blocks(target, profile, sizes, device=device, dtype=dtype, together=together, sync=sync)
    ends = time_ends(target, profile, sizes, device=device, dtype=dtype, together=together, sync=sync)
    optimizer = time_optimizer(target, profile, device=device, dtype=dtype, together=together, sync=sync)
    copy = time_copy(link_size(profile), device=device, dtype=dtype, together=together, sync=sync)
    straggle = 0.0
    if sync is not None:
        sync()  # closes the copy's work
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (measured, ends, optimizer, copy, sync.straggle))
        measured, ends, optimizer, copy, straggle = pooled(every)
    return BlockTimes(measured, slowdown=1.0 if together else _slowdown(device, local_processes), optimizer=optimizer,
                      copy=copy, straggle=straggle, ends=ends)


def pooled(every: list[tuple]) -> tuple:
    """Every process's timing figures (``measured``, ``ends``, ``optimizer``, ``copy``, ``straggle``), each the median
    over the processes. Processes that share cores do not share them evenly over a few milliseconds: the same block
    timed at the same moment took 11 ms on two of four processes and 25 ms on the other two (T5, 4 processes on 2
    cores; the whole model's blocks and ends added up differed by up to 10% between processes). A step's pace is all
    of theirs, so rank 0 does not decide from its own figures alone."""
    def median(values: list[float]) -> float:
        ordered, n = sorted(values), len(values)
        return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2

    def table(tables: list[dict]) -> dict:  # each entry over the processes that have it
        keys = set().union(*tables)
        return {k: (median([t[k][0] for t in tables if k in t]), median([t[k][1] for t in tables if k in t]))
                for k in keys}

    measured, ends, optimizer, copy, straggle = zip(*every)
    return (table(list(measured)), table(list(ends)),
            (median([o[0] for o in optimizer]), median([o[1] for o in optimizer])), median(list(copy)),
            median(list(straggle)))


def _rank(profile: Any, request: AutoRequest, device: torch.device, link: Any, local_processes: int, world: int,
          batch: int, times: BlockTimes) -> Ranking:
    """Rank 0's search: the device's spec and the ranking."""
    spec = _device(device, link, local_processes, request.device_memory)
    return search_layouts(profile, world=world, device=spec, times=times, batch=batch, device_memory=spec.memory,
                          margin=request.margin, global_batch=request.global_batch, tp=request.tp, pp=request.pp,
                          activation_checkpointing=request.activation_checkpointing,
                          shardings=(request.dp_sharding,) if request.dp_sharding else None,  # type: ignore[arg-type]
                          backend="gloo" if device.type == "cpu" else "nccl", ep=request.ep, cp=request.cp,
                          cp_mode=request.cp_mode)


def _device(device: torch.device, link: Any, local_processes: int, memory: Optional[float]) -> DeviceSpec:
    """The spec the search uses: the table's entry for a known GPU, else the measured link on its own."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        total = float(torch.cuda.get_device_properties(device).total_memory)
        known = next((s for k, s in DEVICES.items() if k in name), None)
        spec = known or DeviceSpec(name, flops=0.0, efficiency=1.0, memory=total, memory_bandwidth=1e12,
                                   intra=link, inter=link, devices_per_node=local_processes, overlap=0.8)
        return replace(spec, memory=memory or total, devices_per_node=local_processes)
    return cpu_spec(link, memory=memory or cpu_memory_share(local_processes), processes=local_processes)


def _slowdown(device: torch.device, local_processes: int) -> float:
    """Processes sharing the CPU cores each compute this much slower than the block timed alone."""
    if device.type != "cpu":
        return 1.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1.0, local_processes / cores)


def _run_data(module: Any) -> Any:
    """The data source of the run the module is attached to (None without a Trainer)."""
    try:
        trainer = module.trainer
    except RuntimeError:  # not attached to a Trainer
        return None
    return run_data_source(trainer)


class AutoLayout:
    """Strategy mixin: with a searched layout, decides the degrees before the mesh is built (``_before_mesh``): the
    strategy's ``config`` becomes the chosen one (``TensorPipeConfig.with_layout``)."""

    _auto_layout: Optional[AutoRequest]
    config: Any  # lightning_tpp.config.TensorPipeConfig
    layout_choice: Optional[Layout] = None
    layout_ranking: Optional[Ranking] = None  # rank 0's ranked candidates (None on other ranks)

    def _before_mesh(self) -> None:
        request = self._auto_layout
        module = getattr(self, "lightning_module", None)
        if request is not None and module is not None:
            from lightning_tpp.parallel_state import ParallelState
            state = ParallelState.of(module)
            if self.layout_choice is None and state is not None and state.layout is not None:
                self.layout_choice = state.layout  # the model is already cut that way: keep it
            if self.layout_choice is None:
                self._build_on_meta(module)
                self.layout_choice, self.layout_ranking = choose(
                    module, request, world=self.world_size, rank=self.global_rank,  # type: ignore[attr-defined]
                    local_processes=self.num_processes, device=self.root_device,  # type: ignore[attr-defined]
                    data=_run_data(module))
            self._apply_layout(self.layout_choice, module)
        super()._before_mesh()  # type: ignore[misc]

    def _build_on_meta(self, module: Any) -> None:
        """A model built in ``configure_model`` (Lightning calls it after the mesh exists): built here, on meta, as
        the Trainer would build it (the same contexts), so that the search sees it. Lightning's own call comes later
        and, as its documentation asks of the hook, finds the layers there (or builds them again, on meta too)."""
        from lightning.pytorch.utilities.model_helpers import is_overridden
        if any(True for _ in module.parameters()) or not is_overridden("configure_model", module):
            return
        try:
            with self.tensor_init_context(), self.model_sharded_context(), \
                    self.precision_plugin.module_init_context():  # type: ignore[attr-defined]
                module.configure_model()
        except Exception as err:
            raise AutoLayoutError(
                f"layout='auto' builds the model of configure_model on the meta device before choosing the layout "
                f"(the mesh does not exist yet), and configure_model failed there: {type(err).__name__}: {err}. "
                f"Build the model in __init__ under trainer.init_module(empty_init=True), or give tp, pp and dp"
            ) from err

    def _apply_layout(self, layout: Layout, module: nn.Module) -> None:
        self.config = self.config.with_layout(layout)  # validated: the schedule fits the chosen pp
        if self._auto_layout is not None and self._auto_layout.global_batch is not None:
            trainer = module.trainer
            if trainer.accumulate_grad_batches not in (1, layout.accumulate):
                raise AutoLayoutError(f"global_batch={self._auto_layout.global_batch} sets gradient accumulation "
                                      f"to {layout.accumulate} for {layout.describe()}, and the Trainer was given "
                                      f"accumulate_grad_batches={trainer.accumulate_grad_batches}; give one of them")
            trainer.accumulate_grad_batches = layout.accumulate
