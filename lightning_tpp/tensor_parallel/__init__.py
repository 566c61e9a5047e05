"""Tensor parallelism: recognise blocks (``plan``: patterns -> a plan as data), swap in parallel layers
(``layers``), shard and check them numerically against the original (``apply``), and print what was done
(``report``)."""

from lightning_tpp.tensor_parallel.apply import TensorParallelMismatchError, apply_plan, verify_block
from lightning_tpp.tensor_parallel.plan import (
    STYLES,
    TensorParallelConfigError,
    TPPlan,
    check_divisible,
    detect,
    hf_plan,
    overlay,
)
from lightning_tpp.tensor_parallel.report import PlanRows, coverage_warning, format_plan, plan_rows, whole_kinds
from lightning_tpp.tensor_parallel.sequence import SequenceParallelError

__all__ = ["PlanRows", "STYLES", "SequenceParallelError", "TPPlan", "TensorParallelConfigError", "TensorParallelMismatchError",
           "apply_plan", "check_divisible", "coverage_warning", "detect", "format_plan", "hf_plan", "overlay",
           "plan_rows", "verify_block", "whole_kinds"]
