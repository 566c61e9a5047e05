"""``cp/`` metrics (context parallelism), logged through Lightning's loggers every ``log_every_n_steps``::

    cp/gathered_MB        what this rank received per training step in the forward all-gathers of keys and values
                          (activation checkpointing of each attention repeats them in backward)
    cp/attention_ms       wall time per training step in the attention calls taken over (exchange included)
    cp/attention_calls    attention calls taken over per training step

Per training step since the last logging step, this rank's (the cp ranks exchange alike)."""

from __future__ import annotations

from typing import Any, Optional

from lightning_tpp.context_parallel import Traffic
from lightning_tpp.pipeline.metrics import is_logging_step

PREFIX = "cp/"


class ContextMetrics:
    def __init__(self, traffic: Traffic) -> None:
        self.traffic, self.steps = traffic, 0

    def after_step(self, module: Any, batch_idx: Optional[int]) -> None:
        """Called at the end of the strategy's ``training_step`` on every rank."""
        self.steps += 1
        if not is_logging_step(module.trainer, batch_idx):
            return
        steps, taken = self.steps, self.traffic.take()
        self.steps = 0
        module.log_dict({f"{PREFIX}gathered_MB": taken["bytes"] / 1e6 / steps,
                         f"{PREFIX}attention_ms": taken["attention_seconds"] * 1e3 / steps,
                         f"{PREFIX}attention_calls": taken["calls"] / steps},
                        on_step=True, on_epoch=False, prog_bar=False, logger=True)
