"""A worker's heartbeat to its own agent (`Heartbeat`): whether its step thread moves, on a local
file (`OOBLECK_HEARTBEAT_DIR/<local rank>.hb`), with no etcd write.

A worker hung on a live node (a stuck kernel, a deadlock, a collective that never returns, a
stopped process) is not seen by the control plane: its agent answers every liveness check. So the
worker's main thread rewrites the beat from what the step thread reported (`Progress`).
Invariant: a step thread that stands still makes the beat stand still, and a stopped process
writes nothing; the agent's `HangWatch` (rendezvous/hang.py) reads it. docs/liveness.md.
"""

from __future__ import annotations

import faulthandler
import os
import time
from collections import deque
from pathlib import Path
from typing import IO, Optional

from ...config.timing import typical_step
from ...records.heartbeat import ENV, STACK_SIGNAL, Beat
from .progress import STEP_PROGRESS, Progress

__all__ = ["Heartbeat", "TYPICAL_STEPS"]

TYPICAL_STEPS = 20
"""Completed steps whose median is the typical step."""


class Heartbeat:
    """The worker side; a no-op when the agent gave no directory. `begin(step)`, `end(step)` and,
    while a step runs, `tick()` from the main thread's wait slices (engine/runner.py) overwrite one
    fixed-width `Beat` line (records/heartbeat.py) of `<local rank>.hb` with one `pwrite` (no
    fsync: the agent reads it through the page cache). A tick says when the step thread last made
    progress and since when it waits for a peer (`Progress`), not "now"; the beat also carries the
    typical step (the lower median of the last `TYPICAL_STEPS`), from which the agent's bound and
    the job's timeouts derive (config/timing.py). SIGUSR2 writes every thread's stack to
    `<local rank>.stack`."""

    def __init__(self, local_rank: int, directory: Optional[str] = None, progress: Progress = STEP_PROGRESS) -> None:
        directory = directory if directory is not None else os.environ.get(ENV)
        self.progress = progress
        self._fd: Optional[int] = None
        self._stack: Optional[IO[str]] = None
        self._steps: deque[float] = deque(maxlen=TYPICAL_STEPS)
        now = time.time()
        self._state: tuple[bool, int, float] = (False, -1, now)
        """(in a step, the step, when the state began)."""
        self._seen, self._moved, self._waiting = progress.count, now, 0.0
        """The progress count last seen, when it last changed, since when the step thread waits."""
        if not directory or not Path(directory).is_dir():
            return
        base = Path(directory)
        self._fd = os.open(base / f"{local_rank}.hb", os.O_WRONLY | os.O_CREAT, 0o644)
        self._stack = open(base / f"{local_rank}.stack", "w")
        faulthandler.register(STACK_SIGNAL, file=self._stack, all_threads=True)
        self._write(*self._state)

    @property
    def typical_step_s(self) -> float:
        """The lower median of the last completed steps' wall times (0: none yet)."""
        return typical_step(self._steps)

    def _write(self, in_step: bool, step: int, since: float) -> None:
        self._state = (in_step, step, since)
        if self._fd is None:
            return
        now = time.time()
        progress, waiting = (self._moved, self._waiting) if in_step else (now, 0.0)
        beat = Beat(os.getpid(), in_step, step, since, self.typical_step_s, progress, waiting, now)
        os.pwrite(self._fd, beat.line(), 0)

    def begin(self, step: int) -> None:
        now = time.time()
        self._seen, self._moved, self._waiting = self.progress.count, now, 0.0
        self._write(True, step, now)

    def tick(self) -> None:
        """Called by the main thread while it waits for a step: what the step thread reported."""
        now, count = time.time(), self.progress.count
        if count != self._seen:
            self._seen, self._moved = count, now
        if not self.progress.waits_for_a_peer():
            self._waiting = 0.0
        elif not self._waiting:
            self._waiting = now
        self._write(*self._state)

    def end(self, step: int, *, completed: bool = True) -> None:
        """The step ended (`completed`: it finished; else it failed or was abandoned, and its time
        does not count as a step time)."""
        now = time.time()
        if completed and self._state[0]:
            self._steps.append(now - self._state[2])
        self._write(False, step, now)

    def close(self) -> None:
        if self._fd is not None:
            faulthandler.unregister(STACK_SIGNAL)
            os.close(self._fd)
            self._fd = None
        if self._stack is not None:
            self._stack.close()
            self._stack = None
