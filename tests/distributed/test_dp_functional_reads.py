"""FSDP2 units that hold wherever a parameter is read (issue #44 item 3), dp=2 at parity with one process (losses,
per-parameter gradients, updated parameters; rtol 1e-5).

The models (``tests/models.py``, ``JambaLM``): a Mamba mixer reading its convolution's and output projection's
weights with ``F.conv1d``/``F.linear`` without calling those modules, ``nn.MultiheadAttention`` reading its
``out_proj``'s weight, and a model reading its head's weight with ``F.linear`` (an FSDP2 unit without a block
sequence; a vocabulary matrix computed over dp where it is called, with one), the head also called elsewhere
(``_aux``). Before, each such read met a still-sharded DTensor: ``aten.convolution.default: got mixed torch.Tensor
and DTensor``.

The reads are found at setup by one forward of a meta copy (``data_parallel.reads.find_reads``); a forward the copy
cannot run (``_opaque``: it looks at a token id's value) has them found in the first step
(``data_parallel.reads.ReadGuard``), where a read no unit can gather is an error that says what to do, never
DTensor's."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from launch import ROOT, run_ranks
from parity import Record, assert_parity, load_record, train

# found at setup; the last one found in the first step
MODELS = ["functional_reads", "functional_reads_blocks", "functional_reads_aux", "functional_reads_opaque"]


@functools.lru_cache(maxsize=None)
def reference(name: str) -> Record:
    return train(name, dp=2, steps=3)


def _run(tmp: Path, models: list[str], sharding: str) -> list[str]:
    args = ["--models", ",".join(models), "--dp", "2", "--out", str(tmp), "--steps", "3", "--dp-sharding", sharding]
    return run_ranks(ROOT / "tests" / "parity.py", 2, args, timeout=240).check().outputs


@pytest.mark.parametrize("sharding", ["full_shard", "shard_grad_op"])
def test_dp2_parent_reads_child_weight(tmp_path: Path, sharding: str) -> None:
    outputs = _run(tmp_path, MODELS, sharding)
    for name in MODELS:
        ref = reference(name)
        for rank in range(2):
            assert_parity(load_record(tmp_path / f"{name}.rank{rank}.pt"), ref,
                          where=f"{name} dp=2 {sharding} rank {rank}")
    # only the model the meta copy could not run is gathered where read in its first step, and says so
    said = [line for line in outputs[0].splitlines() if line.startswith("lightning_tpp: ") and " reads " in line]
    assert sorted(line.split(" reads ")[1].split(" ")[0] for line in said) == [
        "model.attention.attn.out_proj.weight", "model.lm_head.weight", "model.mamba.mixer.conv1d.weight",
        "model.mamba.mixer.out_proj.weight"], said


def test_dp2_read_no_unit_can_gather_is_a_clear_error(tmp_path: Path) -> None:
    """The head is called and also read outside its forward, in a forward the meta copy cannot run: no unit found at
    setup encloses both, and gathering the head where it is read would reduce its gradients before the read's
    came. An error naming the parameter, its reader and the fix, on every rank; not DTensor's."""
    args = ["--models", "functional_reads_aux_opaque", "--dp", "2", "--out", str(tmp_path), "--steps", "1"]
    result = run_ranks(ROOT / "tests" / "parity.py", 2, args, timeout=120)
    assert not result.timed_out and all(result.returncodes), result.outputs
    for out in result.outputs:
        assert "ShardedReadError: model.lm_head.weight is read by model's forward (linear), outside the forward " \
               "of model.lm_head, its FSDP2 unit, which the step also calls" in out, out[-3000:]
        assert "example_input_array" in out and "mixed torch.Tensor and DTensor" not in out


def test_dp2_hf_jamba(tmp_path: Path) -> None:
    """The family the issue found it in: Hugging Face's Jamba (Mamba mixers reading their conv's weight with
    F.conv1d, attention, MoE every other layer) under FSDP2 at dp=2 (before: aten.convolution.default: got mixed
    torch.Tensor and DTensor)."""
    _run(tmp_path, ["hf_jamba"], "full_shard")
    ref = train("hf_jamba", dp=2, steps=3)
    for rank in range(2):
        assert_parity(load_record(tmp_path / f"hf_jamba.rank{rank}.pt"), ref, where=f"hf_jamba dp=2 rank {rank}")
