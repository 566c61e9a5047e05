"""The private Lightning/torch names wrapped in ``lightning_tpp._compat`` still mean what they meant: an upgrade that
moves one fails here, by name, instead of silently changing behaviour."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_tpp import _compat
from lightning_tpp._compat import requested_weights_only
from lightning_tpp.core.collectives import reduce_scatter_into


def test_trainer_run_still_carries_weights_only() -> None:
    """``requested_weights_only`` reads this parameter from the running ``Trainer._run``."""
    assert "weights_only" in inspect.signature(Trainer._run).parameters


def test_lightning_still_drops_weights_only_for_restore_after_setup() -> None:
    """When this fails, Lightning passes ``weights_only`` to ``Strategy.load_checkpoint`` itself: remove the
    workaround (``requested_weights_only``)."""
    assert "_restore_modules_and_callbacks(ckpt_path)" in inspect.getsource(Trainer._run)


def test_no_trainer_call_means_torchs_default() -> None:
    def _run(weights_only: bool = False) -> object:  # same name and local, not Trainer._run's code
        return requested_weights_only()

    assert _run() is None


# ---------------------------------------------------------------------------------------------------------------------
# every name wrapped in lightning_tpp._compat: still there, with the parameters lightning_tpp passes


def _params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def test_lightning_version_is_the_pinned_one() -> None:
    """The private names below are checked against this minor version (pyproject: lightning>=2.6,<2.7)."""
    import lightning

    assert lightning.__version__.startswith("2.6."), lightning.__version__


def test_fabric_distributed_helpers() -> None:
    assert _params(_compat.init_dist_connection)[:2] == ["cluster_environment", "torch_distributed_backend"]
    assert "kwargs" in _params(_compat.init_dist_connection)  # timeout=, device_id= are passed on
    assert _params(_compat.sync_ddp_if_available) == ["result", "group", "reduce_op"]
    assert _params(_compat.all_gather_ddp_if_available) == ["tensor", "group", "sync_grads"]
    assert _params(_compat.distributed_is_initialized) == []
    assert _compat.distributed_is_initialized() is False  # no process group in the unit tests


def test_fabric_optimizer_helpers() -> None:
    assert _params(_compat.optimizer_to_device) == ["optimizer", "device"]
    assert _params(_compat.optimizers_to_device) == ["optimizers", "device"]
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([p])
    p.grad = torch.ones(2)
    opt.step()
    _compat.optimizers_to_device([opt], "cpu")
    assert opt.state[p]["exp_avg"].device.type == "cpu"


def test_fabric_rng_states_round_trip() -> None:
    state = _compat.collect_rng_states()
    assert {"torch", "python"} <= set(state)  # lightning_tpp.checkpoint.rng reads these keys
    a = torch.rand(3)
    _compat.set_rng_states(state)
    assert torch.equal(torch.rand(3), a)


def test_in_backward() -> None:
    """tensor_parallel.rng tells a recomputation in backward from a forward by it."""
    seen: list[bool] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(_compat.in_backward()))
    assert _compat.in_backward() is False
    y.sum().backward()
    assert seen == [True]


@pytest.mark.parametrize("is_causal", [True, False])
def test_attention_with_lse_is_sdpa_and_its_backward(is_causal: bool) -> None:
    """context_parallel's CPU causal route: the kernel's output is SDPA's, its log-sum-exp the rows' (scaled scores),
    and its backward SDPA's gradients."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 8, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 3, 10, 8)
    out, lse = _compat.attention_with_lse(q, k, v, is_causal, 0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.5)
    torch.testing.assert_close(out, ref)
    scores = (q @ k.transpose(-1, -2)) * 0.5
    if is_causal:
        scores = scores.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1))
    got = _compat.attention_with_lse_backward(grad, q, k, v, out, lse, is_causal, 0.5)
    for a, b in zip(got, torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b)


def test_strategy_registry_type() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert isinstance(StrategyRegistry, _compat.StrategyRegistryType)


def test_rank_zero_only_reads_its_rank_attribute() -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    before = getattr(rank_zero_only, "rank", 0)
    try:
        _compat.set_rank_zero(1)
        assert rank_zero_only(lambda: "ran")() is None  # rank 1 does not run it
        _compat.set_rank_zero(0)
        assert rank_zero_only(lambda: "ran")() == "ran"
    finally:
        rank_zero_only.rank = before


def test_launchers() -> None:
    from lightning.pytorch.strategies import DDPStrategy, Strategy
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

    assert _params(_compat.SubprocessScriptLauncher.__init__) == ["self", "cluster_environment", "num_processes",
                                                                  "num_nodes"]
    assert _params(_MultiProcessingLauncher.__init__) == ["self", "strategy", "start_method"]
    assert _params(_MultiProcessingLauncher._wrapping_function)[:4] == ["self", "process_idx", "trainer", "function"]
    assert _params(_MultiProcessingLauncher._collect_rank_zero_results) == ["self", "trainer", "results"]
    # the worker hands rank 0's results back through _collect_rank_zero_results, which takes the weights from the
    # module's state_dict() (WholeWeightsLauncher's state_dict post-hook puts the whole tensors there)
    assert "self._collect_rank_zero_results(trainer, results)" in inspect.getsource(
        _MultiProcessingLauncher._wrapping_function)
    assert "trainer.lightning_module.state_dict()" in inspect.getsource(
        _MultiProcessingLauncher._collect_rank_zero_results)
    # a strategy chooses its launcher in _configure_launcher, setting _launcher (as DDPStrategy does)
    assert _params(Strategy._configure_launcher) == ["self"]
    assert "self._launcher = " in inspect.getsource(DDPStrategy._configure_launcher)
    assert "return self._launcher" in inspect.getsource(Strategy.launcher.fget)


def test_multiprocessing_launcher_adapter_routes_the_private_hooks() -> None:
    calls = []

    class Probe(_compat.MultiProcessingLauncher):
        def run_worker(self, *args: object, **kwargs: object) -> None:
            calls.append(("run_worker", args))

        def collect_rank_zero_results(self, trainer: object, results: object) -> object:
            calls.append(("collect", trainer, results))
            return "out"

    launcher = Probe.__new__(Probe)
    launcher._wrapping_function(0, None)
    assert launcher._collect_rank_zero_results("trainer", "results") == "out"
    assert calls == [("run_worker", (0, None)), ("collect", "trainer", "results")]


def test_model_summary_callback_private_factory() -> None:
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary

    for cls in (ModelSummary, RichModelSummary):
        assert _params(cls._summary) == ["self", "trainer", "pl_module"]
        assert cls(max_depth=3)._max_depth == 3  # SummaryCallbackAdapter.summary_max_depth
    assert "self._summary(trainer, pl_module)" in inspect.getsource(ModelSummary.on_fit_start)


def test_summary_adapter_routes_the_private_factory() -> None:
    from lightning.pytorch.callbacks import ModelSummary

    class Probe(_compat.SummaryCallbackAdapter, ModelSummary):
        def build_summary(self, trainer: object, pl_module: object) -> object:
            return ("built", self.summary_max_depth)

    assert Probe(max_depth=2)._summary(None, None) == ("built", 2)


def test_torch_flatten_dense_tensors_round_trip() -> None:
    ts = [torch.arange(3.0), torch.ones(2, 2)]
    flat = _compat.flatten_dense_tensors(ts)
    assert flat.shape == (7,)
    assert all(torch.equal(a, b) for a, b in zip(_compat.unflatten_dense_tensors(flat, ts), ts))


def test_torch_pytree() -> None:
    leaves, spec = _compat.tree_flatten({"a": (1, [2, 3])})
    assert leaves == [1, 2, 3]
    assert _compat.tree_unflatten([4, 5, 6], spec) == {"a": (4, [5, 6])}
    assert _compat.tree_map(lambda x: x * 2, [1, (2,)]) == [2, (4,)]


def test_normalisation_bases() -> None:
    for cls in (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm,
                torch.nn.LazyBatchNorm2d):
        assert issubclass(cls, _compat.BatchNormBase)
    assert issubclass(torch.nn.InstanceNorm2d, _compat.InstanceNormBase)
    assert not issubclass(torch.nn.InstanceNorm2d, _compat.BatchNormBase)


def test_layer_sync_is_handed_to_the_strategy() -> None:
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    assert "self.strategy._layer_sync = self._layer_sync" in inspect.getsource(_AcceleratorConnector)
    assert "self._layer_sync" in inspect.getsource(ParallelStrategy.__init__)

    class Holder:
        _layer_sync = None

    assert not _compat.layer_sync_requested(Holder())
    Holder._layer_sync = object()
    assert _compat.layer_sync_requested(Holder())


def test_torch_default_store_accessor() -> None:
    import torch.distributed.distributed_c10d as c10d

    assert _params(c10d._get_default_store) == []


def test_torch_dcp_metadata_names() -> None:
    import dataclasses

    from torch.distributed.checkpoint import FileSystemReader

    assert _compat.StorageInfo.__name__ == "_StorageInfo"  # pickled by this name into DCP metadata
    assert "relative_path" in {f.name for f in dataclasses.fields(_compat.StorageInfo)}
    assert _compat.get_layout("torch.strided") is torch.strided
    assert _params(FileSystemReader._get_metadata_path) == ["self", "rank"]


def test_run_data_source_is_attached_before_the_strategy_sets_up() -> None:
    """``layout='auto'`` reads the run's data source in ``setup_environment``: each loop keeps it as ``_data_source``
    (a ``_DataLoaderSource``), attached by ``trainer.fit/validate/test/predict`` before ``Trainer._run`` sets the
    strategy up, and the data hooks and ``setup()`` run after."""
    import dataclasses

    from lightning.pytorch.trainer.connectors.data_connector import _DataConnector, _DataLoaderSource
    from lightning.pytorch.trainer.states import TrainerFn

    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert _compat.run_data_source(trainer) is None  # no run
    loops = {TrainerFn.FITTING: trainer.fit_loop, TrainerFn.VALIDATING: trainer.validate_loop,
             TrainerFn.TESTING: trainer.test_loop, TrainerFn.PREDICTING: trainer.predict_loop}
    for fn, loop in loops.items():
        trainer.state.fn = fn
        source = _compat.run_data_source(trainer)
        assert source is loop._data_source and isinstance(source, _DataLoaderSource)
    assert [f.name for f in dataclasses.fields(_DataLoaderSource)] == ["instance", "name"]
    assert _params(_DataLoaderSource.dataloader) == ["self"] and _params(_DataLoaderSource.is_defined) == ["self"]
    assert "trainer.fit_loop._data_source.instance = " in inspect.getsource(_DataConnector.attach_dataloaders)
    assert "trainer.fit_loop._data_source.instance = datamodule" in inspect.getsource(_DataConnector.attach_datamodule)
    fit = inspect.getsource(Trainer._fit_impl)
    assert fit.index("attach_data(") < fit.index("self._run(")
    run = inspect.getsource(Trainer._run)
    assert run.index("self.strategy.setup_environment()") < run.index("self._data_connector.prepare_data()") < \
        run.index("call._call_setup_hook(self)")


def test_drop_persistent_iterator() -> None:
    """A ``DataLoader`` with persistent workers keeps the iterator ``iter()`` made as ``_iterator``."""
    from torch.utils.data import DataLoader

    assert "self._iterator = self._get_iterator()" in inspect.getsource(DataLoader.__iter__)
    loader = DataLoader(list(range(4)), num_workers=1, persistent_workers=True)
    assert loader._iterator is None
    loader._iterator = held = object()
    _compat.drop_persistent_iterator(loader)
    assert loader._iterator is None and held is not None
    _compat.drop_persistent_iterator([1, 2])  # anything else: untouched


def test_dcp_save_plan_cache() -> None:
    """``checkpoint.async_save`` caches DCP's save plans under a key of its own: the planner keeps the key in
    ``_cached_plans_key`` and the caches are ``SavePlanner`` class dictionaries keyed by it."""
    from torch.distributed.checkpoint import DefaultSavePlanner, SavePlanner

    assert "enable_plan_caching" in _params(DefaultSavePlanner)
    planner = _compat.caching_save_planner("test-key")
    assert planner._cached_plans_key == "test-key" and planner._enable_plan_caching is True
    SavePlanner._cached_metadata["test-key"] = object()  # what a save leaves behind
    SavePlanner._cached_save_plan["test-key"] = object()
    _compat.drop_save_plan_cache("test-key")
    assert all("test-key" not in getattr(SavePlanner, name) for name in (
        "_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata", "_cached_final_save_plan"))


def test_fsdp2_internals(tmp_path: Path) -> None:
    """FSDP2's state, its parameters (sharded and gathered), explicit root initialisation and a reduce-scatter run
    outside backward: what ``data_parallel.fsdp`` and the pipeline rely on (one-rank process group, destroyed after)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _compat.fsdp_lazy_init(model)
        assert _compat.fsdp_state(model[0]) is not _compat.fsdp_state(model[1])
        for layer in model:
            layer.set_requires_gradient_sync(False, recurse=False)
        model(torch.ones(3, 4)).sum().backward()
        pairs = _compat.fsdp_sharded_params(model[0])
        assert [tuple(s.shape) for s, _ in pairs] == [(4, 4), (4,)] and all(isinstance(s, DTensor) for s, _ in pairs)
        assert all(u is not None and not isinstance(u, DTensor) for _, u in pairs)  # the gathered parameters
        assert all(s.grad is None for s, _ in pairs)  # kept unsharded: no reduce-scatter yet
        for layer in model:
            layer.set_requires_gradient_sync(True, recurse=False)
        _compat.fsdp_reduce_now(model)
        assert all(isinstance(s.grad, DTensor) for s, _ in _compat.fsdp_sharded_params(model[0]))
    finally:
        dist.destroy_process_group()


def test_fsdp2_custom_comms_on_gloo(tmp_path: Path) -> None:
    """The in-place reduce-scatter and the dropped all-gather buffer that ``data_parallel.fsdp`` installs over gloo:
    FSDP2 still takes them (its interface is private), and gradients come out as with its own (one-rank group)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        grads = []
        for custom in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
            for layer in model:
                fully_shard(layer, mesh=mesh)
                if custom:
                    comm = _compat.gloo_reduce_scatter(reduce_scatter_into)
                    assert comm is not None
                    layer.set_custom_reduce_scatter(comm)
                    _compat.fsdp_drop_gather_keepalive(layer)
            fully_shard(model, mesh=mesh)
            model(torch.ones(3, 4)).sum().backward()
            grads.append([p.grad.full_tensor() for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads))
        buffer = torch.ones(6)
        out = torch.empty(6)
        comm(out, buffer, dist.group.WORLD, dist.ReduceOp.AVG)
        assert torch.equal(out, torch.ones(6)) and buffer.untyped_storage().nbytes() == 0  # the input is freed
        with pytest.raises(ValueError, match="reduce op"):
            comm(out, torch.ones(6), dist.group.WORLD, dist.ReduceOp.MAX)
    finally:
        dist.destroy_process_group()


def test_reduce_scatter_frees_the_gradient_fsdp2_leaks() -> None:
    """FSDP2's ``foreach_reduce`` still binds the last unsharded gradient to a loop variable through its
    reduce-scatter (if torch fixes that, ``_leaks_last_gradient`` turns false and the tracking is off). The gloo
    reduce-scatter frees a tracked gradient at the output's allocation when that is its only other reference, and
    never one held elsewhere or before the copy-in (the first allocation)."""
    from torch import nn

    assert _compat._leaks_last_gradient()
    comm = _compat.gloo_reduce_scatter(reduce_scatter_into)
    leaked, held = nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(2, 3))
    leaked.grad, held.grad = torch.ones(4, 3), torch.ones(2, 3)
    comm.track(leaked)
    comm.track(held)
    loop_variable, users = leaked.grad, [held.grad, held.grad]
    leaked.grad = held.grad = None
    comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))  # the input: before the copy-in
    assert loop_variable.untyped_storage().nbytes() == 4 * 3 * 4
    comm.allocate((3,), dtype=torch.float32, device=torch.device("cpu"))  # the output: after it
    assert loop_variable.untyped_storage().nbytes() == 0
    assert torch.equal(users[0], torch.ones(2, 3))  # referenced twice more: left alone


def test_precision_plugin_is_assigned_through_the_strategy_property() -> None:
    """The connector hands the plugin to the strategy through the public ``precision_plugin`` setter, which
    TensorPipeStrategy overrides (lightning_tpp.integration.precision)."""
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    assert "self.strategy.precision_plugin = self.precision_plugin" in inspect.getsource(_AcceleratorConnector)
    assert _params(Precision.clip_grad_by_norm) == ["self", "optimizer", "clip_val"]
    assert "self.clip_grad_by_norm(optimizer, clip_val)" in inspect.getsource(Precision.clip_gradients)


# ---------------------------------------------------------------------------------------------------------------------
# nothing else imports a private name

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_tpp"
LIBRARIES = ("torch", "lightning", "torchmetrics")


def _private_imports(path: Path) -> list[str]:
    """Imports of a ``_``-prefixed name, or from a ``._``-prefixed module, of torch, lightning or torchmetrics."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in LIBRARIES:
                continue
            names = [a.name for a in node.names if a.name.startswith("_")]
            if any(part.startswith("_") for part in node.module.split(".")) or names:
                out.append(f"line {node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] in LIBRARIES and any(p.startswith("_") for p in parts):
                    out.append(f"line {node.lineno}: import {a.name}")
    return out


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py") if p.name != "_compat.py"),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_private_names_come_through_compat(path: Path) -> None:
    found = _private_imports(path)
    assert not found, f"{path.relative_to(PACKAGE)} imports private names; wrap them in lightning_tpp/_compat.py: " \
                      f"{found}"


def test_the_private_import_checker_sees_them(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from torch.utils._pytree import tree_map\nfrom lightning.fabric.utilities import _x\n"
                   "def f():\n    import torch._utils\n    from torchmetrics.metric import Metric\n")
    assert [line.split(":")[0] for line in _private_imports(bad)] == ["line 1", "line 2", "line 4"]



def test_mha_still_gates_its_fast_path_on_the_flag() -> None:
    """A tensor-parallel nn.MultiheadAttention turns torch's fused paths off through this instance attribute."""
    from torch import nn

    from lightning_tpp._compat import MHA_FAST_PATH_FLAG

    mha = nn.MultiheadAttention(8, 2)
    assert getattr(mha, MHA_FAST_PATH_FLAG) is True
    assert MHA_FAST_PATH_FLAG in inspect.getsource(nn.MultiheadAttention.forward)
    assert getattr(nn.MultiheadAttention(8, 2, kdim=4), MHA_FAST_PATH_FLAG) is False


def test_metric_progress_round_trips() -> None:
    import torch
    from torchmetrics import MeanMetric

    from lightning_tpp._compat import metric_progress, set_metric_progress

    metric = MeanMetric()
    metric(torch.tensor(3.0))
    cache, count = metric_progress(metric)
    assert float(cache) == 3.0 and count == 1
    metric(torch.tensor(5.0))
    set_metric_progress(metric, cache, count)
    assert metric_progress(metric) == (cache, 1) and metric._computed is None


def test_module_initializers_still_exist() -> None:
    """Meta-built models are initialised by these: torch's MultiheadAttention names its ``_reset_parameters``, Hugging
    Face models initialise a module with ``_init_weights(module)``."""
    import transformers

    assert callable(getattr(torch.nn.MultiheadAttention, "_reset_parameters", None))
    assert _compat.module_initializer(torch.nn.MultiheadAttention(4, 2)) is not None
    cfg = transformers.LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    assert _compat.is_hf_pretrained(model) and not _compat.is_hf_pretrained(model.lm_head)
    assert "module" in inspect.signature(model._init_weights).parameters


def test_fsdp2_backward_prefetch_turned_off(tmp_path: Path) -> None:
    """FSDP2 gathers the unit before in backward ahead of time by default, even after
    ``set_modules_to_backward_prefetch([])``; ``fsdp_no_backward_prefetch`` stops it (over gloo a gathered unit
    would only sit beside the running one's weight and gradient)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def prefetches(turn_off: bool) -> list[str]:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
        for layer in model:
            fully_shard(layer, mesh=mesh)
            layer.set_modules_to_backward_prefetch([])
            if turn_off:
                _compat.fsdp_no_backward_prefetch(layer)
        fully_shard(model, mesh=mesh)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(torch.ones(3, 4)).sum().backward()
        return [e.name for e in prof.events() if e.name.startswith("FSDP::backward_prefetch")]

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        assert prefetches(False)  # FSDP2's default, which an empty list keeps
        assert prefetches(True) == []
    finally:
        dist.destroy_process_group()


def test_transformers_output_capturing_names() -> None:
    """transformers records router logits through an active collector (a context variable holding a dict of lists)
    and installs its hooks with ``install_output_capuring_hook``: the pipeline reads and fills that collector."""
    pytest.importorskip("transformers")
    from transformers.utils import output_capturing

    from lightning_tpp._compat import hf_install_output_hook, hf_output_collector

    assert hf_output_collector() is None  # none active outside a model's forward
    token = output_capturing._active_collector.set({"router_logits": []})
    try:
        layer = torch.nn.Linear(2, 3)
        hf_install_output_hook(layer, "router_logits", output_capturing.OutputRecorder(torch.nn.Linear, index=0))
        layer(torch.ones(1, 2))
        assert len(hf_output_collector()["router_logits"]) == 1
    finally:
        output_capturing._active_collector.reset(token)


def _torch_names_used(tree: ast.AST) -> set[tuple[str, str]]:
    """(module, name) of every ``dist.X``/``torch.distributed.X`` attribute and ``from torch... import X`` in a file."""
    aliases = {"dist": "torch.distributed"}
    used: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            used |= {(node.module, a.name) for a in node.names}
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("torch")})
        elif isinstance(node, ast.Attribute):
            base = ast.unparse(node.value)
            if base in aliases or base.startswith("torch"):
                used.add((aliases.get(base, base), node.attr))
    return used


def test_no_deprecated_torch_call_of_our_own() -> None:
    """No torch function marked ``@deprecated`` (``all_gather_into_tensor``, ``reduce_scatter_tensor`` in torch 2.13)
    is called by lightning_tpp: each would print a ``FutureWarning`` in the user's output."""
    import importlib

    root = Path(_compat.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for module, name in _torch_names_used(ast.parse(path.read_text())):
            try:
                obj = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                continue
            if isinstance(getattr(obj, "__deprecated__", None), str):  # @deprecated's message (torch.ops makes any
                # attribute an operator namespace)
                found.append(f"{path.relative_to(root)}: {module}.{name}: {obj.__deprecated__}")
    assert not found, "\n".join(found)
