"""Private Lightning and torch names that lightning_tpp relies on, each wrapped once here; ``tests/unit/test_compat.py``
fails loudly when an upgrade moves one of them. No other module imports a ``_``-prefixed name from lightning, torch or
torchmetrics (also checked there). Why each is kept: see docs/architecture.md, "Lightning integration"."""

from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.serialization import _get_layout
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "BatchNormBase", "InstanceNormBase", "MultiProcessingLauncher", "StorageInfo", "StrategyRegistryType",
    "SubprocessScriptLauncher", "SummaryCallbackAdapter", "TorchDispatchMode", "all_gather_ddp_if_available",
    "allow_graphs_per_function", "attention_with_lse", "attention_with_lse_backward", "caching_save_planner",
    "collect_rng_states", "compile_call", "dcp_metadata_path", "default_store", "distributed_is_initialized",
    "drop_persistent_iterator", "drop_save_plan_cache", "flatten_dense_tensors", "fsdp_lazy_init", "fsdp_reduce_now",
    "fsdp_gathered", "fsdp_sharded_params", "fsdp_state", "function_modes", "get_layout",
    "hf_install_output_hook", "hf_output_collector", "in_backward", "init_dist_connection", "layer_sync_requested",
    "maybe_mark_dynamic", "optimizer_to_device", "optimizers_to_device", "requested_weights_only", "run_data_source",
    "set_rank_zero", "set_rng_states", "storage_key", "sync_ddp_if_available", "tree_flatten", "tree_map",
    "tree_unflatten", "unflatten_dense_tensors",
]

# --- lightning.fabric: the process group, collectives, optimizer state and RNG states (what DDPStrategy uses) ---------
init_dist_connection = _init_dist_connection
sync_ddp_if_available = _sync_ddp_if_available
all_gather_ddp_if_available = _all_gather_ddp_if_available
distributed_is_initialized = _distributed_is_initialized
optimizer_to_device = _optimizer_to_device
optimizers_to_device = _optimizers_to_device
collect_rng_states = _collect_rng_states
set_rng_states = _set_rng_states
StrategyRegistryType = _StrategyRegistry  # the type of ``lightning.pytorch.strategies.StrategyRegistry`` (a hint)

# --- lightning.pytorch launchers (a Strategy's ``_configure_launcher`` sets ``self._launcher`` to one of them) -------
SubprocessScriptLauncher = _SubprocessScriptLauncher

# --- torch ----------------------------------------------------------------------------------------------------------
flatten_dense_tensors = _flatten_dense_tensors
unflatten_dense_tensors = _unflatten_dense_tensors
StorageInfo = _StorageInfo  # a class pickled into DCP's ``.metadata``: the safe unpickler must admit it
get_layout = _get_layout  # ``torch.serialization._get_layout``: pickled into DCP metadata (name -> torch.layout)
BatchNormBase = _BatchNorm  # every batch normalisation (BatchNorm1d/2d/3d, SyncBatchNorm, lazy ones): no public base
InstanceNormBase = _InstanceNorm  # InstanceNorm1d/2d/3d and lazy ones


def storage_key(t: Any) -> int:
    """The identity of a tensor's storage, also on the meta device (where every data pointer is 0): the address of
    its ``StorageImpl``, shared by its views."""
    return t.untyped_storage()._cdata


def layer_sync_requested(strategy: Any) -> bool:
    """``Trainer(sync_batchnorm=True)``: the accelerator connector sets a ``ParallelStrategy``'s ``_layer_sync`` (what
    DDP/FSDP apply in their setup); no public accessor."""
    return getattr(strategy, "_layer_sync", None) is not None


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (a checkpointed block recomputing its forward)."""
    return torch._C._current_graph_task_id() != -1


def enclosing_saved_tensors_hooks() -> Optional[tuple[Any, Any]]:
    """The (pack, unpack) of the innermost ``torch.autograd.graph.saved_tensors_hooks`` in effect, or None: hooks do
    not nest (the innermost alone sees what autograd saves), so one installed inside another must call it."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


@contextlib.contextmanager
def outside_saved_tensors_hooks() -> Iterator[None]:
    """Run without the ``saved_tensors_hooks`` in effect around the caller (activation checkpointing's, which would
    drop what a first-call check saves for its own backward, or recompute the step's instead); put back after.
    torch has no public way to leave them: its default-hooks stack, popped and pushed back."""
    hooks = torch._C._autograd
    popped = []
    while (top := hooks._top_saved_tensors_default_hooks(False)) is not None:
        popped.append(top)
        hooks._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(popped):
            hooks._push_saved_tensors_default_hooks(pack, unpack)


@contextlib.contextmanager
def outside_function_modes() -> Iterator[None]:
    """Run without the torch-function modes entered around the caller (the zero-bubble split's weight-gradient
    store, which would keep a check's weight gradients for the schedule's ``W``); modes entered inside still apply,
    and so do modes marked ``keep_in_checks`` (context parallelism's attention over the whole sequence).
    torch has no public way to leave every mode: ``_pop_mode_temporarily`` per mode on the stack."""
    from torch.overrides import _pop_mode_temporarily

    with contextlib.ExitStack() as stack:
        popped = [stack.enter_context(_pop_mode_temporarily()) for _ in range(torch._C._len_torch_function_stack())]
        for mode in reversed(popped):  # what a computation means (context parallelism's attention) still applies
            if getattr(mode, "keep_in_checks", False):
                stack.enter_context(mode)
        yield


def attention_with_lse(query: Any, key: Any, value: Any, is_causal: bool, scale: Optional[float]) -> tuple:
    """Attention's output and its rows' log-sum-exp (fp32, ``(batch, heads, rows)``) on CPU, from the kernel SDPA
    runs there (causal: top-left). Public SDPA returns no log-sum-exp, which context parallelism needs to join the
    parts of one row's keys and to run backward without recomputing:
    ``aten._scaled_dot_product_flash_attention_for_cpu`` (CUDA's kernels have other private signatures; not wired
    without a GPU to check them on)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal, scale=scale)


def attention_with_lse_backward(grad: Any, query: Any, key: Any, value: Any, out: Any, lse: Any, is_causal: bool,
                                scale: Optional[float]) -> tuple:
    """The gradients of :func:`attention_with_lse`'s query, key and value, given the output and log-sum-exp the rows
    end with (those of a larger attention the call is one part of: its keys' share of the gradient)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, query, key, value, out, lse, 0.0, is_causal, scale=scale)


def function_modes() -> list[Any]:
    """The torch-function modes entered around the caller, outermost first (torch has no public accessor)."""
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def default_store() -> Any:
    """The default process group's key-value store (no public accessor in torch)."""
    return dist.distributed_c10d._get_default_store()


def caching_save_planner(key: str, planner_class: Any = None) -> Any:
    """A ``DefaultSavePlanner`` (or ``planner_class``, a subclass) that keeps its plans under ``key``
    (``enable_plan_caching=True``): a later save of the same tensors skips building and exchanging the plans. DCP
    keys its class-level cache by the planner's class name unless told otherwise, so two savers in one process
    would share (and merge) their plans."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    planner = (planner_class or DefaultSavePlanner)(enable_plan_caching=True)
    planner._cached_plans_key = key
    return planner


def drop_save_plan_cache(key: str) -> None:
    """Forget what :func:`caching_save_planner` cached under ``key`` (held in ``SavePlanner``'s class attributes)."""
    from torch.distributed.checkpoint import SavePlanner

    for name in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
                 "_cached_final_save_plan"):
        getattr(SavePlanner, name).pop(key, None)


def dcp_metadata_path(reader: Any, rank: Optional[int]) -> Any:
    """Where a ``FileSystemReader`` reads its ``.metadata`` from."""
    return reader._get_metadata_path(rank)


def set_rank_zero(rank: int) -> None:
    """Lightning's own pattern (DDPStrategy._set_world_ranks): ``rank_zero_only`` reads this class attribute."""
    rank_zero_only.rank = rank


class MultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher with its two private hooks under names of ours.

    ``run_worker`` is what a worker process runs (``_wrapping_function``); ``collect_rank_zero_results`` is called
    on every rank after the trainer function returned, and builds what goes back to the main process."""

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        self.run_worker(*args, **kwargs)

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        return self.collect_rank_zero_results(trainer, results)

    def run_worker(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)

    def collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        return super()._collect_rank_zero_results(trainer, results)


class SummaryCallbackAdapter:
    """Mixin for a ``ModelSummary``/``RichModelSummary`` callback: Lightning's ``on_fit_start`` builds its summary in
    the private ``_summary(trainer, pl_module)`` and reads the depth from ``_max_depth``; a subclass overrides
    ``build_summary`` and reads ``summary_max_depth`` instead."""

    def _summary(self, trainer: Any, pl_module: Any) -> Any:
        return self.build_summary(trainer, pl_module)

    def build_summary(self, trainer: Any, pl_module: Any) -> Any:
        return super()._summary(trainer, pl_module)  # type: ignore[misc]

    @property
    def summary_max_depth(self) -> int:
        return self._max_depth  # type: ignore[attr-defined]


def requested_weights_only(depth: int = 40) -> Optional[bool]:
    """The ``weights_only=`` the user passed to ``trainer.fit/validate/test/predict``.

    Lightning 2.6 drops it on the way to ``Strategy.load_checkpoint`` for strategies that restore after setup
    (``Trainer._run`` calls ``_restore_modules_and_callbacks(ckpt_path)`` without it), so it is read from the running
    ``Trainer._run`` frame. None when not found (torch's default, ``True``, then applies)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code is Trainer._run.__code__:
            value = frame.f_locals.get("weights_only")
            return value if isinstance(value, bool) else None
        frame = frame.f_back
    return None


# ---------------------------------------------------------------------------------------------------------------
# private attributes of other libraries' objects (read or set, not imported)

_RUN_LOOPS = {"fit": "fit_loop", "validate": "validate_loop", "test": "test_loop", "predict": "predict_loop"}


def run_data_source(trainer: Any) -> Any:
    """Where the running ``trainer.fit`` (its training data), ``validate``, ``test`` or ``predict`` reads its batches:
    Lightning's ``_DataLoaderSource`` (``.instance``: the loader(s) given, or the LightningModule / LightningDataModule
    whose hook ``.name`` returns them; ``.is_defined()``; ``.dataloader()``), attached before the strategy's
    ``setup_environment``; None outside a run. No public accessor: the loops keep it as ``_data_source``."""
    loop = _RUN_LOOPS.get(getattr(getattr(getattr(trainer, "state", None), "fn", None), "value", None))
    return None if loop is None else getattr(trainer, loop)._data_source


def drop_persistent_iterator(loader: Any) -> None:
    """A ``DataLoader`` with ``persistent_workers`` keeps the iterator (and its worker processes) that ``iter()`` made,
    for the next ``iter()``: forgotten here, so that a batch read ahead of training does not leave idle workers behind a
    loader that Lightning re-creates (with a distributed sampler). Its workers stop when the iterator is collected."""
    if getattr(loader, "_iterator", None) is not None:
        loader._iterator = None


# nn.MultiheadAttention takes its fused fast paths (which would read a tp shard's in_proj as whole) only while this
# is True; a tensor-parallel MHA sets it False on its instance
MHA_FAST_PATH_FLAG = "_qkv_same_embed_dim"


def metric_progress(metric: Any) -> tuple[Any, int]:
    """A torchmetrics ``Metric``'s last ``forward`` value and update count: with ``metric_state`` (public), what a
    pipeline copies aside and back when it runs the user's step more than once (tracing, micro-batches)."""
    return metric._forward_cache, metric._update_count


def set_metric_progress(metric: Any, forward_cache: Any, update_count: int) -> None:
    metric._forward_cache = forward_cache
    metric._update_count = update_count
    metric._computed = None  # the cached compute() no longer holds


def module_initializer(module: Any, hf_root: Any = None) -> Optional[Any]:
    """The function that (re)initialises ``module``'s own tensors in place, as its constructor did: a Hugging Face
    model's ``_init_weights(module)`` for modules inside one (``hf_root``), else the module's ``reset_parameters()``
    (torch's convention, which Lightning's and torch's meta-device materialisation call too), else
    ``_reset_parameters()`` (``nn.MultiheadAttention`` and a few other torch layers name it so). None: no way known."""
    if hf_root is not None and callable(getattr(hf_root, "_init_weights", None)):
        return lambda: hf_root._init_weights(module)
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


def is_hf_pretrained(module: Any) -> bool:
    """A Hugging Face ``PreTrainedModel`` (without importing transformers: it has a config and ``_init_weights``)."""
    return callable(getattr(module, "_init_weights", None)) and hasattr(module, "config") and hasattr(
        module, "post_init")


def dynamo_counters() -> Any:
    """dynamo's counters of this process (``counters["stats"]["unique_graphs"]``, ``counters["graph_break"]``)."""
    from torch._dynamo.utils import counters

    return counters


def compile_call(module: Any, make: Any) -> None:
    """What ``module.compile()`` does (its call compiled, hooks inside the graph), with the compiled call made by
    ``make(module's eager call)``."""
    module._compiled_call_impl = make(module._call_impl)


def allow_graphs_per_function(n: int) -> None:
    """dynamo keeps up to ``n`` graphs of one function before it runs it eagerly (``recompile_limit``, 8 by
    default): the blocks of a stack share their class's forward, and a block whose forward reads its own index (a
    Hugging Face layer's ``layer_idx`` into the KV cache) compiles a graph of its own."""
    import torch._dynamo.config as config

    config.recompile_limit = max(config.recompile_limit, n)


def functional_collectives() -> Any:
    """torch's functional collectives (``torch.distributed._functional_collectives``), which dynamo traces."""
    import torch.distributed._functional_collectives as funcol

    return funcol


def known_size(n: Any) -> None:
    """Tells the compiler that ``n`` (an unbacked symbol read from a tensor) is a size: not negative."""
    torch._check(n >= 0)


def capture_scalar_outputs() -> None:
    """dynamo traces a tensor's ``.tolist()`` / ``.item()`` as unbacked symbols instead of breaking the graph (the
    expert exchange's split sizes, read from the routing)."""
    import torch._dynamo.config as config

    config.capture_scalar_outputs = True


def maybe_mark_dynamic(t: Any, dim: int) -> None:
    """dynamo compiles ``t``'s size along ``dim`` as a symbol, unless the graph needs it as a constant."""
    torch._dynamo.maybe_mark_dynamic(t, dim)


def hf_output_collector() -> Optional[dict]:
    """transformers' active output collector (a dict of lists that forward hooks inside a model's layers append
    router logits, attentions and hidden states to, read by the model after its layers), or None."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    if capturing is None:
        return None
    return capturing._active_collector.get()


@contextlib.contextmanager
def hf_records_outside_graphs() -> Iterator[None]:
    """For one compiled call: transformers' output collector held the way transformers holds it when it compiles a
    whole model (a plain attribute, ``compiling=True``), not in its ``ContextVar``, which dynamo cannot read (a
    graph break at every recording hook inside a block: a router's logits). The graph sees a fresh collector with
    the same keys and empty lists, so that nothing it guards on changes between calls (no recompile as the lists
    grow layer by layer); what the hooks appended to them is appended to the real collector after the call.
    ``hidden_states`` keeps its real list: its hook reads how many states precede."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    var = getattr(capturing, "_active_collector", None)
    if var is None or not hasattr(var, "compiling") or var.compiling:
        yield
        return
    current = var.get()
    scratch = None if current is None else {
        k: [] if isinstance(v, list) and k != "hidden_states" else v for k, v in current.items()}
    saved = var.compiling, var.global_var
    var.compiling, var.global_var = True, scratch
    try:
        yield
    finally:
        var.compiling, var.global_var = saved
        for key, values in (scratch or {}).items():
            if values is not current[key]:  # type: ignore[index]
                current[key].extend(values)  # type: ignore[index]


def hf_renamed_keys(keys: Any, transforms: list) -> dict[str, str]:
    """Each checkpoint key as transformers renames it when it loads a model (the ``WeightRenaming`` transforms of
    its conversion mapping, in their order; keys taken in sorted order, as transformers takes a state dict's, which
    a renaming guarded by its first key relies on). Converters are not applied."""
    import copy

    from transformers.core_model_loading import WeightRenaming, apply_renamings

    renamings = [copy.deepcopy(t) for t in transforms if isinstance(t, WeightRenaming)]  # some keep state
    return {key: apply_renamings(key, renamings) for key in sorted(keys)}


def hf_install_output_hook(module: Any, key: str, recorder: Any) -> None:
    """The hook transformers installs on a layer whose output it records under ``key``."""
    from transformers.utils.output_capturing import install_output_capuring_hook

    install_output_capuring_hook(module, key, recorder.index, recorder.capture_initial_hidden_state)


def fsdp_state(module: Any) -> Any:
    """The FSDP2 state of a ``fully_shard`` unit (what a ``deepcopy`` of the unit must share, not copy)."""
    return module._get_fsdp_state()


def fsdp_gathered(module: Any) -> bool:
    """Whether a ``fully_shard`` unit's parameters are gathered now (inside its forward, or kept from it)."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    return bool(groups) and all(group.is_unsharded for group in groups)


def fsdp_sharded_params(module: Any) -> list[tuple[Any, Any]]:
    """``(sharded parameter, unsharded parameter or None)`` of one ``fully_shard`` unit (FSDP2 keeps the gathered
    parameter it swaps in for forward as ``FSDPParam._unsharded_param`` once created)."""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return []
    return [(fp.sharded_param, getattr(fp, "_unsharded_param", None)) for fp in group.fsdp_params]


def fsdp_lazy_init(module: Any) -> None:
    """Make ``module`` (a ``fully_shard`` unit enclosing all others) the root of every unit below it now, rather than
    the first unit to run forward (the LightningModule's own forward may never run)."""
    module._get_fsdp_state()._lazy_init()


def fsdp_reduce_now(root: Any) -> None:
    """Reduce-scatter the gradients every unit under ``root`` accumulated unsharded, outside a backward: what
    ``torch.distributed.pipelining``'s ``perform_reduce_grad`` does after a schedule that splits backward."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(root)
    for unit_state in state._state_ctx.all_states:
        for group in unit_state._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def _leaks_last_gradient() -> bool:
    """Whether FSDP2's ``foreach_reduce`` keeps the last unsharded gradient alive through its reduce-scatter: a
    ``for ... unsharded_grad in ...`` loop before the copy-in leaves its loop variable bound to the end of the call,
    although the function clears its list of gradients "so that clearing the list frees the gradients"."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import foreach_reduce
        source = inspect.getsource(foreach_reduce)
    except (ImportError, OSError):  # pragma: no cover - another torch
        return False
    return "unsharded_grad) in enumerate(" in source and "unsharded_grads.clear()" in source


def _refs_of_a_local() -> int:
    local = torch.empty(0)
    return sys.getrefcount(local)  # the local name + getrefcount's own argument (2 on CPython 3.10-3.13)


_REFS_OF_A_LOCAL = _refs_of_a_local()


def gloo_reduce_scatter(reduce_scatter_into: Callable[[torch.Tensor, torch.Tensor, Any], None]) -> Any:
    """An FSDP2 reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) for gloo, one per unit: each rank's part of
    FSDP2's input buffer sent to it directly by ``reduce_scatter_into(out, inp, group)`` (``core.collectives``'s;
    gloo's own ``reduce_scatter_tensor`` clones the whole input and all-reduces the clone, then walks a ring), and the
    buffer freed after (FSDP2 keeps it alive until the next unit's reduction, for stream safety that a CPU does not
    need).

    It also frees the unit's unsharded gradient that FSDP2 leaks through the reduce-scatter (``_leaks_last_gradient``):
    ``track`` (a post-accumulate-grad hook on the unit's gathered parameters) remembers each gradient weakly, and when
    FSDP2 allocates the reduce-scatter's output (after its copy-in and after it cleared its list of gradients), a
    gradient whose only Python reference left is that loop variable gets its storage released. A gradient anything
    else still holds (a user's hook) is left alone. For a single-parameter unit such as a vocabulary matrix, the
    reduction's peak drops from three gradient-sized buffers (gradient, input, output / 2 each) to two (the receives
    land in the output). None where torch's interface is missing (the default is kept)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:  # pragma: no cover - an older or newer torch
        return None
    leaks = _leaks_last_gradient()

    class GlooReduceScatter(ReduceScatter):
        def __init__(self) -> None:
            self.grads: dict[int, weakref.ref] = {}
            self.allocations = 0  # FSDP2 allocates twice per reduction: the input (before its copy-in), the output

        def track(self, param: torch.Tensor) -> None:
            if leaks and param.grad is not None:
                grad = getattr(param.grad, "_local_tensor", param.grad)  # what FSDP2 reduces
                self.grads[id(grad)] = weakref.ref(grad)

        def _free_leaked(self) -> None:
            for key, ref in list(self.grads.items()):
                grad = ref()
                if grad is None:
                    del self.grads[key]
                elif sys.getrefcount(grad) == _REFS_OF_A_LOCAL + 1:  # here + the leaked loop variable only
                    grad.untyped_storage().resize_(0)
                    del self.grads[key]
                del grad

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            self.allocations += 1
            if self.allocations % 2 == 0:  # the output: the copy-in is done, FSDP2's list of gradients cleared
                self._free_leaked()
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> None:
            # PREMUL_SUM(f): a unit with its own gradient divide factor (experts over their replicas)
            premul = getattr(op, "op", None) == dist.ReduceOp.RedOpType.PREMUL_SUM
            if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) and not premul:
                raise ValueError(f"reduce-scatter over gloo: reduce op {op} is not supported (SUM, AVG or "
                                 f"PREMUL_SUM)")
            reduce_scatter_into(output_tensor, input_tensor, group)
            if premul:
                output_tensor.mul_(op.factor)
            elif op == dist.ReduceOp.AVG:
                output_tensor.div_(dist.get_world_size(group))
            input_tensor.untyped_storage().resize_(0)

    return GlooReduceScatter()


def gloo_all_gather(all_gather_into: Callable[[torch.Tensor, torch.Tensor, Any], None]) -> Any:
    """An FSDP2 all-gather (``FSDPModule.set_custom_all_gather``) for gloo: each rank's shard sent to every other
    directly by ``all_gather_into(out, inp, group)`` (``core.collectives``'s) instead of gloo's ring. Synchronous (a
    CPU's gather does not overlap compute: FSDP2 waits for it before the forward anyway). None where torch's
    interface is missing."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
    except ImportError:  # pragma: no cover - an older or newer torch
        return None

    class GlooAllGather(AllGather):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> None:
            all_gather_into(output_tensor, input_tensor, group)

    return GlooAllGather()


def fsdp_track_gradients(unit: Any, comm: Any) -> None:
    """Give ``comm.track`` (``gloo_reduce_scatter``) every gradient autograd accumulates into ``unit``'s gathered
    parameters. FSDP2 creates them at the unit's first gather, so the hooks are registered at its first forward."""

    def register(module: Any, args: Any) -> None:
        for _, unsharded in fsdp_sharded_params(module):
            if unsharded is not None and unsharded.requires_grad:
                unsharded.register_post_accumulate_grad_hook(comm.track)
        handle.remove()

    handle = unit.register_forward_pre_hook(register)


def fsdp_no_backward_prefetch(unit: Any) -> None:
    """No all-gather issued ahead in backward for ``unit``: FSDP2 otherwise gathers the unit its forward ran before
    (the next micro-batch's last block, once a stage's backward reaches its first unit) while this one's gathered
    weight and gradient are alive. ``set_modules_to_backward_prefetch([])`` does not turn it off: an empty list
    means FSDP2's default prefetch (torch 2.13)."""
    for group in fsdp_state(unit)._fsdp_param_groups:
        group._backward_prefetch = lambda: None  # FSDPParamGroup.pre_backward calls it (default prefetch)


def fsdp_drop_gather_keepalive(unit: Any) -> None:
    """After FSDP2 gathers ``unit``'s parameters for its forward, drop the flat all-gather buffer it keeps alive until
    the next unit's gather (so that a GPU's copy-out may overlap the next collective). On a CPU the copy-out is done
    when the forward starts: the buffer, the size of the unit's gathered parameters, is dead weight at the peak."""
    from torch.distributed.fsdp import fully_shard

    def drop(module: Any, args: Any) -> None:
        fully_shard.state(module)._comm_ctx.all_gather_state = None

    unit.register_forward_pre_hook(drop)
