"""A worker's heartbeat to its own agent: when its steps start and end, on a local file.

A worker that hangs on a live node (a stuck kernel, a deadlock, a stopped process) is not seen by
the control plane: its agent answers every liveness check, and its peers wait in their
collectives. So each worker tells its agent, locally and with no etcd write, what it is doing:
`Heartbeat.begin(step)` and `Heartbeat.end(step)` overwrite one line of a small file in the
directory the agent gives it (`OOBLECK_HEARTBEAT_DIR`, file `<local rank>.hb`), and while a step
runs the worker's main thread, which waits for the step thread in short slices (engine/runner.py),
`tick()`s it at every slice. The line's format is the `Beat` record (records/heartbeat.py).

A worker whose peers are slow, or that waits on them in a collective, keeps ticking; a stopped
or frozen process (or one whose main thread cannot get the interpreter back) does not.

Each write is one `pwrite` of a fixed-width line (no fsync: the agent reads it through the page cache). The
agent's `HangWatch` (rendezvous/hang.py) reads it. The worker also registers `faulthandler` on
SIGUSR2, writing every thread's stack to `<local rank>.stack` in the same directory, so the agent
can record where a hung worker stands before it stops it.
"""

from __future__ import annotations

import faulthandler
import os
import time
from pathlib import Path
from typing import IO, Optional

from ...records.heartbeat import ENV, STACK_SIGNAL, Beat

__all__ = ["Heartbeat"]


class Heartbeat:
    """The worker side (module docstring); a no-op when the agent gave no directory."""

    def __init__(self, local_rank: int, directory: Optional[str] = None) -> None:
        directory = directory if directory is not None else os.environ.get(ENV)
        self._fd: Optional[int] = None
        self._stack: Optional[IO[str]] = None
        self.last_step_s = 0.0
        self._state: tuple[bool, int, float] = (False, -1, time.time())
        """(in a step, the step, when the state began): what `tick` rewrites."""
        if not directory or not Path(directory).is_dir():
            return
        base = Path(directory)
        self._fd = os.open(base / f"{local_rank}.hb", os.O_WRONLY | os.O_CREAT, 0o644)
        self._stack = open(base / f"{local_rank}.stack", "w")
        faulthandler.register(STACK_SIGNAL, file=self._stack, all_threads=True)
        self._write(*self._state)

    def _write(self, in_step: bool, step: int, since: float) -> None:
        self._state = (in_step, step, since)
        if self._fd is None:
            return
        beat = Beat(os.getpid(), in_step, step, since, self.last_step_s, time.time())
        os.pwrite(self._fd, beat.line(), 0)

    def begin(self, step: int) -> None:
        self._write(True, step, time.time())

    def tick(self) -> None:
        """The main thread is alive (called while it waits for a step)."""
        self._write(*self._state)

    def end(self, step: int, *, completed: bool = True) -> None:
        """The step ended (`completed`: it finished; else it failed or was abandoned, and its time
        does not count as a step time)."""
        now = time.time()
        if completed and self._state[0]:
            self.last_step_s = now - self._state[2]
        self._write(False, step, now)

    def close(self) -> None:
        if self._fd is not None:
            faulthandler.unregister(STACK_SIGNAL)
            os.close(self._fd)
            self._fd = None
        if self._stack is not None:
            self._stack.close()
            self._stack = None
