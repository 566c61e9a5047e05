"""``layout="auto"``: choose tp, pp, dp, micro-batches, schedule, activation checkpointing and dp sharding from a
cost model of one step and the memory planner's figures. See ``docs/layout.md``.

    profile (meta, once)  ->  every layout of the world size  ->  memory per rank (drop what does not fit)
                          ->  predicted seconds per sample (block times, links, the schedule simulator)  ->  ranked
"""

from lightning_tpp.layout.cost import BlockTimes, StepTime, step_time
from lightning_tpp.layout.links import DEVICES, DeviceSpec, Link, UnknownDeviceError, device_spec, measure_link
from lightning_tpp.layout.memory import LayoutMemory, layout_memory
from lightning_tpp.layout.plan import Layout
from lightning_tpp.layout.profile import ModelProfile, Scaled, profile_model
from lightning_tpp.layout.search import Candidate, Dropped, NoLayoutFitsError, Ranking, search_layouts

__all__ = ["BlockTimes", "Candidate", "DEVICES", "DeviceSpec", "Dropped", "Layout", "LayoutMemory", "Link",
           "ModelProfile", "NoLayoutFitsError", "Ranking", "Scaled", "StepTime", "UnknownDeviceError", "device_spec",
           "layout_memory", "measure_link", "profile_model", "search_layouts", "step_time"]
