"""The fault-tolerance clocks a job derives from its measured step times.

`comm_timeout_s`, `hang_floor_s` and `stall_report_s` default to auto: derived from the worker's
typical step (an explicit value overrides), at each generation's entry and, for the communication
timeout, again while a generation runs (`due_comm_timeout`). Invariant: the communication timeout
is longer than the hang bound, so a hung peer is cut off by its agent before its peers'
collectives time out. Pure functions of the config section and the typical step. The story:
docs/liveness.md.
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
    "FOLLOW_CHANGE",
    "due_comm_timeout",
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
FOLLOW_CHANGE = 2.0
"""A running generation's auto communication timeout is derived again when the typical step it
rests on changed by this factor (up or down). Below COMM_OVER_HANG: the hang bound, which follows
every step, stays under the timeout until it follows too."""
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
    """Seconds a collective may wait once connected (docs/liveness.md)."""
    if ft.comm_timeout_s is not None:
        return ft.comm_timeout_s
    if typical_s <= 0:
        return FIRST_COMM_TIMEOUT_S
    bound = max(hang_bound(ft, typical_s) or 0.0, ft.hang_factor * typical_s)  # the watch may be off
    return max(COMM_FLOOR_S, COMM_OVER_HANG * bound)


def due_comm_timeout(ft: FaultToleranceConfig, basis_s: float, typical_s: float) -> Optional[float]:
    """The auto communication timeout (`comm_timeout`) a running generation moves to now, or None
    while the one it has stands: derived again from `typical_s` when the one it has rests on no
    measured step (`basis_s` 0) and a step is measured now, or when the typical step changed by
    FOLLOW_CHANGE or more since `basis_s`; never when the config sets the timeout."""
    if ft.comm_timeout_s is not None or typical_s <= 0:
        return None
    if basis_s > 0 and 1.0 / FOLLOW_CHANGE < typical_s / basis_s < FOLLOW_CHANGE:
        return None
    return comm_timeout(ft, typical_s)


def entry_join_timeout(base_s: float, idle_entries: int, cap_s: float) -> float:
    """Seconds a worker entering a generation waits to connect to its peers, after `idle_entries`
    entries in a row with no step committed between them: `fault_tolerance.join_timeout_s`
    doubled at each, up to the collectives' timeout `cap_s` (never below the base). A machine too
    loaded to connect in time gets more time at each attempt; a defect that breaks every
    generation still ends at `fault_tolerance.max_restarts_without_progress` (docs/recovery.md)."""
    return max(base_s, min(cap_s, base_s * 2.0 ** min(idle_entries, 30)))


def stall_report(ft: FaultToleranceConfig, typical_s: float = 0.0) -> float:
    """Seconds a joining worker waits for its peers before it checks in at the roll call (0: never)."""
    if ft.stall_report_s is not None:
        return ft.stall_report_s
    return max(STALL_FLOOR_S, typical_s)
