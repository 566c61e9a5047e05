"""``cp/`` metrics (context parallelism), logged through Lightning's loggers every ``log_every_n_steps``::

    cp/gathered_MB        what this rank received per training step in the forward all-gathers of keys and values
                          (activation checkpointing of each attention repeats them in backward), or in the
                          all-to-alls of cp_mode="a2a" (queries, keys, values and outputs)
    cp/attention_ms       wall time per training step in the attention calls taken over (exchange included)
    cp/attention_calls    attention calls taken over per training step
    cp/a2a_calls          (cp_mode="a2a") of them, those that exchanged positions for heads; the others ran as
                          "allgather" (attention that is not an SDPA call, heads that cp does not divide)

Per training step since the last logging step, this rank's (the cp ranks exchange alike)."""

from __future__ import annotations

from typing import Any, Optional

from lightning_tpp.context_parallel import Traffic
from lightning_tpp.pipeline.metrics import is_logging_step

PREFIX = "cp/"


class ContextMetrics:
    def __init__(self, traffic: Traffic, a2a: bool = False) -> None:
        self.traffic, self.steps, self.a2a = traffic, 0, a2a

    def after_step(self, module: Any, batch_idx: Optional[int]) -> None:
        """Called at the end of the strategy's ``training_step`` on every rank."""
        self.steps += 1
        if not is_logging_step(module.trainer, batch_idx):
            return
        steps, taken = self.steps, self.traffic.take()
        self.steps = 0
        values = {f"{PREFIX}gathered_MB": taken["bytes"] / 1e6 / steps,
                  f"{PREFIX}attention_ms": taken["attention_seconds"] * 1e3 / steps,
                  f"{PREFIX}attention_calls": taken["calls"] / steps}
        if self.a2a:
            values[f"{PREFIX}a2a_calls"] = taken["a2a_calls"] / steps
        module.log_dict(values, on_step=True, on_epoch=False, prog_bar=False, logger=True)
