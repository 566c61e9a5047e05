"""Tensor parallelism: recognise blocks (``plan``: patterns -> a plan as data, ``plan_types``; ``overrides``: user
and Hugging Face plans laid over it), swap in parallel layers (``layers``), shard and check them numerically against
the original (``apply``), run blocks on sequence shards (``sequence``, ``sequence_region``), and print what was done
(``report``)."""

from lightning_tpp.core.reference import TensorParallelMismatchError
from lightning_tpp.tensor_parallel.apply import apply_plan, verify_block
from lightning_tpp.tensor_parallel.overrides import hf_plan, overlay
from lightning_tpp.tensor_parallel.plan import check_divisible, detect
from lightning_tpp.tensor_parallel.plan_types import STYLES, TensorParallelConfigError, TPPlan
from lightning_tpp.tensor_parallel.report import PlanRows, coverage_warning, format_plan, plan_rows, whole_kinds
from lightning_tpp.tensor_parallel.sequence import SequenceParallelError

__all__ = ["PlanRows", "STYLES", "SequenceParallelError", "TPPlan", "TensorParallelConfigError",
           "TensorParallelMismatchError", "apply_plan", "check_divisible", "coverage_warning", "detect", "format_plan",
           "hf_plan", "overlay", "plan_rows", "verify_block", "whole_kinds"]
