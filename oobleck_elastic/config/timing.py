"""The fault-tolerance clocks a job derives from its measured step times.

Users used to find `comm_timeout_s`, `hang_floor_s` and `stall_report_s` by trial and error: too
short and a slow first step or a large stage is taken for a failure, too long and a hung worker
holds the job for minutes. So each of them defaults to `None` (auto), and is derived here from
the worker's typical step: the median wall time of its last completed steps, which its
heartbeat carries to its agent (records/heartbeat.py). An explicit value in the config overrides
the derivation, as before. Before any step is measured (the first step of a job: allocator
warm-up, kernel autotuning, compilation) the auto values are the old, generous defaults.

- hang bound (`hang_bound`): a worker's step thread that makes no progress for longer than
  max(floor, `hang_factor` x typical step) is hung (rendezvous/hang.py). The floor is
  `hang_floor_s` when set (0 turns the watch off), else `FIRST_STEP_FLOOR_S` before a step was
  measured and `MEASURED_FLOOR_S` after.
- communication timeout (`comm_timeout`): `comm_timeout_s` when set, else `FIRST_COMM_TIMEOUT_S`
  before a step was measured and max(`COMM_FLOOR_S`, `COMM_OVER_HANG` x the hang bound) after, so
  a hung peer is always cut off by its agent before its peers' collectives time out.
- stall report (`stall_report`): `stall_report_s` when set, else max(`STALL_FLOOR_S`, typical
  step): a worker joining a generation that has waited for its peers this long checks in at the
  leader's roll call (rendezvous/detect.py).

All are pure functions of the config section and the typical step.
"""

from __future__ import annotations

from statistics import median_low
from typing import Iterable, Optional

from .fault_tolerance import FaultToleranceConfig

__all__ = [
    "FIRST_STEP_FLOOR_S",
    "MEASURED_FLOOR_S",
    "FIRST_COMM_TIMEOUT_S",
    "COMM_FLOOR_S",
    "COMM_OVER_HANG",
    "STALL_FLOOR_S",
    "typical_step",
    "hang_bound",
    "comm_timeout",
    "stall_report",
]

FIRST_STEP_FLOOR_S = 120.0
"""Auto hang floor before a step was measured (a first step compiles, autotunes, warms up)."""
MEASURED_FLOOR_S = 30.0
"""Auto hang floor once steps are measured (a garbage collection, a busy host, a data source that
hiccups: a step thread may pause this long without being stuck)."""
FIRST_COMM_TIMEOUT_S = 300.0
"""Auto communication timeout before a step was measured."""
COMM_FLOOR_S = 120.0
"""Least auto communication timeout once steps are measured (a newcomer's first step in a
generation may compile and warm up while its peers wait in their receives)."""
COMM_OVER_HANG = 3.0
"""The auto communication timeout is at least this many hang bounds."""
STALL_FLOOR_S = 1.0
"""Least auto stall report."""


def typical_step(seconds: Iterable[float]) -> float:
    """The typical step of `seconds` (wall times of completed steps): their lower median; 0 for none."""
    values = [s for s in seconds if s > 0]
    return float(median_low(values)) if values else 0.0


def hang_bound(ft: FaultToleranceConfig, typical_s: float) -> Optional[float]:
    """Seconds without progress after which a step thread is hung; None: the watch is off."""
    floor = ft.hang_floor_s
    if floor is None:
        floor = MEASURED_FLOOR_S if typical_s > 0 else FIRST_STEP_FLOOR_S
    if floor <= 0:
        return None
    return max(floor, ft.hang_factor * typical_s)


def comm_timeout(ft: FaultToleranceConfig, typical_s: float = 0.0) -> float:
    """Seconds a collective may wait once connected (module docstring)."""
    if ft.comm_timeout_s is not None:
        return ft.comm_timeout_s
    if typical_s <= 0:
        return FIRST_COMM_TIMEOUT_S
    bound = max(hang_bound(ft, typical_s) or 0.0, ft.hang_factor * typical_s)  # the watch may be off
    return max(COMM_FLOOR_S, COMM_OVER_HANG * bound)


def stall_report(ft: FaultToleranceConfig, typical_s: float = 0.0) -> float:
    """Seconds a joining worker waits for its peers before it checks in at the roll call (0: never)."""
    if ft.stall_report_s is not None:
        return ft.stall_report_s
    return max(STALL_FLOOR_S, typical_s)
