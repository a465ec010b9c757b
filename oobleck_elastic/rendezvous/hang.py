"""A hung worker on a live node is cut off by its own agent.

The control plane finds dead nodes (liveness sockets, leases, the roll call), but a worker that
hangs while its agent runs (a stuck kernel, a deadlock, a stopped process) answers nothing and
fails nothing: its agent answers for the node, and its peers wait in their collectives until
`comm_timeout_s`. So the agent watches its workers' heartbeats (engine/resilience/heartbeat.py: a local
file per worker, rewritten when a step begins and ends, no etcd write per step):

- **Decision** (`overdue`, pure): a worker in a step that has stood still (no tick from its main
  thread) for longer than max(`fault_tolerance.hang_floor_s`, `fault_tolerance.hang_factor` × its
  last step time) is hung; 0 turns the watch off. Standing still, not a long step, is the sign:
  the peers of a hung worker wait for it in their collectives for as long as it hangs, but their
  main threads keep ticking, so only the hung one is cut off. (A worker whose step thread alone
  is stuck while its main thread ticks is not caught here: its peers find it at comm_timeout_s.)
- **Action** (`HangWatch`): the agent asks the worker for its threads' stacks (SIGUSR2:
  `faulthandler`, registered by the worker, writes them to `<local rank>.stack`; a stopped process
  cannot answer, and is recorded as stopped), records them under the run's `errors` key and as a `hang` event, then
  SIGKILLs the worker. torchrun's agent sees a failed worker and restarts its workers (up to
  `--max-restarts`); their peers' collectives fail on the closed connections, the job re-plans in
  process as for any failure, and the restarted worker joins the next generation and receives its
  layers. Each worker process is acted on once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Optional

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


def overdue(beat: Beat, now: float, *, floor_s: float, factor: float) -> Optional[float]:
    """The bound a worker in a step has stood still beyond (seconds since its last tick), or None:
    not in a step, within max(floor_s, factor × its last step time), or the watch is off."""
    if floor_s <= 0 or not beat.in_step:
        return None
    bound = max(floor_s, factor * beat.last_step_s)
    return bound if now - beat.tick > bound else None


class HangWatch:
    """Watches the heartbeat files in `directory` (module docstring)."""

    def __init__(
        self,
        directory: Path,
        *,
        floor_s: float,
        factor: float,
        node: str,
        record: Callable[[Beat, int, float, str], None],
        interval_s: float = 0.25,
    ) -> None:
        """`record(beat, local_rank, bound, stack)` stores what was found (errors key, event)."""
        self.directory, self.floor_s, self.factor, self.node = directory, floor_s, factor, node
        self.record, self.interval_s = record, interval_s
        self.acted: set[int] = set()
        """Worker pids already cut off."""
        self._stop = threading.Event()

    def start(self) -> "HangWatch":
        if self.floor_s > 0:
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
                bound = overdue(beat, time.time(), floor_s=self.floor_s, factor=self.factor)
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
            "worker %d (pid %d) has stood still in step %d for %.1f s (bound %.1f s): its "
            "stacks:\n%s\nstopping it; its agent restarts it and the job re-plans",
            local_rank,
            beat.pid,
            beat.step + 1,
            time.time() - beat.tick,
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
