"""The incident record: one JSON line per incident in ``incidents.jsonl`` beside the run's logs, and the same
numbers under ``incidents/`` through the Trainer's loggers. Global rank 0 writes both (every rank reached the same
decision, so every rank holds the same record); the other ranks keep theirs in memory (``IncidentLog.incidents``).

A line::

    {"step": 412, "kind": "spike", "action": "rollback", "ranks": [3],
     "values": {"loss": 9.7, "loss_mean": 2.31, "loss_z": 41.0, "loss_ratio": 4.2, "grad_norm": 180.0, ...},
     "detail": "rolled back to step 400; batches 400..412 skipped", "time": "2026-12-03T05:01:02Z"}
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

KINDS = ("spike", "nonfinite")
ACTIONS = ("skip", "rollback", "raise", "warn", "stop")


@dataclass(frozen=True)
class Incident:
    step: int  # trainer.global_step when it happened (optimizer steps completed before it)
    kind: str  # one of KINDS
    action: str  # one of ACTIONS
    values: dict[str, float]  # what triggered it, and the window it was compared with
    ranks: list[int]  # global ranks whose own values were out of line (all of them: the value was global)
    detail: str = ""
    time: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v:.4g}" for k, v in self.values.items())
        detail = f": {self.detail}" if self.detail else ""
        return f"{self.kind} ({shown}) on ranks {self.ranks} -> {self.action}{detail}"


def _json_number(v: float) -> Any:
    return v if math.isfinite(v) else str(v)  # JSON has no nan/inf: "nan", "inf"


class IncidentLog:
    """Where incidents go. ``path`` is set when the run starts (the Trainer's log directory, known on every rank);
    ``writer`` is True on global rank 0 only."""

    def __init__(self) -> None:
        self.incidents: list[Incident] = []
        self.path: Optional[str] = None
        self.writer = False

    def open(self, log_dir: Optional[str], *, writer: bool) -> None:
        self.path = os.path.join(log_dir, "incidents.jsonl") if log_dir else None
        self.writer = writer

    def add(self, incident: Incident, loggers: Sequence[Any] = ()) -> None:
        self.incidents.append(incident)
        if not self.writer:
            return
        if self.path is not None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            line = {**asdict(incident), "values": {k: _json_number(v) for k, v in incident.values.items()}}
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
                f.flush()
        metrics = {f"incidents/{incident.kind}": 1.0, "incidents/count": float(len(self.incidents)),
                   f"incidents/action_{incident.action}": 1.0}
        metrics.update({f"incidents/{k}": v for k, v in incident.values.items() if math.isfinite(v)})
        for logger in loggers:
            logger.log_metrics(metrics, step=incident.step)


def read_incidents(path: "str | os.PathLike[str]") -> list[dict[str, Any]]:
    """The incidents of a run, one dict per line of its ``incidents.jsonl`` (values "nan"/"inf" as floats)."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                d["values"] = {k: float(v) for k, v in d["values"].items()}
                out.append(d)
    return out
