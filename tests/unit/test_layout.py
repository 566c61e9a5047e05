"""The layout search in one process: the profile's figures, the memory arithmetic against the memory planner, the
cost model's parts, the search's drops and ranking, the errors, and a 70B-shaped model on 1024 devices on paper."""

from __future__ import annotations

import copy
import time
import tracemalloc

import pytest
import torch
import transformers

from lightning_tpp import estimate_memory
from lightning_tpp.layout import (BlockTimes, Layout, NoLayoutFitsError, Scaled, UnknownDeviceError, device_spec,
                                  layout_memory, profile_model, search_layouts, step_time)
from lightning_tpp.layout.links import DeviceSpec, Link
from lightning_tpp.layout.memory import in_flight
from lightning_tpp.layout.search import enumerate_layouts
from lightning_tpp.layout.strategy import AutoLayoutError, auto_request, batch_shape
from models import SEQ, TinyLlama

CPU = DeviceSpec("test", flops=1e12, efficiency=0.5, memory=1e12, memory_bandwidth=1e10, intra=Link(1e9, 1e-5),
                 inter=Link(1e8, 1e-4), devices_per_node=4)


@pytest.fixture(scope="module")
def llama4():
    torch.manual_seed(0)
    model = TinyLlama(n_layers=4)
    return model, profile_model(model, seq_len=SEQ)


def test_scaled_fits_two_sizes() -> None:
    s = Scaled.fit(10.0, 6.0)  # 2 stay whole, 8 cut
    assert (s.whole, s.cut) == (10.0, 8.0) and s.at(4) == 4.0
    falls = Scaled.fit(10.0, 3.0)  # faster than 1 / tp: taken as all cut, never below zero at a larger tp
    assert falls.at(2) == 5.0 and falls.at(8) == 1.25


def test_profile_counts_every_parameter_and_expands_a_shortened_stack(llama4) -> None:
    model, profile = llama4
    assert profile.n_blocks == 4 and [b.name for b in profile.blocks] == [f"layers.{i}" for i in range(4)]
    total = sum(b.params.whole for b in profile.blocks) + profile.first_params.whole + profile.last_params.whole
    assert total == sum(p.numel() for p in model.parameters()) == profile.whole_params
    assert profile.tp_choices == (1, 2, 4)  # 4 heads (2 kv heads, shared by tp ranks beyond 2)
    assert all(b.reductions == 2 for b in profile.blocks)  # attention and MLP outputs are all-reduced
    assert profile.sent == SEQ * 32 * 4  # a stage sends (1, seq, dim) fp32 per sequence


@pytest.mark.parametrize("layout", [Layout(1, 1, 1), Layout(2, 1, 1), Layout(1, 2, 1, 4, "1f1b"),
                                    Layout(1, 4, 1, 4, "1f1b"), Layout(1, 2, 2, 2, "1f1b", True, "full_shard"),
                                    Layout(1, 1, 4, dp_sharding="no_shard"), Layout(2, 2, 1, 2, "gpipe", True),
                                    Layout(1, 1, 1, cp=2), Layout(2, 1, 1, cp=2), Layout(1, 1, 2, cp=2),
                                    Layout(1, 2, 1, 2, "1f1b", cp=2), Layout(1, 1, 1, activation_checkpointing=True,
                                                                            cp=4)],
                         ids=lambda lay: lay.describe())
def test_memory_arithmetic_is_the_planners(llama4, layout: Layout) -> None:
    """Per-block figures scaled by arithmetic against the planner's full meta run of the same layout: within 15%
    (its differences: tied/odd parameters counted per stage, FSDP2's padding, the exact partition's ends)."""
    model, profile = llama4
    batch = 4
    mine = layout_memory(profile, layout, batch=batch, backend="gloo").total
    planner = estimate_memory(model, tp=layout.tp, pp=layout.pp, dp=layout.dp,
                              microbatches=layout.microbatches if layout.pp > 1 else None,
                              batch_size=batch * layout.dp, seq_len=SEQ, schedule=layout.schedule, backend="gloo",
                              activation_checkpointing=layout.activation_checkpointing,
                              dp_shard=layout.sharded, cp=layout.cp).largest.total
    assert mine == pytest.approx(planner, rel=0.15), f"{layout.describe()}: {mine} vs the planner's {planner}"


def test_in_flight_follows_the_schedules() -> None:
    assert in_flight("1f1b", 4, 8, 0) == 4 and in_flight("1f1b", 4, 8, 3) == 1
    assert in_flight("gpipe", 4, 8, 0) == 8
    assert in_flight("zb-drain", 4, 8, 0) >= in_flight("1f1b", 4, 8, 0)


def test_step_time_parts(llama4) -> None:
    _, profile = llama4
    times = BlockTimes()
    one = step_time(profile, Layout(1, 1, 1), CPU, times, batch=8)
    assert one.bubble == 0 and one.fsdp == one.dp == 0 and one.samples == 8
    tp = step_time(profile, Layout(2, 1, 1), CPU, times, batch=8)
    assert tp.pipeline > one.pipeline / 2  # halves the compute, adds the all-reduces
    gpipe = step_time(profile, Layout(1, 4, 1, 2, "gpipe"), CPU, times, batch=8)
    deep = step_time(profile, Layout(1, 4, 1, 8, "1f1b"), CPU, times, batch=8)
    assert gpipe.bubble / gpipe.total > deep.bubble / deep.total > 0  # more micro-batches, less bubble
    ac = step_time(profile, Layout(1, 1, 1, activation_checkpointing=True), CPU, times, batch=8)
    assert ac.pipeline == pytest.approx(one.pipeline * 4 / 3, rel=0.05)  # one more forward: (F + 2F + F) / 3F
    sharded = step_time(profile, Layout(1, 1, 4), CPU, times, batch=8)
    replicated = step_time(profile, Layout(1, 1, 4, dp_sharding="no_shard"), CPU, times, batch=8)
    assert sharded.fsdp > 0 and replicated.dp > 0 and sharded.samples == 32
    grads = (sum(b.params.whole for b in profile.blocks) + profile.first_params.whole + profile.last_params.whole) * 4
    check = CPU.intra.gather(4 * 4, 4)  # the loss check's flags, once per training_step
    assert replicated.dp == pytest.approx(CPU.intra.all_reduce(grads, 4) + times.copies(grads, 2, CPU) + check)
    assert sharded.dp == pytest.approx(check)
    accumulating = step_time(profile, Layout(1, 1, 4, dp_sharding="no_shard", accumulate=3), CPU, times, batch=8)
    assert accumulating.dp - replicated.dp == pytest.approx(2 * check)  # the reduction once, the check per batch
    assert BlockTimes(copy=1e-9).copies(1e6, 2, CPU) == pytest.approx(2e-3)  # timed per byte, else bandwidth
    assert times.copies(1e6, 2, CPU) == pytest.approx(2 * 2e6 / CPU.memory_bandwidth)


def test_timed_blocks_scale_with_the_micro_batch(llama4) -> None:
    _, profile = llama4
    times = BlockTimes({("layers", 1): (1e-3, 2e-3)}, slowdown=2.0)
    f, b = times.block(profile.blocks[0], 4, 1, CPU)
    assert (f, b) == pytest.approx((8e-3, 16e-3))
    assert times.block(profile.blocks[0], 4, 2, CPU)[0] == pytest.approx(4e-3, rel=0.05)  # nearly all of it is cut


def test_search_drops_what_does_not_fit_and_ranks_the_rest(llama4) -> None:
    _, profile = llama4
    naive = layout_memory(profile, Layout(1, 4, 1, 4, "1f1b"), batch=4).total
    ranking = search_layouts(profile, world=4, device=CPU, times=BlockTimes(), batch=4, device_memory=0.8 * naive)
    assert ranking.ranked and ranking.dropped
    assert all(c.memory.total * 1.1 <= 0.8 * naive for c in ranking.ranked)
    assert all("memory: needs" in d.reason for d in ranking.dropped)
    assert [c.time.per_sample for c in ranking.ranked[1:]] == sorted(c.time.per_sample for c in ranking.ranked[1:])
    best = ranking.best
    assert best.time.samples == 4 * best.layout.dp  # each dp replica reads its own per-process batch
    assert "Layouts of 4 devices" in ranking.table()
    assert f"a global batch of {best.time.samples} samples per optimizer step" in ranking.why()


def test_partial_choices_and_global_batch(llama4) -> None:
    _, profile = llama4
    layouts = enumerate_layouts(profile, world=4, devices_per_node=4, batch=4, tp=2)
    assert {lay.tp for lay in layouts} == {2} and {lay.pp for lay in layouts} == {1, 2}
    ranking = search_layouts(profile, world=4, device=CPU, times=BlockTimes(), batch=2, global_batch=8)
    assert all(c.time.samples == 8 for c in ranking.ranked)
    assert {c.layout.accumulate for c in ranking.ranked} >= {1, 4}
    odd = search_layouts(profile, world=4, device=CPU, times=BlockTimes(), batch=2, global_batch=6)
    assert any("global batch: 6 is not a multiple" in d.reason for d in odd.dropped)


def test_errors(llama4) -> None:
    _, profile = llama4
    with pytest.raises(NoLayoutFitsError, match="no layout of 4 devices fits.*Raise device_memory"):
        search_layouts(profile, world=4, device=CPU, times=BlockTimes(), batch=4, device_memory=1.0).best
    with pytest.raises(ValueError, match=r"tp=8 does not divide the model's blocks; choose tp in \[1, 2, 4\]"):
        search_layouts(profile, world=8, device=CPU, times=BlockTimes(), batch=4, tp=8)
    with pytest.raises(ValueError, match="batch=0 must be at least one sequence"):
        search_layouts(profile, world=4, device=CPU, times=BlockTimes(), batch=0)
    with pytest.raises(UnknownDeviceError, match=r"device='tpu9' has no figures; choose one of \['a100'"):
        device_spec("tpu9")
    kwargs = dict(tp=1, pp=1, dp="auto", device_memory=None, global_batch=None, activation_checkpointing=False,
                  dp_sharding="full_shard")
    assert auto_request(**{**kwargs, "layout": None}) is None
    with pytest.raises(AutoLayoutError, match="layout='x' must be 'auto' or None"):
        auto_request(**{**kwargs, "layout": "x"})
    with pytest.raises(AutoLayoutError, match="dp=2 with a searched layout: .* pass dp='auto'"):
        auto_request(**{**kwargs, "layout": "auto", "dp": 2})
    with pytest.raises(AutoLayoutError, match="device_memory= and global_batch= are budgets for the layout search"):
        auto_request(**{**kwargs, "layout": None, "device_memory": 1e9})
    with pytest.raises(AutoLayoutError, match="global_batch=0 must be a positive number"):
        auto_request(**{**kwargs, "layout": "auto", "global_batch": 0})
    with pytest.raises(AutoLayoutError, match="device_memory= 'lots' must look like 80GB"):
        auto_request(**{**kwargs, "layout": "auto", "device_memory": "lots"})
    assert auto_request(**{**kwargs, "tp": "auto", "layout": None, "device_memory": "2GiB"}).device_memory == 2 ** 31
    # layout="auto" searches cp unless one above 1 is given; tp="auto" / pp="auto" keep the given cp
    assert [auto_request(**{**kwargs, "layout": "auto", "tp": "auto", "pp": "auto", "cp": c}).cp for c in (1, 2)] == \
        [None, 2]
    assert auto_request(**{**kwargs, "tp": "auto", "layout": None}).cp == 1
    # ep="auto" searches ep alone: tp, pp, cp, checkpointing and dp sharding kept as given
    alone = auto_request(**{**kwargs, "ep": "auto", "layout": None, "tp": 2, "cp": 2})
    assert (alone.ep, alone.tp, alone.pp, alone.cp, alone.activation_checkpointing, alone.dp_sharding) == (
        None, 2, 1, 2, False, "full_shard")
    assert auto_request(**{**kwargs, "tp": "auto", "layout": None, "ep": 2}).ep == 2
    with pytest.raises(AutoLayoutError, match="dp=2 with a searched layout"):
        auto_request(**{**kwargs, "ep": "auto", "layout": None, "dp": 2})
    with pytest.raises(AutoLayoutError, match=r"example_input_array.*got NoneType.*torch.zeros\(batch_size"):
        batch_shape(torch.nn.Module())


def test_strategy_arguments() -> None:
    from lightning_tpp import TensorPipeStrategy
    s = TensorPipeStrategy(tp="auto", pp=2, device_memory="1GB")
    assert (s.config.tp, s.config.pp, s._auto_layout.tp, s._auto_layout.pp) == ("auto", 2, None, 2)  # tp decided at setup (with_layout)
    with pytest.raises(AutoLayoutError, match="dp=2 with a searched layout"):
        TensorPipeStrategy(layout="auto", dp=2)


def test_70b_on_1024_devices_on_paper_in_seconds_allocating_nothing() -> None:
    """A Llama-3-70B-shaped model built on meta: profiled (three blocks measured) and searched over every layout of
    1024 devices in seconds; Python's own allocations stay small (tracemalloc) and no tensor leaves meta."""
    cfg = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                   num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    tracemalloc.start()
    start = time.perf_counter()
    profile = profile_model(model, seq_len=8192, dtype=torch.bfloat16)
    ranking = search_layouts(profile, world=1024, device=device_spec("h100"), times=BlockTimes(), batch=8,
                             device_memory=80e9, global_batch=2048)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 30, f"{seconds:.1f} s"  # ~18 s on a 2-core machine under tracemalloc (1,603 layouts ranked)
    assert peak < 64 * 2 ** 20, f"{peak} bytes traced"
    assert all(p.is_meta for p in model.parameters())
    assert profile.n_blocks == 80 and profile.whole_params == pytest.approx(70.6e9, rel=0.01)
    best = ranking.best
    assert best.memory.total * 1.1 <= 80e9 and len(ranking.ranked) > 10
    assert any(d.reason.startswith("memory") for d in ranking.dropped)  # tp=1 pp=1 cannot hold 70B


def test_262k_positions_of_an_8b_fit_eight_devices_only_with_cp() -> None:
    """Llama-3-8B's shape at 262,144 positions on 8 devices of 80 GiB (the issue's case): every layout without
    context parallelism is dropped for memory, the search chooses one with it; cp is searched only where each rank
    keeps 1024 positions or more, and never for a model with experts (see the Mixtral test)."""
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    profile = profile_model(model, seq_len=262144, dtype=torch.bfloat16)
    ranking = search_layouts(profile, world=8, device=device_spec("h100"), times=BlockTimes(), batch=1,
                             device_memory=80 * 2 ** 30)
    assert ranking.best.layout.cp == 8 and ranking.best.memory.total * 1.1 <= 80 * 2 ** 30
    assert {d.layout.cp for d in ranking.dropped} == {1, 2, 4, 8}
    assert all(d.reason.startswith("memory") for d in ranking.dropped)
    short = profile_model(model, seq_len=2048, dtype=torch.bfloat16)
    assert {lay.cp for lay in enumerate_layouts(short, world=8, devices_per_node=8, batch=1)} == {1, 2}


def test_cp_costs_charge_the_attention_by_the_strategys_cp_mode() -> None:
    """Under cp_mode="a2a" (where each tp rank's query heads divide over cp) a cp layout's attention moves its
    queries, keys and values to 1/cp of the heads and its output back (one all-to-all each way) and recomputes
    nothing; key/value heads that cp does not divide are repeated first (at tp2 x cp4 each tp rank's one key/value head,
    4 times). Under "allgather" it gathers the keys and values in forward, again in backward with their
    reduce-scatter, and recomputes the attention, except on CPU for causal calls (joined by log-sum-exp). The profile's
    figures are the SDPA calls' bytes: queries (4096 positions x 8 heads x 32 features, bf16) and keys + values (2
    key/value heads)."""
    from lightning_tpp.layout.cost import _context

    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=2, vocab_size=1024)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    profile = profile_model(model, seq_len=4096, dtype=torch.bfloat16)
    block = profile.blocks[0]
    assert (block.queries, block.keys, block.heads, block.kv_heads) == (4096 * 256 * 2, 2 * 4096 * 64 * 2, 8, 2)
    assert block.joined_flops == block.attention_flops > 0  # HF Llama's SDPA calls: is_causal, no mask
    link = device_spec("h100").intra
    gather, a2a = (Layout(2, 1, 1, cp=4, cp_mode=mode) for mode in ("allgather", "a2a"))
    # per tp rank: 4 query heads, 1 key/value head repeated 4 times (the keys of 4 heads)
    moved = link.all_to_all((2 * block.queries / 2 + block.keys / 2 * 4) * 2 / 4, 4)
    assert _context(block, 1e-3, 2, a2a, link) == (moved, moved)
    cp2 = Layout(1, 1, 1, cp=2, cp_mode="a2a")  # 2 key/value heads over cp2: none repeated
    assert _context(block, 1e-3, 2, cp2, link)[0] == link.all_to_all((2 * block.queries + block.keys) * 2 / 2, 2)
    forward, backward = _context(block, 1e-3, 2, gather, link)
    exchanged = forward + link.reduce_scatter(block.keys * 2 / 2, 4)
    assert forward == link.gather(block.keys * 2 / 2, 4) and backward > exchanged  # and the attention's recompute
    assert _context(block, 1e-3, 2, gather, link, cpu=True) == (forward, exchanged)  # on CPU: nothing recomputed
    ranking = search_layouts(profile, world=4, device=device_spec("h100"), times=BlockTimes(), batch=1, cp=4,
                             cp_mode="a2a")
    assert ranking.ranked and all(c.layout.describe().startswith("tp=1 pp=1 cp=4 a2a dp=1") for c in ranking.ranked)
    # 8 query heads: at tp=4 x cp=4 each tp rank's 2 heads do not divide over cp, so the call runs as allgather
    assert _context(block, 1e-3, 2, Layout(4, 1, 1, cp=4, cp_mode="a2a"), link) == _context(
        block, 1e-3, 2, Layout(4, 1, 1, cp=4), link)
    # cp_mode="auto": both modes of each cp layout ranked, the strategy's config takes the chosen one
    both = search_layouts(profile, world=4, device=device_spec("h100"), times=BlockTimes(), batch=1, cp=4,
                          cp_mode=None)
    assert {c.layout.cp_mode for c in both.ranked} == {"allgather", "a2a"}
    from lightning_tpp.config import TensorPipeConfig

    config = TensorPipeConfig(layout="auto", cp_mode="auto")
    assert config.auto_request().cp_mode is None
    assert config.with_layout(both.best.layout).cp_mode == both.best.layout.cp_mode
    assert TensorPipeConfig(layout="auto", cp_mode="a2a").with_layout(Layout(1, 1, 1, cp=4)).cp_mode == "a2a"
    with pytest.raises(ValueError, match="cp_mode='auto' is chosen by the layout search: pass layout='auto'"):
        TensorPipeConfig(cp=2, cp_mode="auto")


def _plan_auto(tmp_path, capsys, cfg: transformers.PretrainedConfig, top: int) -> str:
    """``lightning-tpp plan config.json --auto`` on 16 H100s (8 per node) with ``cfg``: what it prints."""
    from lightning_tpp.__main__ import main
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    assert main(["plan", str(tmp_path / "config.json"), "--auto", "--devices", "16", "--devices-per-node", "8",
                 "--device-memory", "80GB", "--device", "h100", "--batch-size", "4", "--seq-len", "128",
                 "--dtype", "bfloat16", "--top", str(top)]) == 0
    return capsys.readouterr().out


def test_plan_auto_prints_the_ranked_table(tmp_path, capsys) -> None:
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=4, vocab_size=1024)
    out = _plan_auto(tmp_path, capsys, cfg, top=3)
    assert "Layouts of 16 devices (4 sequences per process; 74.51 GiB)" in out and "chosen tp=" in out
    assert " 1 tp=" in out and " 4 tp=" not in out  # --top 3


def test_one_process_layout_auto_records_the_choice_and_sets_accumulation() -> None:
    """``global_batch`` fixes the samples per optimizer step: with one process reading 4, accumulation is 2."""
    import lightning as L

    from lightning_tpp import TensorPipeStrategy
    from models import LitLM, token_dataset

    module = LitLM("llama")
    module.example_input_array = torch.zeros(4, SEQ, dtype=torch.long)
    strategy = TensorPipeStrategy(layout="auto", global_batch=8, print_plan=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(module, torch.utils.data.DataLoader(token_dataset(16), batch_size=4))
    finally:  # the strategy's one-process group, which later tests would meet
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    chosen = trainer.strategy.parallel_state.layout
    assert (chosen.tp, chosen.pp, chosen.dp, chosen.accumulate) == (1, 1, 1, 2)
    assert trainer.accumulate_grad_batches == 2 and trainer.global_step == 1 and strategy.layout_ranking is not None


class _CountingLM(torch.nn.Module):
    """Indexes its blocks by a count it keeps (``range(self.n)``): a shortened copy cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = TinyLlama(n_layers=5)
        self.n = 5

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        m = self.inner
        t = torch.arange(ids.shape[1], dtype=torch.float32, device=ids.device)
        inv = 1.0 / (10000 ** (torch.arange(0, m.head_dim, 2, device=ids.device).float() / m.head_dim))
        freqs = torch.outer(t, inv)
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
        h = m.tok_embeddings(ids)
        for i in range(self.n):
            h = m.layers[i](h, cos, sin)
        return m.output(m.norm(h))


def test_a_forward_that_counts_its_blocks_is_profiled_whole() -> None:
    model = _CountingLM()
    profile = profile_model(model, seq_len=SEQ)
    assert profile.n_blocks == 5 and profile.whole_params == sum(p.numel() for p in model.parameters())
    assert len(model.inner.layers) == 5  # the user's model is put back as it was


# ---- expert parallelism in the search ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixtral():
    from models import HFMoE
    torch.manual_seed(0)
    model = HFMoE("mixtral")  # 2 layers, 4 experts (top-2) in 3-D banks
    return model, profile_model(model, seq_len=SEQ)


def test_the_profile_records_the_routed_layers(mixtral) -> None:
    model, profile = mixtral
    banks = [model.get_submodule(f"model.model.layers.{i}.mlp.experts") for i in range(2)]
    assert [(r.name, r.kind, r.experts, r.top_k, r.hidden) for r in profile.routed] == [
        (f"model.model.layers.{i}.mlp.experts", "bank", 4, 2, 32) for i in range(2)]
    for block, bank in zip(profile.blocks, banks):
        whole = sum(p.numel() for p in bank.parameters())
        assert block.experts.whole == block.routed[0].params == whole and block.experts.at(2) == whole / 2
        assert block.active == block.params.whole - whole / 2  # top-2 of 4: the partition's weight
        assert block.exchange_saved > 0  # the exchange's rows held for backward, measured at ep = 2
    # experts' FLOPs by arithmetic (none reach an expert on meta): 2 per parameter of one expert, per slot
    assert all(b.flops.whole >= SEQ * 2 * (b.experts.whole / 4) * 2 for b in profile.blocks)


def test_the_profile_joins_what_the_cpu_route_joins() -> None:
    """The profile counts as joined (not recomputed on CPU) exactly the causal SDPA calls that cp's CPU route joins
    by log-sum-exp (``context_parallel.attention.joinable``): not a call whose values are narrower than its queries
    (MLA), nor one with a mask."""
    from lightning_tpp.layout.profile import _Attention

    def joined(q: tuple, k: tuple, v: tuple, **options) -> float:
        with torch.device("meta"), _Attention() as mode:
            torch.nn.functional.scaled_dot_product_attention(torch.empty(q), torch.empty(k), torch.empty(v), **options)
        assert mode.flops > 0
        return mode.joined / mode.flops

    q = (1, 4, 8, 16)
    assert joined(q, q, q, is_causal=True) == 1.0
    assert joined(q, q, (1, 4, 8, 8), is_causal=True) == 0.0  # values narrower (DeepSeek's MLA)
    assert joined(q, (1, 2, 8, 16), (1, 2, 8, 16), is_causal=True, enable_gqa=True) == 1.0
    assert joined(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool, device="meta")) == 0.0


def test_ep_is_enumerated_only_where_the_model_has_experts(llama4, mixtral) -> None:
    assert {lay.ep for lay in enumerate_layouts(llama4[1], world=4, devices_per_node=4, batch=4)} == {1}
    layouts = enumerate_layouts(mixtral[1], world=4, devices_per_node=4, batch=4)
    assert {lay.ep for lay in layouts} == {1, 2, 4}
    assert all((lay.dp * lay.tp) % lay.ep == 0 for lay in layouts)  # drawn from a stage's dp x tp ranks
    assert {(lay.tp, lay.dp, lay.ep) for lay in layouts if lay.pp == 1} >= {(1, 4, 4), (2, 2, 4), (4, 1, 2)}
    with pytest.raises(ValueError, match="ep=2: the model has no mixture-of-experts layer to split; use ep=1"):
        search_layouts(llama4[1], world=4, device=CPU, times=BlockTimes(), batch=4, ep=2)


def test_ep_that_cannot_split_the_experts_is_dropped_with_the_reason(mixtral) -> None:
    from models import ListMoELM
    ranking = search_layouts(mixtral[1], world=6, device=CPU, times=BlockTimes(), batch=4)
    reasons = {d.layout.ep: d.reason for d in ranking.dropped}
    assert reasons[3] == "ep: ep=3 must divide the 4 experts of model.model.layers.0.mlp.experts"
    assert 6 in reasons and {c.layout.ep for c in ranking.ranked} == {1, 2}
    listed = profile_model(ListMoELM(), seq_len=SEQ)  # experts as a list of modules: ep does not split them
    ranking = search_layouts(listed, world=4, device=CPU, times=BlockTimes(), batch=4)
    assert {c.layout.ep for c in ranking.ranked} == {1}
    assert any(d.reason.startswith("ep: ep=2: the experts of blocks.0.moe.experts are a list of 4 modules")
               for d in ranking.dropped)


@pytest.mark.parametrize("layout", [Layout(1, 1, 4, ep=2), Layout(1, 1, 4, ep=4, dp_sharding="no_shard"),
                                    Layout(2, 1, 2, ep=4), Layout(2, 1, 2, ep=2, dp_sharding="no_shard"),
                                    Layout(1, 2, 2, 4, "1f1b", ep=2), Layout(1, 1, 4, ep=2, activation_checkpointing=True)],
                         ids=lambda lay: lay.describe())
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_ep_memory_arithmetic_is_the_planners(mixtral, layout: Layout, backend: str) -> None:
    """The search's memory arithmetic within 15% of ``estimate_memory``'s (which cuts and runs the model on meta), over
    gloo and NCCL (whose FSDP2 holds a bank gathered beside its block and the blocks around it)."""
    model, profile = mixtral
    mine = layout_memory(profile, layout, batch=4, backend=backend)
    planner = estimate_memory(model, tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep,
                              microbatches=layout.microbatches if layout.pp > 1 else None, batch_size=4 * layout.dp,
                              seq_len=SEQ, schedule=layout.schedule, backend=backend,
                              activation_checkpointing=layout.activation_checkpointing,
                              dp_shard=layout.sharded).largest
    assert mine.total == pytest.approx(planner.total, rel=0.15), f"{layout.describe()}: {mine} vs {planner}"
    if layout.sharded and layout.expert_replicas > 1:  # a bank's backward, FSDP2's most: the same bytes
        assert mine.gathered == pytest.approx(planner.gathered, rel=0.01), f"{layout.describe()}: {mine} vs {planner}"


def test_memory_per_rank_shrinks_with_ep(mixtral) -> None:
    _, profile = mixtral
    states = [layout_memory(profile, Layout(1, 1, 4, ep=ep, dp_sharding="no_shard"), batch=4).states
              for ep in (1, 2, 4)]
    assert states[0] > states[1] > states[2]
    experts = sum(b.experts.whole for b in profile.blocks) * 4 * 4  # fp32 parameter, gradient, AdamW's two states
    assert states[0] - states[1] == pytest.approx(experts / 2) and states[1] - states[2] == pytest.approx(experts / 4)
    sharded = [layout_memory(profile, Layout(1, 1, 4, ep=ep), batch=4).states for ep in (2, 4)]
    # under FSDP2 the experts are sharded over their replicas too: 1/(ep x replicas) = 1/4 of them at either ep
    assert sharded[0] == pytest.approx(sharded[1]) and sharded[0] < states[1]
    dense = layout_memory(profile, Layout(1, 1, 4, ep=1), batch=4).states  # experts in FSDP2's units with the rest
    assert sharded[0] == pytest.approx(dense, rel=0.01)
    # dp = 1, ep2 over tp4: the experts' 2 replicas are tp ranks, over which they are sharded (unless no_shard)
    over_tp, whole = (layout_memory(profile, Layout(4, 1, 1, ep=2, dp_sharding=d), batch=4).states
                      for d in ("full_shard", "no_shard"))
    assert whole - over_tp == pytest.approx(experts / 4)


def test_ep_step_time_adds_the_all_to_alls_and_the_replicas_reduction(mixtral) -> None:
    _, profile = mixtral
    batch, elem = 4, 4
    one = step_time(profile, Layout(1, 1, 4, dp_sharding="no_shard"), CPU, BlockTimes(), batch=batch)
    two = step_time(profile, Layout(1, 1, 4, ep=2, dp_sharding="no_shard"), CPU, BlockTimes(), batch=batch)
    rows = CPU.intra.all_to_all(batch * SEQ * 2 * 32 * elem, 2)  # tokens x top-2 rows of 32 fp32
    counts = CPU.intra.all_to_all(4 * 8, 2)
    assert two.pipeline - one.pipeline == pytest.approx(2 * (4 * rows + counts))  # 2 layers: 2 + 2 rows, counts
    experts = sum(b.experts.whole for b in profile.blocks) * elem
    assert two.experts == pytest.approx(CPU.intra.all_reduce(experts / 2, 2)  # over its 2 replicas, with the copies
                                        + BlockTimes().copies(experts / 2, 2, CPU))
    assert two.dp < one.dp  # the dense rest only


def test_a_mixtral_shaped_model_ranks_on_paper() -> None:
    """Mixtral-8x7B's shape (32 layers, 8 experts top-2, 32 heads / 8 kv) on 64 H100: profiled on meta, every
    layout of ep ranked with the rest; ep spares the experts' memory, the chosen layout fits."""
    cfg = transformers.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=32000)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    profile = profile_model(model, seq_len=4096, dtype=torch.bfloat16)
    assert len(profile.routed) == 32 and profile.whole_params == pytest.approx(46.7e9, rel=0.01)
    ranking = search_layouts(profile, world=64, device=device_spec("h100"), times=BlockTimes(), batch=2,
                             device_memory=80e9)
    best = ranking.best
    assert best.memory.total * 1.1 <= 80e9 and {c.layout.ep for c in ranking.ranked} >= {1, 2, 8}
    assert any(d.reason.startswith("ep: ep=16 must divide the 8 experts") for d in ranking.dropped)
    assert any(d.reason.startswith("memory") for d in ranking.dropped)
    replicated = [layout_memory(profile, Layout(1, 1, 64, ep=ep, dp_sharding="no_shard"), batch=2).states
                  for ep in (1, 8)]
    assert replicated[1] < replicated[0] / 2  # an eighth of the experts whole, against all of them on every rank
    cut = [layout_memory(profile, Layout(8, 1, 8, ep=ep, dp_sharding="no_shard"), batch=2).states for ep in (1, 8)]
    assert cut[1] == pytest.approx(cut[0])  # an eighth of the experts whole, or an eighth of every expert (tp)
    assert "ep=" in ranking.table(top=len(ranking.ranked))
    # 4096 positions: cp up to 4 (1024 per rank), with ep drawn from dp x cp x tp (ep=8 over dp4 x cp2 at tp1)
    assert {c.layout.cp for c in ranking.ranked} >= {1, 2, 4}
    assert any(c.layout.cp == 2 and c.layout.ep == 8 and c.layout.dp * c.layout.tp == 4 for c in ranking.ranked)


def test_plan_auto_on_a_mixture_of_experts_config(tmp_path, capsys) -> None:
    cfg = transformers.MixtralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=1024)
    out = _plan_auto(tmp_path, capsys, cfg, top=40)
    assert "Layouts of 16 devices" in out and "chosen tp=" in out and " ep=" in out
    assert "dropped:" in out and "x ep" in out  # ep=16 does not divide the 8 experts


def test_the_optimizer_step_is_timed_per_tensor_and_per_element(llama4) -> None:
    """On the device (here the CPU), an AdamW step costs per tensor as well as per byte: timed on one block's shapes
    and one flat tensor; the cost model charges each rank its own tensors and elements (FSDP2 shards the elements,
    not the tensor count)."""
    from lightning_tpp.layout.timing import time_optimizer
    model, profile = llama4
    per_tensor, per_element = time_optimizer(model, profile, device=torch.device("cpu"))
    assert per_tensor >= 0 and per_element > 0
    assert sum(b.tensors for b in profile.blocks) + sum(profile.end_tensors) == len(list(model.parameters()))
    times = BlockTimes(optimizer=(1e-4, 1e-8))
    whole = step_time(profile, Layout(1, 1, 4, dp_sharding="no_shard"), CPU, times, batch=4).optimizer
    sharded = step_time(profile, Layout(1, 1, 4), CPU, times, batch=4).optimizer
    tensors = len(list(model.parameters()))
    assert whole == pytest.approx(1e-4 * tensors + 1e-8 * profile.whole_params)
    assert sharded == pytest.approx(1e-4 * tensors + 1e-8 * profile.whole_params / 4)


def test_block_times_timed_together_are_taken_as_measured(llama4) -> None:
    """On CPU every process times at once (the cores shared as in a step): the median, unscaled; alone, the least,
    scaled by processes per core."""
    import os
    from lightning_tpp.layout.strategy import block_times
    model, profile = llama4
    kwargs = dict(device=torch.device("cpu"), dtype=torch.float32, local_processes=4)
    together = block_times(model, profile, 2, together=True, **kwargs)
    alone = block_times(model, profile, 2, together=False, **kwargs)
    assert set(together.measured) == set(alone.measured) == {("layers", 1), ("layers", 2)}
    assert together.slowdown == 1.0 and together.optimizer is not None
    assert alone.slowdown == max(1.0, 4 / len(os.sched_getaffinity(0)))
    assert together.copy is not None and together.copy > 0  # the reduction's host copies, seconds per byte


def test_figures_timed_together_are_the_median_over_the_processes() -> None:
    """Rank 0 ranks from every process's figures, each the median over them: one process that had the cores to
    itself for a block (11 ms where the others took 25) or whose optimizer step was hit by something else does not
    set the prediction; an entry that only some processes have is the median over those."""
    from lightning_tpp.layout.strategy import pooled

    def rank(block: float, optimizer: float, straggle: float, extra: bool = False) -> tuple:
        measured = {("layers", 8): (block, 2 * block)}
        if extra:
            measured[("first", 8)] = (1.0, 2.0)
        return measured, {8: (0.002, 0.004)}, (optimizer, 1e-9), 1e-10, straggle

    measured, ends, optimizer, copy, straggle = pooled([rank(0.011, 4e-4, 0.1, extra=True), rank(0.025, 1e-4, 0.0),
                                                        rank(0.025, 1e-4, 0.2), rank(0.024, 1e-4, 0.1)])
    assert measured == {("layers", 8): (pytest.approx(0.0245), pytest.approx(0.049)), ("first", 8): (1.0, 2.0)}
    assert ends == {8: (pytest.approx(0.002), pytest.approx(0.004))}
    assert optimizer == (pytest.approx(1e-4), pytest.approx(1e-9)) and copy == pytest.approx(1e-10)
    assert straggle == pytest.approx(0.1)


def test_processes_timing_together_meet_before_each_block_size_even_where_one_fails(llama4) -> None:
    """Every process times the same block at the same moment (a barrier before each kind and size, and before the
    optimizer's and the copy's timing): called as often whatever fails or is cached, or the ranks' barriers would
    pair with different work, or hang."""
    from lightning_tpp.layout.timing import time_blocks, time_copy, time_optimizer
    model, profile = llama4
    met: list[int] = []
    sync = lambda: met.append(1)  # noqa: E731
    cpu = torch.device("cpu")
    time_blocks(model, profile, [1, 2], device=cpu, together=True, sync=sync)
    assert len(met) == 2  # one kind of block, two sizes
    time_blocks(model, profile, [1, 2], device=cpu, together=True, sync=sync)  # cached: met as often
    assert len(met) == 4
    failing = lambda model, ids: (_ for _ in ()).throw(RuntimeError("no forward here"))  # noqa: E731
    with pytest.raises(ValueError, match="no block of the model could be timed"):
        time_blocks(model, profile, [3, 5], device=cpu, together=True, sync=sync, forward=failing)  # not cached
    assert len(met) == 6  # the failed kind's other size still met
    time_optimizer(model, profile, device=cpu, together=True, sync=sync)
    assert time_copy(1 << 16, device=cpu, together=True, sync=sync) > 0
    assert len(met) == 9  # two optimizer groups, one copy


def test_the_wait_for_the_slowest_process_is_measured_at_the_timing_barriers(llama4, monkeypatch) -> None:
    """``Meeting`` records the wait at each barrier beyond the least one (the barrier itself) per second of work
    between meetings; the cost model scales the compute of a layout of several processes by it."""
    from lightning_tpp.layout import timing
    from lightning_tpp.layout.timing import Meeting
    now = [0.0]  # a clock that moves only when the barrier waits or the work runs (no sleeping on busy cores)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    waits = iter([0.5, 0.01, 0.03, 0.01])  # the first meeting's wait (before the timing) is not counted
    meeting = Meeting(barrier=lambda: now.__setitem__(0, now[0] + next(waits)))
    for _ in range(4):
        meeting()
        now[0] += 0.1  # the work between meetings
    monkeypatch.undo()
    assert meeting.straggle == pytest.approx(0.02 / 0.3)  # 0.02 s beyond the floor over 0.3 s of work
    _, profile = llama4
    times = BlockTimes({("layers", 8): (1e-3, 2e-3)})
    slow = BlockTimes({("layers", 8): (1e-3, 2e-3)}, straggle=0.25)
    for layout in (Layout(1, 1, 4, dp_sharding="no_shard"), Layout(2, 2, 1, 8, "1f1b")):
        assert step_time(profile, layout, CPU, slow, batch=8).pipeline == pytest.approx(
            1.25 * step_time(profile, layout, CPU, times, batch=8).pipeline)
    alone = Layout(1, 1, 1)
    assert step_time(profile, alone, CPU, slow, batch=8).pipeline == step_time(profile, alone, CPU, times, batch=8).pipeline


def test_a_block_unlike_its_stack_is_timed_as_its_own_kind(llama4) -> None:
    """T5's first block of each stack holds the relative position bias (and computes it for the others): timed apart
    from the blocks after it; a stack of alike blocks is one kind."""
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=3,
                                num_decoder_layers=2, decoder_start_token_id=0, pad_token_id=0)
    profile = profile_model(transformers.T5ForConditionalGeneration(cfg), seq_len=SEQ)
    assert [b.kind for b in profile.blocks] == ["encoder.block.0", "encoder.block", "encoder.block",
                                                "decoder.block.0", "decoder.block"]
    assert {b.kind for b in llama4[1].blocks} == {"layers"}


def test_fsdp_collectives_at_their_measured_bandwidth(llama4) -> None:
    """All-gather and reduce-scatter cost their ring time with the bandwidth term scaled by the factor measured at
    setup (gloo's are not rings), plus FSDP2's copy around each: FSDP2's with the factors of what the strategy sends
    (``core.collectives``), not those of torch's own (activations: cp, sequence parallelism)."""
    link = Link(1e9, 1e-5, gather_factor=7.0, scatter_factor=9.0, param_gather_factor=1.5, grad_scatter_factor=3.0)
    assert link.gather(4e6, 4) == pytest.approx(3e-5 + 7.0 * 0.75 * 4e6 / 1e9)
    assert link.reduce_scatter(4e6, 4) == pytest.approx(3e-5 + 9.0 * 0.75 * 4e6 / 1e9)
    assert link.reduce_scatter(4e6, 4, link.grad_scatter_factor) == pytest.approx(3e-5 + 3.0 * 0.75 * 4e6 / 1e9)
    _, profile = llama4
    times = BlockTimes(copy=1e-9)
    plain = DeviceSpec("t", flops=1e12, efficiency=0.5, memory=1e12, memory_bandwidth=1e10, intra=Link(1e9, 1e-5),
                       inter=Link(1e9, 1e-5))
    measured = DeviceSpec("t", flops=1e12, efficiency=0.5, memory=1e12, memory_bandwidth=1e10, intra=link, inter=link)
    layout = Layout(1, 1, 4)  # full_shard: two all-gathers and a reduce-scatter per micro-batch
    grads = (sum(b.params.whole for b in profile.blocks) + profile.first_params.whole + profile.last_params.whole) * 4
    extra = step_time(profile, layout, measured, times, batch=8).fsdp - step_time(profile, layout, plain, times,
                                                                                  batch=8).fsdp
    assert extra == pytest.approx((2 * 0.5 + 2.0) * 0.75 * grads / 1e9)


def _t5() -> transformers.T5ForConditionalGeneration:
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                                num_decoder_layers=2, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(cfg)


def test_a_stand_in_block_passes_the_hidden_state_through_in_the_blocks_own_output_structure() -> None:
    """T5's first encoder block returns (hidden, position bias): the stand-in returns the same structure, the input
    passed through (so the head's gradient reaches the embeddings), zeros in the bias's place, computing nothing."""
    from lightning_tpp.layout.timing import _StandIn
    model = _t5()
    block = model.encoder.block[0]
    x = torch.randn(2, SEQ, 32, requires_grad=True)
    mask = torch.zeros(2, 1, 1, SEQ)
    real = block(x, attention_mask=mask)
    stand = _StandIn(copy.deepcopy(block).to("meta"), torch.device("cpu"))
    out = stand(x, attention_mask=mask)
    assert type(out) is type(real) and len(out) == len(real) == 3
    shapes = lambda o: [None if t is None else tuple(t.shape) for t in o]  # noqa: E731
    assert shapes(out) == shapes(real) and out[2] is None
    assert out[0].data_ptr() == x.data_ptr() and not out[1].any()
    assert not list(stand.parameters())  # nothing of the block is built on the device
    out[0].sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("name", ["llama", "t5", "gpt2"])
def test_the_ends_are_timed_with_every_block_standing_in(llama4, name: str) -> None:
    """Embeddings, head and loss (and whatever else lies outside the blocks) timed per micro-batch size, on models
    whose blocks return a tensor (TinyLlama), a tuple with a bias the next block takes (T5, encoder and decoder) or
    a tuple (GPT-2), without a warning."""
    import warnings
    from lightning_tpp.layout.timing import time_ends
    if name == "llama":
        model, profile = llama4
    else:
        model = _t5() if name == "t5" else transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=SEQ))
        profile = profile_model(model, seq_len=SEQ)
    met: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ends = time_ends(model, profile, [1, 2], device=torch.device("cpu"), sync=lambda: met.append(1))
    assert set(ends) == {1, 2} and all(f > 0 and b > 0 for f, b in ends.values())
    assert met == [1]  # one meeting, before the timing


def test_ends_that_do_not_run_fall_back_to_their_flops_with_a_warning(llama4) -> None:
    from lightning_tpp.layout.timing import time_ends
    model, profile = llama4
    failing = lambda model, ids: (_ for _ in ()).throw(RuntimeError("no forward here"))  # noqa: E731
    met: list[int] = []
    with pytest.warns(UserWarning, match="did not run with its blocks standing in"):
        assert time_ends(model, profile, [3], device=torch.device("cpu"), forward=failing,
                         sync=lambda: met.append(1)) == {}
    assert met == [1]  # met all the same
    blocks = {("layers", 8): (1e-3, 2e-3)}
    flops = step_time(profile, Layout(1, 1, 1), CPU, BlockTimes(blocks), batch=8).pipeline
    ends = profile.end_flops.whole * 8 / BlockTimes(blocks).rate(profile, CPU)
    assert flops == pytest.approx(4 * 3e-3 + 3 * ends)


def test_timed_ends_are_charged_to_the_last_stage_and_cut_by_tp(llama4) -> None:
    _, profile = llama4
    blocks = {("layers", 8): (1e-3, 2e-3), ("layers", 4): (0.5e-3, 1e-3)}
    none = BlockTimes(blocks, ends={8: (0.0, 0.0), 4: (0.0, 0.0)})
    timed = BlockTimes(blocks, ends={8: (4e-3, 6e-3), 4: (2e-3, 3e-3)})
    one = Layout(1, 1, 1)
    assert step_time(profile, one, CPU, timed, batch=8).pipeline - step_time(profile, one, CPU, none, batch=8).pipeline \
        == pytest.approx(10e-3)
    share = profile.end_flops.at(2) / profile.end_flops.whole
    assert 0 < share < 1  # the head is cut by tp
    assert timed.ends_time(profile, 8, 2, CPU) == pytest.approx((4e-3 * share, 6e-3 * share))
    assert timed.ends_time(profile, 6, 1, CPU) == pytest.approx((3e-3, 4.5e-3))  # from the largest size below
    pipe = Layout(1, 2, 1, 2, "gpipe")  # two micro-batches of 4: each F and B of the last stage carries the ends
    last = step_time(profile, pipe, CPU, timed, batch=8).pipeline - step_time(profile, pipe, CPU, none, batch=8).pipeline
    assert last == pytest.approx(2 * 5e-3, rel=0.05)


def test_on_gloo_a_layout_within_5_percent_of_the_fastest_loses_to_a_simpler_one() -> None:
    """gloo's collectives run on the cores that compute, and each waits for the slowest process: where the cost
    model is that far apart, the layout with fewer synchronisation points (no ep, smaller tp, fewer stages) ranks
    first; elsewhere (NCCL) within 1%."""
    from types import SimpleNamespace
    from lightning_tpp.layout.cost import StepTime
    from lightning_tpp.layout.search import TIE, TIE_GLOO, Candidate, Ranking, _simpler_first

    def cand(layout: Layout, ms: float) -> Candidate:
        return Candidate(layout, StepTime(ms * 8e-3, 0.0, 0.0, 0.0, 0.0, 8), SimpleNamespace(total=1e9))

    ep2, plain, tp2 = (cand(Layout(1, 1, 4, ep=2, dp_sharding="no_shard"), 17.40),
                       cand(Layout(1, 1, 4, dp_sharding="no_shard"), 17.83), cand(Layout(2, 1, 2), 17.50))
    assert (TIE, TIE_GLOO) == (0.01, 0.05)
    assert [c.layout for c in _simpler_first([ep2, tp2, plain], TIE_GLOO)] == [plain.layout, ep2.layout, tp2.layout]
    assert [c.layout for c in _simpler_first([ep2, tp2, plain], TIE)] == [ep2.layout, tp2.layout, plain.layout]
    ranking = Ranking(_simpler_first([ep2, tp2, plain], TIE_GLOO), [], 4, 8, None, tie=TIE_GLOO)
    why = ranking.why()
    assert "chosen tp=1 pp=1 dp=4 no_shard" in why and "within the 5% tie that the simpler layout wins" in why


def test_the_search_takes_the_tie_of_its_backend(llama4) -> None:
    _, profile = llama4
    times = BlockTimes({("layers", 8): (1e-3, 2e-3)})
    for backend, tie in (("gloo", 0.05), ("nccl", 0.01)):
        ranking = search_layouts(profile, world=4, device=CPU, times=times, batch=8, backend=backend)
        best = min(c.time.per_sample for c in ranking.ranked)
        assert ranking.tie == tie and ranking.best.time.per_sample <= best * (1 + tie)


def test_measure_link_takes_its_tensors_where_the_backend_does(tmp_path, monkeypatch) -> None:
    """gloo: on the CPU (under NCCL, the GPU: tests/gpu/test_layout_gpu.py; a CPU tensor there is refused), or on
    the device given."""
    import torch.distributed as dist

    from lightning_tpp.layout import measure_link
    from lightning_tpp.layout.links import backend_device

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    devices = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: devices.append(t.device.type) or real(t, **kw))
    try:
        assert backend_device() == torch.device("cpu")
        link = measure_link(small=16, large=1024)
        assert link.bandwidth > 0 and link.latency > 0 and devices and set(devices) == {"cpu"}
        devices.clear()
        monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: devices.append(t.device.type))
        measure_link(small=16, large=1024, device=torch.device("meta"))
        assert devices and set(devices) == {"meta"}
    finally:
        dist.destroy_process_group()


def test_a_tied_embedding_and_head_count_once_on_one_stage() -> None:
    """The arithmetic counted a weight shared by the embedding and the head on the first and on the last stage, so
    twice at pp = 1 (a 1.2 B Llama with its 128 K vocabulary tied: 2.1 GB too many on an H200's check)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    profile = profile_model(model, seq_len=SEQ)
    assert profile.shared_params.whole == 2048 * 32
    for pp in (1, 3):
        mine = layout_memory(profile, Layout(1, pp, 1, microbatches=pp), batch=pp)
        planner = estimate_memory(model, tp=1, pp=pp, batch_size=pp, microbatches=pp, seq_len=SEQ).largest
        assert mine.states == pytest.approx(planner.states, rel=0.01), f"pp={pp}"
