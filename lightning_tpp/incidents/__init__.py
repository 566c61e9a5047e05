"""Training incidents: a loss or gradient-norm spike dropped or rolled back on every rank alike (``SpikeGuard``),
the last good state kept in host memory (``snapshot``), and every incident written down (``record``).
See ``docs/incidents.md``."""

from lightning_tpp.incidents.detector import IncidentBudget, SpikeDetector, TooManyIncidentsError, Trigger
from lightning_tpp.incidents.guard import SpikeGuard
from lightning_tpp.incidents.record import Incident, IncidentLog, read_incidents
from lightning_tpp.incidents.snapshot import HostSnapshot, restore_snapshot, take_snapshot

__all__ = ["HostSnapshot", "Incident", "IncidentBudget", "IncidentLog", "SpikeDetector", "SpikeGuard",
           "TooManyIncidentsError", "Trigger", "read_incidents", "restore_snapshot", "take_snapshot"]
