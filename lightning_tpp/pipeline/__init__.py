"""Pipeline parallelism: cut the block sequence into stages (``partition``), keep this rank's units and trace which
values cross stages (``stage``, ``build``), order micro-batches (``schedule``, a registry; ``schedule_input`` for the
user's own lists and torch's classes; ``wgrad`` for split backwards) and run them (``engine``, a facade over
``executor``, ``transport`` and ``parking``; ``logging`` carries ``self.log`` across stages)."""

from lightning_tpp.pipeline.build import PreparedStages, finish_stages, format_partition, measure_block_costs, \
    prepare_stages
from lightning_tpp.pipeline.engine import PipelineEngine, PipelineError
from lightning_tpp.pipeline.partition import Partition, PipelinePartitionError, plan_partition
from lightning_tpp.pipeline.schedule import SCHEDULES, Schedule, ScheduleConfigError, actions, register_schedule, \
    simulate, theoretical_bubble
from lightning_tpp.pipeline.stage import PipelineTraceError

__all__ = ["SCHEDULES", "Partition", "PipelineEngine", "PipelineError", "PipelinePartitionError",
           "PipelineTraceError", "PreparedStages", "Schedule", "ScheduleConfigError", "actions", "finish_stages",
           "format_partition", "measure_block_costs", "plan_partition", "prepare_stages", "register_schedule",
           "simulate", "theoretical_bubble"]
