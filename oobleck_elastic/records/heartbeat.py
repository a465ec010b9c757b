"""The heartbeat line a worker writes for its own agent: what a worker is doing, on a local file.

One fixed-width line per worker, overwritten in place, no etcd write; the agent reads it to find
a hung worker. The story: docs/liveness.md.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["ENV", "LINE", "STACK_SIGNAL", "Beat", "read_beat"]


ENV = "OOBLECK_HEARTBEAT_DIR"


LINE = 128
"""Bytes of the heartbeat line (space-padded)."""


STACK_SIGNAL = signal.SIGUSR2
"""The signal that makes a worker write its threads' stacks (faulthandler)."""


@dataclass(frozen=True)
class Beat:
    pid: int
    """The worker process."""
    in_step: bool
    """A step is running."""
    step: int
    """The step running, or the last one that ended."""
    since: float
    """Unix time the state began."""
    typical_step_s: float
    """The worker's typical step: the median wall time of its last completed steps (0: none yet)."""
    progress: float
    """Unix time the worker's step thread last made progress (docs/liveness.md)."""
    waiting: float = 0.0
    """Unix time the step thread began waiting for a peer in a communication call (0: it is not)."""
    written: float = 0.0
    """Unix time the worker's main thread wrote the line (a stopped process stops writing)."""

    def line(self) -> bytes:
        """The beat as the file holds it: one space-padded line of `LINE` bytes."""
        text = (
            f"{self.pid} {'step' if self.in_step else 'idle'} {self.step} {self.since:.3f} "
            f"{self.typical_step_s:.3f} {self.progress:.3f} {self.waiting:.3f} {self.written:.3f}"
        )
        return text.ljust(LINE - 1).encode()[: LINE - 1] + b"\n"


def read_beat(path: Path) -> Optional[Beat]:
    """The heartbeat in `path`, or None (missing, being written, malformed)."""
    try:
        fields = path.read_text().split()
        return Beat(
            pid=int(fields[0]),
            in_step=fields[1] == "step",
            step=int(fields[2]),
            since=float(fields[3]),
            typical_step_s=float(fields[4]),
            progress=float(fields[5]),
            # a line of six fields (an older worker): not waiting, and it progressed when it wrote
            waiting=float(fields[6]) if len(fields) > 6 else 0.0,
            written=float(fields[7] if len(fields) > 7 else fields[5]),
        )
    except (OSError, ValueError, IndexError):
        return None
