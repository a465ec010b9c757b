"""A hung worker on a live node is cut off by its own agent.

The control plane finds dead nodes (liveness sockets, leases, the roll call), but a worker that
hangs while its agent runs (a step thread stuck in a kernel, a deadlock, a collective that never
returns, a stopped process) answers nothing and fails nothing: its agent answers for the node,
and its peers wait in their collectives until `comm_timeout_s`. So the agent watches its workers'
heartbeats (engine/resilience/heartbeat.py: a local file per worker, no etcd write per step),
which say when each worker's step thread last made progress (a compute chunk, a communication
call entered or left) and whether it is waiting for a peer in a communication call
(engine/resilience/progress.py):

- **Decision** (`overdue`, pure): a worker in a step whose step thread has made no progress, and
  is not waiting for a peer, for longer than the hang bound -- max(floor, `hang_factor` × its
  typical step), the floor being `fault_tolerance.hang_floor_s` or, by default, derived from the
  measured steps (config/timing.py: 120 s before a step was measured, 30 s after) -- is hung; a
  floor of 0 turns the watch off. Standing still, not a long step, is the sign, and waiting is
  not standing still: the peers of a hung worker wait for it in communication calls whose
  handles cannot complete without its part, so only the hung one is cut off, whether its step
  thread is blocked in a plain loop, in compute, or inside a communication call whose handles
  completed. A collective hung with every part posted names nobody here (every worker waits for
  an incomplete handle): its own timeout (`comm_timeout_s`, derived from the measured steps by
  default) ends it. A stopped or frozen process writes no beat at all (its main thread stands
  still too), and is hung past the bound whatever its step thread was doing.
- **Action** (`HangWatch`): the agent asks the worker for its threads' stacks (SIGUSR2:
  `faulthandler`, registered by the worker, writes them to `<local rank>.stack`; a stopped process
  cannot answer, and is recorded as stopped), records them under the run's `errors` key and as a
  `hang` event, withdraws the worker's readiness (so the next plan leaves its node out and every
  worker abandons the step), then SIGKILLs the worker. torchrun's agent restarts its workers (up
  to `--max-restarts`); the job re-plans in process as for any failure, and the restarted worker
  joins at a step boundary and receives its layers. Each worker process is acted on once. The
  watch reads the beats every `interval_s` (0.25 s), so a hang is acted on within the bound +
  0.25 s.
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
    """The hang bound a worker in a step has stood still beyond (module docstring), or None: not in
    a step, moved within the bound, waiting for a peer (its main thread writing), or the watch is off."""
    bound = hang_bound(ft, beat.typical_step_s)
    if not beat.in_step or bound is None:
        return None
    if now - beat.written > bound:  # the whole process stands still (stopped, frozen)
        return bound
    return bound if not beat.waiting and now - beat.progress > bound else None


class HangWatch:
    """Watches the heartbeat files in `directory` (module docstring)."""

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
            for path in sorted(self.directory.glob("*.hb")):
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
