"""The compiled check on a GPU (one process, no collective): a block compiled with inductor against its eager call,
forward and backward, in bf16-mixed and in float32 with TF32 products, finds no difference (inductor's kernels round
otherwise than eager's: compared at low precision's tolerance), and a halved backward is still found. Skipped
without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the CPU test's block

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("mode", ["bf16-mixed", "tf32"])
def test_compiled_check_on_gpu(mode: str) -> None:
    from test_compile_check import Block, _HalvedBackward, _none

    from lightning_tpp.integration.compile_metrics import _compare

    torch.manual_seed(0)
    block = Block().cuda().train()
    x = torch.randn(8, 64, 8, device="cuda", requires_grad=True)
    graph = torch.compile(block._call_impl)  # inductor
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if mode == "tf32" else "highest")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "bf16-mixed"):
            assert _compare(block, block._call_impl, graph, (x,), {}, _none) is None
            problem = _compare(block, block._call_impl, lambda *a: _HalvedBackward.apply(graph(*a)), (x,), {}, _none)
    finally:
        torch.set_float32_matmul_precision(before)
    assert problem is not None and "gradient" in problem, problem
