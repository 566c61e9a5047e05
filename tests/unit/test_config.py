"""``TensorPipeConfig``: the strategy's arguments as one frozen, self-validating object (issue #45 item 1)."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_tpp.config import CUTTING, AutoLayoutError, TensorPipeConfig, planning_config


def test_the_strategy_keeps_its_arguments_as_one_frozen_config() -> None:
    from lightning_tpp import TensorPipeStrategy

    strategy = TensorPipeStrategy(tp=2, pp=2, dp_sharding="FULL_SHARD", weights=None, print_plan=False)
    config = strategy.config
    assert isinstance(config, TensorPipeConfig) and (config.tp, config.pp) == (2, 2)
    assert config.dp_sharding == "full_shard" and config.microbatches == 4  # normalised; the default 2 x pp
    assert (strategy.microbatches, strategy.schedule, strategy.virtual_stages) == (4, "auto", 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tp = 4  # type: ignore[misc]
    # every argument of the strategy is a field of the config, with the same default
    import inspect

    params = inspect.signature(TensorPipeStrategy.__init__).parameters
    fields = {f.name: f.default for f in dataclasses.fields(TensorPipeConfig)}
    lightning = {"self", "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
    assert set(params) - lightning == set(fields)
    assert all(params[n].default == fields[n] for n in fields)
    # and its documentation: the strategy's docstring shows the config's (help, LightningCLI)
    assert "sequence_parallel: with tp > 1, Megatron's sequence parallelism" in (TensorPipeStrategy.__doc__ or "")


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"microbatches": 0}, ValueError, r"microbatches=0 must be a positive integer"),
    ({"tp_plan": ["x"]}, TypeError, r"tp_plan must be 'auto' or a mapping"),
    ({"verify": "yes"}, TypeError, r"verify='yes' must be True or False"),
    ({"sequence_parallel": True}, ValueError, r"needs tp >= 2, got tp=1"),
    ({"balance": "flops"}, ValueError, r"balance='flops' must be 'params', 'time'"),
    ({"on_nonfinite": "ignore"}, ValueError, r"on_nonfinite='ignore' must be"),
    ({"async_save": True, "save_distributed_checkpoint": False}, ValueError, r"async_save=True writes sharded"),
    ({"dp_sharding": "zero3"}, ValueError, r"dp_sharding='zero3' must be one of"),
    ({"cp": 2, "cp_mode": "ring"}, ValueError, r"cp_mode='ring' must be 'allgather' \(keys and values all-gathered\), "
                                               r"'a2a' \(Ulysses: positions exchanged for heads\) or 'auto'"),
    ({"cp": 2, "cp_mode": "auto"}, ValueError, r"cp_mode='auto' is chosen by the layout search: pass layout='auto'"),
    ({"layout": "auto", "dp": 2}, AutoLayoutError, r"dp=2 with a searched layout"),
    ({"compile": "yes"}, TypeError, r"compile='yes' must be True, False or a dict of torch.compile options"),
    ({"compile": {"backend": "aot_eager", "fulgraph": True}}, ValueError,
     r"\['fulgraph'\] not among the torch.compile options it passes on \['backend', 'mode', 'options', 'dynamic', "
     r"'fullgraph'\]"),
])
def test_a_bad_argument_is_refused_at_construction(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        TensorPipeConfig(**kwargs)


def test_a_chosen_layout_is_a_new_config_as_a_user_could_write_it() -> None:
    from lightning_tpp.layout.plan import Layout

    asked = TensorPipeConfig(layout="auto", device_memory="8GB", global_batch=16)
    assert asked.auto_request() is not None and asked.tp == 1
    layout = Layout(tp=2, pp=2, dp=1, microbatches=8, schedule="1f1b", activation_checkpointing=True,
                    dp_sharding="no_shard")
    chosen = asked.with_layout(layout)
    assert chosen is not asked and asked.layout == "auto"  # the request is kept as it was
    assert (chosen.tp, chosen.pp, chosen.microbatches, chosen.schedule, chosen.activation_checkpointing) == (
        2, 2, 8, "1f1b", True)
    assert chosen.auto_request() is None and chosen.device_memory is None
    assert chosen == TensorPipeConfig(tp=2, pp=2, dp=1, microbatches=8, schedule="1f1b",
                                      activation_checkpointing=True, dp_sharding="no_shard")


def test_fingerprints() -> None:
    a, b = TensorPipeConfig(tp=2), TensorPipeConfig(tp=2, print_plan=False, timeout=None)
    assert set(a.cutting()) == set(CUTTING) and a.cutting() == b.cutting()  # a second Trainer may print less
    assert "print_plan" not in a.agreement()  # print_plan=rank == 0 is usual
    assert {k for k in a.agreement() if a.agreement()[k] != b.agreement()[k]} == {"timeout"}
    assert planning_config(2, 4, 2).schedule == "interleaved-1f1b" and not planning_config(2, 1).verify
