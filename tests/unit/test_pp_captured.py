"""Values that a unit's layers record through transformers' output collector (router logits): seen on the units'
meta twins, taken out of the collector after a twin's run, and put back where a received unit's hooks would have."""

from __future__ import annotations

import pytest
import torch

from lightning_tpp.core.meta_ops import DataDependentOnMeta
from lightning_tpp.pipeline.captured import hook_twins, recorded, replay
from lightning_tpp.pipeline.stage import meta_twin
from models import MODELS

transformers = pytest.importorskip("transformers")
from transformers.utils import output_capturing  # noqa: E402


def test_twins_record_their_routers_on_meta() -> None:
    model = MODELS["hf_mixtral_labels"]()
    units = {f"model.model.layers.{i}": model.get_submodule(f"model.model.layers.{i}") for i in range(2)}
    twins = {n: meta_twin(m) for n, m in units.items()}
    hook_twins(model, twins)
    token = output_capturing._active_collector.set({"router_logits": []})  # what output_router_logits asks
    try:
        x = torch.empty(1, 5, 32, device="meta")
        position = (torch.empty(1, 5, 8, device="meta"), torch.empty(1, 5, 8, device="meta"))
        with recorded(remove=True) as side, DataDependentOnMeta():  # routed on meta: shapes only
            twins["model.model.layers.1"](x, position_embeddings=position)
        collector = output_capturing._active_collector.get()
        assert collector["router_logits"] == []  # a twin's records are taken out again
        assert [(k, tuple(v.shape)) for k, v in side] == [("router_logits", (5, 4))]
        replay([("router_logits", torch.zeros(5, 4))])
        assert [tuple(v.shape) for v in collector["router_logits"]] == [(5, 4)]
    finally:
        output_capturing._active_collector.reset(token)


def test_nothing_recorded_without_a_collector() -> None:
    with recorded() as side:
        pass
    assert side == []
    replay([("router_logits", torch.zeros(1))])  # no collector active: nothing to fill
