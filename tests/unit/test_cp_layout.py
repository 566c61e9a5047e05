"""Context parallelism's positions (issue #46), in one process: which positions each rank holds, that causal attention
costs every rank the same, that the natural order is restored, and which block inputs carry the sequence."""

from __future__ import annotations

import pytest
import torch

from lightning_tpp.context_parallel.blocks import _sequence_dim
from lightning_tpp.context_parallel.split import SeqLayout, local_positions


def test_head_and_tail_chunks() -> None:
    assert SeqLayout.of(8, 2, 0).positions() == [0, 1, 6, 7]
    assert SeqLayout.of(8, 2, 1).positions() == [2, 3, 4, 5]
    assert SeqLayout.of(16, 4, 3).positions() == [6, 7, 8, 9]


@pytest.mark.parametrize("length, cp", [(32, 2), (30, 2), (64, 4), (100, 8), (7, 2)])
def test_every_position_once_and_padding(length: int, cp: int) -> None:
    layouts = [SeqLayout.of(length, cp, r) for r in range(cp)]
    padded = layouts[0].padded
    assert padded % (2 * cp) == 0 and length <= padded < length + 2 * cp
    held = sorted(p for layout in layouts for p in layout.positions())
    assert held == list(range(padded))
    order = torch.cat([layout.index(torch.device("cpu")) for layout in layouts])
    assert torch.equal(order[layouts[0].natural(torch.device("cpu"))], torch.arange(padded))


@pytest.mark.parametrize("length, cp", [(64, 2), (64, 4), (4096, 8)])
def test_causal_work_balanced(length: int, cp: int) -> None:
    """Query-key pairs under a causal mask per rank: each within 5% of the mean (here: equal)."""
    work = [sum(p + 1 for p in SeqLayout.of(length, cp, r).positions()) for r in range(cp)]
    chunk = length // (2 * cp)
    assert work == [chunk * (length + 1)] * cp  # the split module's docstring
    mean = sum(work) / cp
    assert all(abs(w - mean) <= 0.05 * mean for w in work), work
    # a contiguous split would not be: the last rank does (2 cp - 1) times the first's work
    contiguous = [sum(p + 1 for p in range(r * length // cp, (r + 1) * length // cp)) for r in range(cp)]
    assert max(contiguous) > 1.5 * min(contiguous)


def test_local_positions_pads_masks_as_attend_everything() -> None:
    layout = SeqLayout.of(6, 2, 1)  # padded to 8: rank 1 holds 2 3 4 5
    x = torch.arange(6.0)[None, :, None]
    assert local_positions(x, 1, layout).flatten().tolist() == [2, 3, 4, 5]
    last = SeqLayout.of(6, 2, 0)  # rank 0 holds 0 1 6 7: 6 and 7 are padding
    assert local_positions(x, 1, last).flatten().tolist() == [0, 1, 0, 0]
    mask = torch.zeros(1, 1, 6, 6, dtype=torch.bool)
    assert local_positions(mask, 2, last)[0, 0, 2:].all()  # padded rows attend everything: no NaN in them


def test_which_inputs_carry_the_sequence() -> None:
    S = 16
    assert _sequence_dim(torch.zeros(2, S, 8), S, "position_embeddings") == 1  # rotary (B, S, D), hidden states
    assert _sequence_dim(torch.zeros(2, 1, S, S), S, "attention_mask") == 2  # 4-d mask: its rows
    assert _sequence_dim(torch.zeros(2, 1, S, 24), S, "encoder_attention_mask") == 2  # cross-attention rows
    assert _sequence_dim(torch.zeros(2, 1, 1, S), S, "attention_mask") is None  # broadcast over rows: keys only
    assert _sequence_dim(torch.zeros(1, S, dtype=torch.long), S, "position_ids") == 1
    assert _sequence_dim(torch.ones(2, S, dtype=torch.long), S, "attention_mask") is None  # a key padding mask
    assert _sequence_dim(torch.ones(2, S, dtype=torch.bool), S, "arg2") is None
    assert _sequence_dim(torch.zeros(S, 8), S, "arg1") == 0  # a rotary table without batch
    assert _sequence_dim(torch.arange(S), S, "cache_position") == 0
    assert _sequence_dim(torch.zeros(2, 8), S, "conditioning") is None
    assert _sequence_dim(torch.zeros(S, S), S, "arg3") == 0  # a (queries, keys) bias without batch: its rows


def test_planner_runs_the_blocks_on_this_ranks_positions() -> None:
    """estimate_memory(cp=) cuts a meta copy as setup does (the context_parallel step) and measures its forward: the
    block stack's activations per rank halve at cp=2 (the head, small here, stays whole); the last block's gather
    restores the whole sequence for the loss."""
    from lightning_tpp.memory.estimate import estimate_memory
    from models import TinyLlama

    with torch.device("meta"):
        model = TinyLlama(n_layers=4)
    one, two = (estimate_memory(model, tp=1, pp=1, cp=cp, batch_size=1, seq_len=512) for cp in (1, 2))
    assert two.dims.cp == 2 and "cp=2" in str(two)
    assert two.largest.activations <= 0.6 * one.largest.activations, (two.largest.activations,
                                                                        one.largest.activations)


def test_a_scan_is_refused_at_setup_by_name() -> None:
    """A Mamba-style block (a depthwise convolution over time and a scan) is refused before anything is cut, on the
    whole model (every pipeline rank alike), naming each layer and what it does."""
    from lightning_tpp.config import planning_config
    from lightning_tpp.context_parallel import ContextParallelError
    from lightning_tpp.core.mesh import MeshDims
    from lightning_tpp.steps import meta_groups, run
    from models_cp import MambaStyleLM

    with torch.device("meta"):
        model = MambaStyleLM()
    config = planning_config(1, 1, cp=2)
    with pytest.raises(ContextParallelError) as err:
        run(model, config, meta_groups(config), dims=MeshDims(1, 1, 1, cp=2), until="stages")
    message = str(err.value)
    assert "cp=2 runs each block on parts of the sequence" in message
    for i in range(2):
        assert (f"layers.{i}.conv1d (Conv1d): a convolution over the sequence and a state-space scan (a Mamba-style "
                f"mixer)") in message
    assert message.endswith("Use cp=1 for this model")


def test_a2a_names_why_an_attention_runs_as_allgather() -> None:
    """cp_mode="a2a" exchanges heads only where they divide; otherwise the call runs as "allgather", with one warning
    per reason naming it."""
    import warnings

    from lightning_tpp.context_parallel import attention

    q, k = torch.zeros(1, 6, 8, 4), torch.zeros(1, 2, 8, 4)
    assert attention._no_heads_exchange(q, k, 2) is None
    reason = attention._no_heads_exchange(q, k, 4)
    assert reason == ("an attention with 6 query heads per rank, which cp=4 does not divide (heads per tp rank must "
                      "divide by cp)")
    assert attention._no_heads_exchange(q, torch.zeros(1, 4, 8, 4), 2) == \
        "an attention with 6 query heads and 4 key/value heads"
    assert "3-d queries" in attention._no_heads_exchange(q[0], k[0], 2)
    attention._FELL_BACK.discard(reason)
    with pytest.warns(UserWarning, match=r"cp_mode='a2a': an attention with 6 query heads .* runs as "
                                         r"cp_mode='allgather' instead \(keys and values all-gathered"):
        attention._fell_back(reason)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attention._fell_back(reason)  # once per reason
