"""Unit tests of ``lightning_tpp.pipeline.stage``: tracing which values cross pipeline stages (one process, no
groups)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_tpp.pipeline.build import _units
from lightning_tpp.pipeline.partition import plan_partition
from lightning_tpp.pipeline.stage import PipelineTraceError, StageRuntime, mark_dispatch, meta_twin, plan_routes, trace
from models import VOCAB, ConditionedLM, FusedGQAModel, NanoGPT, Seq2Seq


def dispatching(model: nn.Module, stages: int, **partition_kwargs) -> StageRuntime:
    """Mark every unit of ``model`` (all local, as if one rank held every stage)."""
    part = plan_partition(model, stages, **partition_kwargs)
    runtime = StageRuntime(torch.device("cpu"))
    runtime.units = _units(model, part)
    modules = dict(model.named_modules())
    for i, unit in enumerate(runtime.units):
        mark_dispatch(modules[unit.name], runtime, unit=i, twin=meta_twin(modules[unit.name]))
    return runtime


def routes_of(model: nn.Module, stages: int, **partition_kwargs):
    """Trace one forward + loss of ``model`` cut in ``stages``; the routes, and what each stage receives."""
    runtime = dispatching(model, stages, **partition_kwargs)
    idx = torch.randint(0, VOCAB, (2, 8))
    calls, result = trace(runtime, lambda: F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()), {})
    names = [u.name for u in runtime.units]
    routes = plan_routes(runtime, calls, result, stages)
    received = [sorted((names[key[0]], key[1], leaf) for key, leaves in r.incoming.items() for leaf in leaves)
                for r in routes]
    return routes, received, names


def test_a_decoder_only_model_sends_one_hidden_state():
    routes, received, names = routes_of(NanoGPT(n_layer=4), 2)
    assert received == [[], [("transformer.h.1", 0, 0)]]
    assert routes[0].outbound == {1: [((names.index("transformer.h.1"), 0), 0)]}
    assert routes[0].stop_after == (names.index("transformer.h.1"), 0)
    assert routes[1].inbound == {0: 1} and routes[1].stop_after is None and routes[1].outbound == {}


def test_encoder_decoder_sends_memory_and_the_embedded_target():
    """Stage 1 (the decoder) needs the encoder's output (after its final norm) and the decoder's embedded input,
    computed by ``tgt_embed`` on stage 0 before the encoder ran."""
    _, received, _ = routes_of(Seq2Seq(), 2)
    assert received[1] == [("tgt_embed", 0, 0), ("transformer.encoder.norm", 0, 0)]


def test_conditioning_vector_reaches_every_later_stage():
    routes, received, _ = routes_of(ConditionedLM(), 2)
    assert received[1] == [("blocks.0", 0, 0), ("cond.2", 0, 0)]
    assert routes[0].inbound == {}


def test_three_stages_each_receive_from_the_owner():
    """With 3 stages the conditioning vector goes from stage 0 straight to stages 1 and 2 (not relayed)."""
    model = ConditionedLM()
    model.blocks.append(type(model.blocks[0])(32, 4))
    routes, received, _ = routes_of(model, 3, balance_by=[1, 1, 1])
    assert received[1] == [("blocks.0", 0, 0), ("cond.2", 0, 0)]
    assert received[2] == [("blocks.1", 0, 0), ("cond.2", 0, 0)]
    assert sorted(routes[0].outbound) == [1, 2] and sorted(routes[2].inbound) == [0, 1]


def test_a_layer_fed_by_a_later_stage_is_refused():
    """attns and mlps named as two sequential containers, although the forward alternates them."""
    with pytest.raises(PipelineTraceError, match=r"unit 'norms.1' on pipeline stage 0 uses the output of 'mlps.0', "
                                                 r"which runs on the later stage 1.*blocks=\[...\]"):
        routes_of(FusedGQAModel(), 2, blocks=["attns", "mlps"])


def test_a_root_parameter_used_after_the_blocks_is_refused():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 8)
            self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
            self.head = nn.Linear(8, VOCAB)
            self.temperature = nn.Parameter(torch.ones(()))

        def forward(self, idx):
            x = self.emb(idx)
            for layer in self.layers:
                x = layer(x)
            return self.head(x) / self.temperature

    model = Scaled()
    runtime = dispatching(model, 2)
    idx = torch.randint(0, VOCAB, (2, 8))
    calls, result = trace(runtime, lambda: model(idx).sum(), {"temperature": model.temperature})
    with pytest.raises(PipelineTraceError, match=r"parameter 'temperature' .* stage 1, but lives on stage 0"):
        plan_routes(runtime, calls, result, 2)


def test_tracing_leaves_the_model_callable_and_exact():
    """After tracing, calls outside a step run the real modules (dispatch passes through)."""
    torch.manual_seed(0)
    model = Seq2Seq()
    idx = torch.randint(0, VOCAB, (2, 8))
    want = model(idx)
    routes_of(model, 2)
    torch.testing.assert_close(model(idx), want, rtol=0, atol=0)


def test_a_head_registered_before_the_blocks_receives_the_last_hidden_state():
    from test_pp_partition import _HeadFirstGPT

    runtime = dispatching(_HeadFirstGPT(), 2)
    assert {u.name: u.stage for u in runtime.units}["lm_head"] == 1
    routes, received, names = routes_of(_HeadFirstGPT(), 2)
    assert received == [[], [("transformer.h.1", 0, 0)]]
