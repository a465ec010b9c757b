"""Fault injection for tests and drills: make a worker raise a deterministic error.

`OOBLECK_FAIL_AT="RANK@STEP[,RANK@STEP...]"` in a worker's environment makes the worker holding
global rank RANK of its generation raise `RuntimeError("injected fault: ...")` when it starts
step STEP (0-based), in every generation: the error is not a communication failure, so it ends
the worker with its traceback, and because it comes back after every restart it exercises the
repeated-error cap (`fault_tolerance.max_repeated_errors`). Like torchft's `fail_at(rank, step)`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

ENV = "OOBLECK_FAIL_AT"


@dataclass(frozen=True)
class FaultInjector:
    points: frozenset[tuple[int, int]]
    """(rank, step) pairs at which to raise."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "FaultInjector":
        spec = environ.get(ENV, "").strip()
        points = set()
        for item in filter(None, (p.strip() for p in spec.split(","))):
            rank, sep, step = item.partition("@")
            if not sep or not rank.isdigit() or not step.isdigit():
                raise ValueError(f"{ENV}={spec!r}: each item must be RANK@STEP, e.g. 1@3")
            points.add((int(rank), int(step)))
        return cls(frozenset(points))

    def check(self, *, rank: int, step: int) -> None:
        if (rank, step) in self.points:
            raise RuntimeError(f"injected fault: rank {rank} at step {step} ({ENV})")
