"""Trace-driven simulation: how much training a system gets through node failures and joins.

`trace` reads and draws node-availability traces; `timeline` keeps one system's time and its
breakdown; `systems` holds the system models (this project, Oobleck as published, Varuna, Bamboo,
torchrun checkpoint-restart) and `replay`; `shadows` decides which losses this project's shadow
copies survive; `paper` reproduces the Oobleck paper's comparison from its shipped inputs;
`scale` runs this project's planner at 1,000-10,000 nodes; `report` prints and plots.
The mechanisms and their sources: docs/simulate.md. Command line: `oobleck simulate`.
"""

from .systems import Bamboo, CheckpointRestart, Oobleck, OobleckElastic, SystemModel, Varuna, replay
from .timeline import CATEGORIES, Timeline
from .trace import NodeEvent, TraceError, load_trace, node_counts, synthetic_trace

__all__ = [
    "Bamboo",
    "CATEGORIES",
    "CheckpointRestart",
    "NodeEvent",
    "Oobleck",
    "OobleckElastic",
    "SystemModel",
    "Timeline",
    "TraceError",
    "Varuna",
    "load_trace",
    "node_counts",
    "replay",
    "synthetic_trace",
]
