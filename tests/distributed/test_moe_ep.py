"""Expert parallelism against one process: each rank holds experts / ep whole experts of every bank, the tokens
travel to them by all-to-all and back (dropless), with the load-balancing loss on. 3-D banks (Mixtral; gpt-oss's
transposed banks with biases; Qwen2-MoE's gated shared expert; DeepSeek-V3's shared experts, dense first layer and
group-limited routing), ep drawn from dp (FSDP2-sharded dense parameters) and from tp, inside pipeline stages, all
tokens routed to one expert (a rank that receives no token), and checkpoints across ep layouts.

Replicas differ in their batches, and a load-balancing loss is not a mean over samples: the one-process reference
computes each replica's batch as a batch of its own and accumulates (what the replicas average)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest
import torch

from launch import ROOT, run_ranks
from lightning_tpp.experts import find_experts
from models import MODELS, token_dataset
from parity import Record, assert_parity, load_record, merge_stages, train


def _launch(tmp: Path, models: list[str], *, ep: int, dp: int = 1, tp: int = 1, pp: int = 1,
            extra: tuple = ()) -> str:
    args = ["--models", ",".join(models), "--ep", str(ep), "--dp", str(dp), "--tp", str(tp), "--pp", str(pp),
            "--out", str(tmp), *extra]
    return run_ranks(ROOT / "tests" / "parity.py", dp * tp * pp, args, timeout=500).check().outputs[0]


def _reference(name: str, dp: int, clip: Optional[float] = None, optimizer: str = "sgd", steps: int = 5) -> Record:
    if dp == 1:
        return train(name, clip=clip, optimizer=optimizer, steps=steps)
    ref = train(name, dp=dp, replicas_apart=True, accumulate=dp, clip=clip, optimizer=optimizer, steps=steps)
    ref.losses = torch.tensor(ref.losses).view(-1, dp).sum(dim=1).tolist()  # each replica's loss, recorded / dp
    ref.buffers = ref.buffers[dp - 1::dp]  # as they stand after each optimizer step
    return ref


def test_ep2_over_dp2_with_fsdp2(tmp_path: Path) -> None:
    """ep drawn from dp, the dense parameters FSDP2-sharded over dp and the experts out of it, gradients clipped by
    the global norm (each expert counted once). With every token routed to the last expert, the first rank receives
    no token at all and still joins every exchange."""
    models = ["hf_mixtral_labels", "hf_deepseek_v3_labels", "hf_gpt_oss_one_expert"]
    _launch(tmp_path, models, ep=2, dp=2, extra=("--clip", "0.05"))
    for name in models:
        ref = _reference(name, dp=2, clip=0.05)
        for rank in range(2):
            assert_parity(load_record(tmp_path / f"{name}.rank{rank}.pt"), ref, where=f"{name} ep=2 dp=2 rank {rank}")
    # the premise: every token goes to expert 3 (held by the second rank), none to the first rank's experts 0 and 1
    model, chosen = MODELS["hf_gpt_oss_one_expert"](), []
    for layer in find_experts(model):
        model.get_submodule(layer.experts).register_forward_pre_hook(lambda m, args: chosen.append(args[1]))
    model(token_dataset()[0:8][0])
    assert len(chosen) == 2 and all(bool((c == 3).all()) for c in chosen), chosen


@pytest.mark.parametrize("dp, tp", [(4, 1), (1, 4)], ids=["over-dp4", "over-tp4"])
def test_experts_sharded_over_their_replicas(tmp_path: Path, dp: int, tp: int) -> None:
    """Expert data parallelism: ep2 over dp4 (or over tp4 with dp = 1: the replicas are tp ranks, the dense parameters
    left as tensor parallelism cut them), so each expert has 2 replicas, over which FSDP2 shards its parameters,
    gradients and momentum (each rank holds 1/4 of every bank's elements, not 1/2). Gradients are summed over the
    replicas and divided by dp; clipping uses the global norm, counting each part once. Mixtral keeps two experts of
    four per rank (Shard(0): one expert per replica); with two experts it keeps one, cut along its next dimension
    (Shard(1)). gpt-oss routes every token to one expert: a rank receives none and still joins every exchange."""
    models = ["hf_mixtral_labels", "hf_mixtral_two_experts", "hf_gpt_oss_one_expert"]
    # 4 steps: one epoch of the 64 samples over 4 replicas of 4 (the next one reshuffles per replica)
    _launch(tmp_path, models, ep=2, dp=dp, tp=tp, extra=("--clip", "0.05", "--optimizer", "sgdm", "--steps", "4"))
    for name in models:
        ref = _reference(name, dp=dp, clip=0.05, optimizer="sgdm", steps=4)
        for rank in range(4):
            record = load_record(tmp_path / f"{name}.rank{rank}.pt")
            assert_parity(record, ref, where=f"{name} ep=2 dp={dp} tp={tp} rank {rank}")
            # experts / (ep x replicas), within 5% (FSDP2 pads an uneven split)
            assert record.expert_fraction == pytest.approx(1 / 4, rel=0.05), (name, rank, record.expert_fraction)
            assert record.expert_state_fraction == pytest.approx(1 / 4, rel=0.05), (name, rank)


def test_ep2_over_tp2(tmp_path: Path) -> None:
    """ep drawn from tp: each tp rank sends its slice of the (replicated) tokens; at most 0.65 of the parameters on a
    rank. A list of expert modules (called one by one by the model's loop) is cut over tp instead, with a warning."""
    models = ["hf_mixtral_labels", "hf_qwen2_moe_labels", "list_moe"]
    output = _launch(tmp_path, models, ep=2, tp=2)
    assert ("ep=2 splits experts held as 3-D banks; the experts of model.blocks.0.moe, model.blocks.1.moe are "
            "lists") in output
    for name in models:
        ref = _reference(name, dp=1)
        for rank in range(2):
            record = load_record(tmp_path / f"{name}.rank{rank}.pt")
            assert_parity(record, ref, where=f"{name} ep=2 tp=2 rank {rank}")
            assert record.local_fraction <= 0.65, (name, record.local_fraction)


def test_ep2_over_tp2_sequence_parallel(tmp_path: Path) -> None:
    """ep drawn from tp under sequence parallelism: the tp ranks hold different tokens (their sequence shards), so
    each sends all of its own (no slice of replicated tokens, no sum over tp after). Mixtral, and DeepSeek-V3 with its
    MLA attention cut by heads, at parity with one process."""
    models = ["hf_mixtral_labels", "hf_deepseek_v3_labels"]
    _launch(tmp_path, models, ep=2, tp=2, extra=("--sequence-parallel",))
    for name in models:
        ref = _reference(name, dp=1)
        for rank in range(2):
            assert_parity(load_record(tmp_path / f"{name}.rank{rank}.pt"), ref, where=f"{name} ep=2 tp=2 sp rank {rank}")


@pytest.mark.parametrize("ep, models, extra", [
    (2, ["hf_mixtral_labels", "hf_qwen2_moe_labels"], ("--activation-checkpointing",)),
    (4, ["hf_mixtral_labels", "hf_deepseek_v3_labels"], ())], ids=["ep2-recomputed", "ep4"])
def test_ep_over_tp2_dp2_sequence_parallel(tmp_path: Path, ep: int, models: list[str], extra: tuple) -> None:
    """Megatron's layout, ep with tp, sequence parallelism and dp, each block checked whole on its first call. ep=2:
    the tp pairs, each bank sharded over its 2 replicas by FSDP2, a unit inside the block's unit: the check's own
    backward went through the bank's FSDP2 hooks, whose end-of-backward callback resharded the enclosing block in
    the middle of its forward ("setStorage ... storage of size 0"). ep=4: the group spans both replicas, so each
    expert's gradient sums the other replica's rows, which the check's original (this replica's inputs) never sees:
    it refused the block (0.127 off). Qwen2-MoE: its tensor-parallel shared expert takes the tokens flattened."""
    _launch(tmp_path, models, ep=ep, dp=2, tp=2, extra=("--sequence-parallel", *extra))
    for name in models:
        ref = _reference(name, dp=2)
        for rank in range(4):
            assert_parity(load_record(tmp_path / f"{name}.rank{rank}.pt"), ref, where=f"{name} ep={ep} sp rank {rank}")


def test_ep2_pp2(tmp_path: Path) -> None:
    """MoE blocks in pipeline stages, each stage's ep group its dp ranks (one micro-batch: the loss is a function of
    the batch it sees)."""
    models = ["hf_mixtral_labels", "hf_gpt_oss_labels"]
    _launch(tmp_path, models, ep=2, dp=2, pp=2, extra=("--schedule", "gpipe", "--microbatches", "1"))
    for name in models:
        ref = _reference(name, dp=2)
        for d in range(2):
            ranks = [d * 2 + s for s in range(2)]
            got = merge_stages([load_record(tmp_path / f"{name}.rank{r}.pt") for r in ranks])
            assert_parity(got, ref, where=f"{name} ep=2 dp=2 pp=2 ranks {ranks}")


def test_ep2_tp2_pp2_zero_bubble_recomputed(tmp_path: Path) -> None:
    """The exchange inside a zero-bubble schedule (backward split into input and weight gradients) with activation
    checkpointing (the exchange runs again in the recomputation): 2 micro-batches equal one process accumulating over
    the same halves of each batch."""
    name = "hf_mixtral_labels"
    _launch(tmp_path, [name], ep=2, tp=2, pp=2,
            extra=("--schedule", "zero-bubble", "--microbatches", "2", "--activation-checkpointing"))
    ref = train(name, batch_size=2, accumulate=2)
    ref.losses = torch.tensor(ref.losses).view(-1, 2).sum(dim=1).tolist()  # each half's loss, recorded / 2
    ref.buffers = ref.buffers[1::2]
    for t in range(2):
        ranks = [s * 2 + t for s in range(2)]
        got = merge_stages([load_record(tmp_path / f"{name}.rank{r}.pt") for r in ranks])
        assert_parity(got, ref, where=f"ep=2 tp=2 pp=2 zero-bubble ranks {ranks}")


@pytest.mark.parametrize("ep", [2, 4])
def test_ep_over_tp2_dp2(tmp_path: Path, ep: int) -> None:
    """ep=4: one ep group of all four ranks (two replicas' tp pairs); ep=2: the tp pairs, each expert held by two
    ranks of different replicas whose gradients are summed. The dense parameters cut over tp and FSDP2-sharded over
    dp."""
    _launch(tmp_path, ["hf_qwen2_moe_labels"], ep=ep, dp=2, tp=2)
    ref = _reference("hf_qwen2_moe_labels", dp=2)
    for rank in range(4):
        assert_parity(load_record(tmp_path / f"hf_qwen2_moe_labels.rank{rank}.pt"), ref,
                      where=f"ep={ep} rank {rank}")


@pytest.mark.parametrize("sharded", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["dcp", "whole"])
def test_ep_checkpoints_resume_in_other_layouts(tmp_path: Path, sharded: bool) -> None:
    """Saved at ep=2 over dp=2 (DCP shards, or one whole file), resumed in one process (DCP consolidated) and at
    tp=2: the steps after the resume equal an uninterrupted run's, momentum included; the file holds the model's own
    3-D banks."""
    from worker_resume import run

    name, ckpt = "hf_mixtral_labels", tmp_path / "run.ckpt"
    reference = []
    for phase in ("first", "second"):
        run(tmp_path, phase, 0, 0, tmp_path / "plain.ckpt", model=name)
        reference.append(load_record(tmp_path / f"{phase}.rank0.pt"))
    run_ranks(ROOT / "tests" / "distributed" / "worker_resume.py", 2,
              [str(tmp_path), "first", "1", "1", str(ckpt), "sharded" if sharded else "whole", "sgdm", "2", name, "2"],
              timeout=300).check()
    assert_parity(load_record(tmp_path / "first.rank0.pt"), reference[0], where="ep=2 first phase")
    single = ckpt
    if sharded:  # DCP shards: one file by ``lightning-tpp consolidate`` for plain Lightning
        from lightning_tpp import consolidate

        single = tmp_path / "single.ckpt"
        consolidate(ckpt, single)
    state = torch.load(single, map_location="cpu", weights_only=True)["state_dict"]
    assert tuple(state["model.model.model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 128, 32)
    run(tmp_path, "second", 0, 0, single, model=name)
    assert_parity(load_record(tmp_path / "second.rank0.pt"), reference[1], rtol=1e-5, atol=1e-5,
                  where="ep=2 -> one process")
    run_ranks(ROOT / "tests" / "distributed" / "worker_resume.py", 2,
              [str(tmp_path), "second", "2", "1", str(ckpt), "sharded" if sharded else "whole", "sgdm", "1", name],
              timeout=300).check()
    assert_parity(load_record(tmp_path / "second.rank0.pt"), reference[1], rtol=1e-5, atol=1e-5,
                  where="ep=2 -> tp=2")


@pytest.mark.parametrize("sharded, tp", [(True, 1), pytest.param(False, 1, marks=pytest.mark.slow),
                                         pytest.param(True, 4, marks=pytest.mark.slow)],
                         ids=["dcp", "whole", "dcp-over-tp4"])
def test_experts_sharded_over_replicas_resume_in_other_layouts(tmp_path: Path, sharded: bool, tp: int) -> None:
    """Saved at ep=2 over dp=4 (each expert's parameters and momentum sharded over its 2 replicas) as DCP shards,
    resumed in one process (consolidated) and in the same layout (each rank reading its part of its experts); the
    same over tp=4 with dp=1 (the replicas tp ranks; slow); saved as one file (slow), resumed in one process, at tp=2
    and at ep=4 over dp=4 (one replica). The steps after the resume equal an uninterrupted run's, momentum included;
    the file holds the model's own 3-D banks."""
    from worker_resume import run

    script = ROOT / "tests" / "distributed" / "worker_resume.py"
    name, ckpt = "hf_mixtral_labels", tmp_path / "run.ckpt"
    reference = []
    for phase in ("first", "second"):
        run(tmp_path, phase, 0, 0, tmp_path / "plain.ckpt", model=name)
        reference.append(load_record(tmp_path / f"{phase}.rank0.pt"))
    mode, layout = "sharded" if sharded else "whole", [str(tp), "1"]  # (tp, pp); dp the rest of 4
    run_ranks(script, 4, [str(tmp_path), "first", *layout, str(ckpt), mode, "sgdm", str(4 // tp), name, "2"],
              timeout=300).check()
    assert_parity(load_record(tmp_path / "first.rank0.pt"), reference[0], where=f"ep=2 tp={tp} first phase")
    single = ckpt
    if sharded:
        from lightning_tpp import consolidate

        single = tmp_path / "single.ckpt"
        consolidate(ckpt, single)
    state = torch.load(single, map_location="cpu", weights_only=True)
    assert tuple(state["state_dict"]["model.model.model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 128, 32)
    run(tmp_path, "second", 0, 0, single, model=name)
    assert_parity(load_record(tmp_path / "second.rank0.pt"), reference[1], rtol=1e-5, atol=1e-5,
                  where="ep=2 x 2 replicas -> one process")
    if sharded:
        run_ranks(script, 4, [str(tmp_path), "second", *layout, str(ckpt), mode, "sgdm", str(4 // tp), name, "2"],
                  timeout=300).check()
        for rank in range(4):
            assert_parity(load_record(tmp_path / f"second.rank{rank}.pt"), reference[1], rtol=1e-5, atol=1e-5,
                          where=f"ep=2 x 2 replicas -> the same, rank {rank}")
        return
    run_ranks(script, 2, [str(tmp_path), "second", "2", "1", str(ckpt), mode, "sgdm", "1", name], timeout=300).check()
    assert_parity(load_record(tmp_path / "second.rank0.pt"), reference[1], rtol=1e-5, atol=1e-5,
                  where="ep=2 x 2 replicas -> tp=2")
    run_ranks(script, 4, [str(tmp_path), "second", "1", "1", str(ckpt), mode, "sgdm", "4", name, "4"],
              timeout=300).check()
    assert_parity(load_record(tmp_path / "second.rank0.pt"), reference[1], rtol=1e-5, atol=1e-5,
                  where="ep=2 x 2 replicas -> ep=4")


def test_one_process_checkpoint_resumes_at_ep2(tmp_path: Path) -> None:
    """And back: a one-process checkpoint resumed with the experts split over ep=2 (dp=2)."""
    from worker_resume import run

    name, ckpt = "hf_mixtral_labels", tmp_path / "plain.ckpt"
    reference = []
    for phase in ("first", "second"):
        run(tmp_path, phase, 0, 0, ckpt, model=name)
        reference.append(load_record(tmp_path / f"{phase}.rank0.pt"))
    run_ranks(ROOT / "tests" / "distributed" / "worker_resume.py", 2,
              [str(tmp_path), "second", "1", "1", str(ckpt), "whole", "sgdm", "2", name, "2"], timeout=300).check()
    for rank in range(2):
        assert_parity(load_record(tmp_path / f"second.rank{rank}.pt"), reference[1], rtol=1e-5, atol=1e-5,
                      where=f"one process -> ep=2 rank {rank}")


@pytest.mark.parametrize("name, dp", [("hf_mixtral_labels", 2), ("hf_mixtral_labels", 4),
                                      ("hf_mixtral_two_experts", 4), ("hf_gpt_oss_one_expert", 4),
                                      ("hf_granitemoe_labels", 4)],
                         ids=["ep2-dp2", "ep2-dp4-shard0", "ep2-dp4-shard1", "ep2-dp4-gpt-oss", "ep2-dp4-granitemoe"])
def test_hf_safetensors_into_ep2(tmp_path: Path, name: str, dp: int) -> None:
    """``weights=`` an HF MoE safetensors file, the model built on meta at ep=2 over dp: each rank's experts come
    from the file (weights unlike the module's own initialisation) and train as one process loaded by
    ``from_pretrained``. Over dp=4 each expert has two replicas: FSDP2 cuts the banks while they are still on the
    meta device (along the experts, or along the next dim where a rank keeps one expert) and each rank reads only
    its quarter of every bank (the dense weights first, the experts after). gpt-oss: transposed banks with biases,
    held as banks in its files too; GraniteMoE: banks held in its files under other names (transformers' renames)."""
    torch.manual_seed(123)  # not the seed the runs build their modules with
    MODELS[name]().model.save_pretrained(tmp_path / "hf")
    run_ranks(ROOT / "tests" / "distributed" / "worker_moe_weights.py", dp,
              [str(tmp_path), str(tmp_path / "hf" / "model.safetensors"), str(dp), name], timeout=300).check()

    def from_pretrained(module) -> None:
        module.model.model = type(module.model.model).from_pretrained(tmp_path / "hf", attn_implementation="eager")

    ref = train(name, dp=dp, replicas_apart=True, accumulate=dp, steps=2, prepare=from_pretrained)
    ref.losses = torch.tensor(ref.losses).view(-1, dp).sum(dim=1).tolist()
    ref.buffers = ref.buffers[dp - 1::dp]
    for rank in range(dp):
        saved = torch.load(tmp_path / f"weights.rank{rank}.pt", weights_only=True)
        reads, held, whole, most = saved.pop("reads"), saved.pop("held"), saved.pop("whole"), saved.pop("most")
        assert_parity(Record(**saved), ref, where=f"{name} weights= at ep=2 dp={dp} rank {rank}")
        assert held == whole // dp, (rank, held, whole)  # experts / (ep x replicas)
        assert most == held, (rank, most, held)  # never more of them at any point of setup
        if dp == 2:
            assert len(reads) == 1, reads
        else:  # the banks read after FSDP2 cut them: exactly the bytes held, nothing of the other replica's part
            assert len(reads) == 2 and reads[1][1] == held, (reads, held)


@pytest.mark.parametrize("name", ["hf_mixtral_labels", "hf_gpt_oss_one_expert"], ids=["shard0", "shard1-gpt-oss"])
def test_meta_built_experts_initialised_in_their_shards(tmp_path: Path, name: str) -> None:
    """Built on meta without ``weights=`` at ep=2 over dp=4 (2 replicas): the banks stay on the meta device until
    FSDP2 has cut them, then each rank initialises each bank at full size one at a time (as one process does, the
    same seed) and keeps its part. No rank holds more of its experts than that part after any setup step (it held
    its ``experts / ep`` of every layer at once before FSDP2), and the run trains as one process built on meta."""
    import torch.distributed as dist

    from lightning_tpp import TensorPipeStrategy

    run_ranks(ROOT / "tests" / "distributed" / "worker_moe_weights.py", 4, [str(tmp_path), "-", "4", name],
              timeout=300).check()
    try:
        ref = train(name, strategy=TensorPipeStrategy(print_plan=False), meta=True, dp=4, replicas_apart=True,
                    accumulate=4, steps=2)
    finally:
        if dist.is_initialized():  # the one-rank group Lightning left
            dist.destroy_process_group()
    ref.losses = torch.tensor(ref.losses).view(-1, 4).sum(dim=1).tolist()
    ref.buffers = ref.buffers[3::4]
    for rank in range(4):
        saved = torch.load(tmp_path / f"weights.rank{rank}.pt", weights_only=True)
        reads, held, whole, most = saved.pop("reads"), saved.pop("held"), saved.pop("whole"), saved.pop("most")
        assert_parity(Record(**saved), ref, where=f"{name} built on meta at ep=2 dp=4 rank {rank}")
        assert reads == [] and held == whole // 4, (rank, reads, held, whole)
        assert most == held, (rank, most, held)


def test_traced_exchange_equals_eager_and_counts_its_bytes(tmp_path: Path) -> None:
    """The expert exchange compiled (``compile=`` traces it with functional collectives, its split sizes unbacked
    symbols) against the eager one, at ep=2 on three calls whose row counts differ between ranks and calls, each
    with gradients and then without (validation): the same outputs and gradients (inputs and experts), no graph
    break, and the same bytes counted as sent (the traced exchange adds them on the device). Without gradients the
    exchange was kept eager (a graph break) until the tie of the experts' output to their parameters was left out
    there: traced, dynamo ran it on its arguments shifted by one and returned a parameter."""
    import json

    run_ranks(ROOT / "tests" / "distributed" / "worker_traced_exchange.py", 2, [str(tmp_path)], timeout=300).check()
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["agree"] == [True] * 6 and got["breaks"] == 0 and got["graphs"] >= 1, got
        assert all(eager == traced > 0 for eager, traced in got["sent"]), got
