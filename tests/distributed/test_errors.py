"""Bad input: the same clear error on every rank, non-zero exit, within a bounded time (no hang)."""

from __future__ import annotations

import pytest

from launch import ROOT, run_ranks

SCRIPT = ROOT / "tests" / "distributed" / "worker_errors.py"


@pytest.mark.parametrize(("scenario", "devices", "message"), [
    ("heads", 2, r"TensorParallelConfigError: tp=2 must divide num_heads=3 of model\.layers\.0\.attention "
                 r"\(heads=3, kv_heads=3\); choose tp in \[1, 3\]"),
    ("mismatch", 2, r"TensorParallelMismatchError: tensor-parallel mlp block 'model\.transformer\.h\.0\.mlp' "
                    r"\(TPBlock\[ShuffledMLP\]\) does not match the original model"),
    ("backward", 2, r"TensorParallelMismatchError: tensor-parallel mlp block 'model\.transformer\.h\.0\.mlp' "
                    r"\(TPBlock\[HookedMLP\]\) computes the right outputs but not the original model's gradients on "
                    r"this rank: gradient of input 0: max abs difference"),
    ("embedding", 2, r"TensorParallelMismatchError: tensor-parallel layer 'model\.tok_embeddings' "
                     r"\(MeanShiftedEmbedding\) does not match the original model"),
    ("sp_positions", 2, r"SequenceParallelError: sequence parallelism: block 'model\.transformer\.h\.0' "
                        r"\(SequenceElement\[PositionalBias\]\) does not compute on sequence shards what it "
                        r"computes on the whole sequence: (output: max abs difference|another tp rank differs)"),
    ("sp_bypassed", 2, r"SequenceParallelError: sequence parallelism: block 'model\.blocks\.0' was never called with "
                       r"the residual stream, yet its parameters have gradients"),
    ("sp_odd_length", 2, r"ValueError: sequence parallelism cuts dim 1 \(the sequence\) of the blocks' input, "
                         r"\(batch, sequence, features\), into tp=2 parts, but its shape is \(4, 17, 32\)"),
    ("world", 3, r"ValueError: world size 3 is not divisible by tp\*pp = 2\*1 = 2; with 3 processes choose "
                 r"\(tp, pp\) from \[\(1, 1\), \(1, 3\), \(3, 1\)\]"),
    ("pp_stages", 2, r"PipelinePartitionError: pp=4 stages \(x virtual stages\) but 'model\.transformer\.h' has "
                     r"only 2 blocks; use at most 2 stages"),
    ("pp_encdec", 2, r"PipelineTraceError: unit 'model\.encoder\.layers\.0' on pipeline stage 0 uses the output of "
                     r"'embed', which is registered after the blocks and so lives on stage 1, but the forward calls "
                     r"it before them: assign it in __init__ before the blocks"),
    ("pp_manual", 2, r"ValueError: pipeline parallelism \(pp>1\) runs forward and backward inside the schedule "
                     r"and needs automatic optimization"),
    ("pp_fp16", 2, r"ValueError: pipeline parallelism \(pp>1\) does not support a loss-scaling GradScaler "
                   r"\(precision='16-mixed'\).*Use precision='bf16-mixed'"),
    ("pp_trace", 2, r"PipelineError: training_step could not be traced to find which values cross pipeline stages: "
                    r"it runs once with zeros in place of every layer's output, and raised RuntimeError: .*"
                    r"cannot be pipelined automatically\. The model was cut along 'model\.transformer\.h' into 2 "
                    r"stages; if the step runs in one process, name the layers to cut with blocks="),
    ("pp_tied_cut", 4, r"TensorParallelConfigError: model\.transformer\.wte\.weight = model\.lm_head\.weight is "
                       r"shared by pipeline stages \[0, 1\], but tensor parallelism cut it differently on them "
                       r"\(shapes \[\(32, 32\), \(64, 32\)\]\)"),
    ("cp_eager", 2, r"ContextParallelError: context parallelism: block 'model\.transformer\.h\.0' \(.*\[Block\]\) does "
                    r"not compute on this rank's 8 of 16 positions what it computes on the whole sequence .*its "
                    r"attention \(matmul -> softmax -> matmul\) was given every position's keys and values, but a "
                    r"mask or bias it builds from its input's length \(a causal buffer cut to \[:T, :T\]\)"),
    ("cp_block_aux", 2, r"ContextParallelError: context parallelism: block 'model\.blocks\.0' \(.*\[AuxMoEBlock\]\) "
                        r"does not compute on this rank's 8 of 16 positions what it computes on the whole sequence "
                        r"\(the tensor 1 of its output \(shape \(\)\): max abs difference .*\): besides its output "
                        r"stream it returns a value computed over all of its positions \(a router's load-balancing "
                        r"loss"),
    ("compile_zero_bubble", 2, r"ValueError: compile=\{'backend': 'aot_eager'\} with schedule='zero-bubble': this "
                               r"schedule splits each backward into input and weight gradients, which a compiled "
                               r"block's backward cannot do; use schedule='1f1b', 'interleaved-1f1b', 'gpipe' or "
                               r"'auto', or compile=False"),
    ("compile_wrong", 2, r"CompiledMismatchError: compile=: a compiled block does not compute what its eager forward "
                         r"computes on the same inputs \('model\.model\.model\.layers\.0' \(\w+\): output"),
    ("compile_wrong_pp", 2, r"CompiledMismatchError: compile=: a compiled block does not compute what its eager "
                            r"forward computes on the same inputs \('model\.model\.model\.layers\.[01]' "
                            r"\(PipelineDispatch\[LlamaDecoderLayer\]\): output"),
], ids=["heads", "mismatch", "backward", "embedding", "sp_positions", "sp_bypassed", "sp_odd_length", "world",
        "pp_stages", "pp_encdec", "pp_manual", "pp_fp16", "pp_trace", "pp_tied_cut", "cp_eager", "cp_block_aux",
        "compile_zero_bubble", "compile_wrong", "compile_wrong_pp"])
def test_error_on_every_rank(scenario: str, devices: int, message: str) -> None:
    import re

    result = run_ranks(SCRIPT, devices, [scenario, str(devices)], timeout=120)
    assert not result.timed_out, f"{scenario}: hung for {result.elapsed:.0f}s"
    assert all(code != 0 for code in result.returncodes), result.returncodes
    for rank, out in enumerate(result.outputs):
        assert re.search(message, out), f"rank {rank} did not print the expected error:\n{out[-3000:]}"
