"""Fault injection for tests and drills: make a worker raise a deterministic error, or be slow.

`OOBLECK_FAIL_AT="RANK@STEP[,RANK@STEP...]"` in a worker's environment makes the worker holding
global rank RANK of its generation raise `RuntimeError("injected fault: ...")` when it starts
step STEP (0-based), in every generation: the error is not a communication failure, so it ends
the worker with its traceback, and because it comes back after every restart it exercises the
repeated-error cap (`fault_tolerance.max_repeated_errors`). Like torchft's `fail_at(rank, step)`.

`OOBLECK_SLOW_AT="RANK@STEP:SECONDS[,...]"` makes that worker sleep SECONDS when it starts step
STEP (before its stage computes anything), in every generation: a stage as slow as a large
model's first step (allocator warm-up, kernel autotuning, compilation), so its neighbours wait
for it in their receives. A slow step is not a failure and must not be treated as one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Mapping

ENV = "OOBLECK_FAIL_AT"
SLOW_ENV = "OOBLECK_SLOW_AT"


@dataclass(frozen=True)
class FaultInjector:
    points: frozenset[tuple[int, int]]
    """(rank, step) pairs at which to raise."""
    slow: dict[tuple[int, int], float] = field(default_factory=dict)
    """(rank, step) -> seconds to sleep at the start of that step."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "FaultInjector":
        spec = environ.get(ENV, "").strip()
        points = set()
        for item in filter(None, (p.strip() for p in spec.split(","))):
            rank, sep, step = item.partition("@")
            if not sep or not rank.isdigit() or not step.isdigit():
                raise ValueError(f"{ENV}={spec!r}: each item must be RANK@STEP, e.g. 1@3")
            points.add((int(rank), int(step)))
        slow_spec = environ.get(SLOW_ENV, "").strip()
        slow = {}
        for item in filter(None, (p.strip() for p in slow_spec.split(","))):
            rank, sep, rest = item.partition("@")
            step, sep2, seconds = rest.partition(":")
            try:
                ok = sep and sep2 and rank.isdigit() and step.isdigit() and float(seconds) >= 0
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"{SLOW_ENV}={slow_spec!r}: each item must be RANK@STEP:SECONDS, e.g. 0@0:5")
            slow[(int(rank), int(step))] = float(seconds)
        return cls(frozenset(points), slow)

    def check(self, *, rank: int, step: int) -> None:
        """Called by a worker as it starts `step`: sleep and/or raise as the environment says."""
        if (rank, step) in self.slow:
            time.sleep(self.slow[(rank, step)])
        if (rank, step) in self.points:
            raise RuntimeError(f"injected fault: rank {rank} at step {step} ({ENV})")
