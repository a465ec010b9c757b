"""A hung worker on a live node is cut off by its own agent.

A worker in a step whose step thread stood still (not waiting for a peer) past the hang bound is
hung (`overdue`, pure); `HangWatch` records its stacks, withdraws its readiness and kills it,
once per process. The story: docs/liveness.md.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from ..config import FaultToleranceConfig
from ..config.timing import hang_bound
from ..logs import JobLog
from ..records.heartbeat import STACK_SIGNAL, Beat, read_beat

__all__ = ["overdue", "HangWatch", "WorkerHung"]

log = JobLog(logging.getLogger(__name__))


class WorkerHung(RuntimeError):
    """What the run's `errors` key records for a worker its agent found hung."""


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T in /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def overdue(beat: Beat, now: float, ft: FaultToleranceConfig) -> Optional[float]:
    """The hang bound a worker in a step has stood still beyond (docs/liveness.md), or None: not in
    a step, moved within the bound, waiting for a peer (its main thread writing), or the watch is off."""
    bound = hang_bound(ft, beat.typical_step_s)
    if not beat.in_step or bound is None:
        return None
    if now - beat.written > bound:  # the whole process stands still (stopped, frozen)
        return bound
    return bound if not beat.waiting and now - beat.progress > bound else None


class HangWatch:
    """Watches the heartbeat files in `directory` (docs/liveness.md)."""

    def __init__(
        self,
        directory: Path,
        *,
        ft: FaultToleranceConfig,
        node: str,
        record: Callable[[Beat, int, float, str], None],
        interval_s: float = 0.25,
    ) -> None:
        """`record(beat, local_rank, bound, stack)` stores what was found (errors key, event)."""
        self.directory, self.ft, self.node = directory, ft, node
        self.record, self.interval_s = record, interval_s
        self.acted: set[int] = set()
        """Worker pids already cut off."""
        self._stop = threading.Event()

    def start(self) -> "HangWatch":
        if self.ft.hang_floor_s != 0:
            threading.Thread(target=self._run, name="oobleck-hang-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:  # the agent removes the directory on its way out (atexit): nothing left to watch
                if not self.directory.is_dir():
                    return
                paths = sorted(self.directory.glob("*.hb"))
            except FileNotFoundError:  # removed while being listed
                return
            for path in paths:
                beat = read_beat(path)
                if beat is None or beat.pid in self.acted:
                    continue
                bound = overdue(beat, time.time(), self.ft)
                if bound is not None:
                    self.cut_off(beat, int(path.stem), bound)

    def _stacks(self, pid: int, stack_file: Path) -> Optional[str]:
        """Ask worker `pid` for its threads' stacks (faulthandler on SIGUSR2) and read them; None
        when the process is gone."""
        before = stack_file.stat().st_size if stack_file.exists() else 0
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            return None
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and (stack_file.stat().st_size if stack_file.exists() else 0) == before:
            time.sleep(0.05)
        time.sleep(0.1)  # let faulthandler finish the other threads
        try:
            with open(stack_file) as fh:
                fh.seek(before)
                stack = fh.read()
        except OSError:
            stack = ""
        return stack or "(no stack: the worker did not answer SIGUSR2)"

    def cut_off(self, beat: Beat, local_rank: int, bound: float) -> None:
        """Dump the hung worker's stacks, record them, and SIGKILL it."""
        self.acted.add(beat.pid)
        if _stopped(beat.pid):  # a stopped process runs no signal handler: no stack to ask for
            stack = "(no stack: the process is stopped, e.g. by SIGSTOP)"
        else:
            asked = self._stacks(beat.pid, self.directory / f"{local_rank}.stack")
            if asked is None:
                return  # gone already
            stack = asked
        log.at(node=self.node).error(
            "worker %d (pid %d): its step thread has made no progress in step %d for %.1f s (bound "
            "%.1f s): its stacks:\n%s\nstopping it; its agent restarts it and the job re-plans",
            local_rank,
            beat.pid,
            beat.step + 1,
            time.time() - beat.progress,
            bound,
            stack,
        )
        try:
            self.record(beat, local_rank, bound, stack)
        except Exception as err:  # noqa: BLE001 - etcd out of reach: cut the worker off anyway
            log.at(node=self.node).warning("could not record the hang of worker %d: %s", local_rank, err)
        try:
            os.kill(beat.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
