"""Bad input: the same clear error on every rank, non-zero exit, within a bounded time (no hang)."""

from __future__ import annotations

import pytest

from launch import ROOT, run_ranks

SCRIPT = ROOT / "tests" / "distributed" / "worker_errors.py"


@pytest.mark.parametrize(("scenario", "devices", "tp", "message"), [
    ("heads", 2, 2, r"TensorParallelConfigError: tp=2 must divide num_heads=3 of model\.layers\.0\.attention "
                    r"\(heads=3, kv_heads=3\); choose tp in \[1, 3\]"),
    ("mismatch", 2, 2, r"TensorParallelMismatchError: tensor-parallel mlp block 'model\.transformer\.h\.0\.mlp' "
                       r"\(TPBlock\[CenteredMLP\]\) does not match the original model"),
    ("world", 3, 2, r"ValueError: world size 3 is not divisible by tp\*pp = 2\*1 = 2; with 3 processes choose "
                    r"\(tp, pp\) from \[\(1, 1\), \(1, 3\), \(3, 1\)\]"),
], ids=["heads", "mismatch", "world"])
def test_error_on_every_rank(scenario: str, devices: int, tp: int, message: str) -> None:
    import re

    result = run_ranks(SCRIPT, devices, [scenario, str(devices), str(tp)], timeout=120)
    assert not result.timed_out, f"{scenario}: hung for {result.elapsed:.0f}s"
    assert all(code != 0 for code in result.returncodes), result.returncodes
    for rank, out in enumerate(result.outputs):
        assert re.search(message, out), f"rank {rank} did not print the expected error:\n{out[-3000:]}"
