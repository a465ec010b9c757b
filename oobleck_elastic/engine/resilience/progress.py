"""The step thread's progress: what it tells the worker's main thread, with plain attribute writes.

A step thread blocked in a collective, in a kernel or in a deadlock does not stop the worker's
main thread, which keeps waiting for it in slices (engine/runner.py). So the heartbeat the agent
watches (engine/resilience/heartbeat.py, rendezvous/hang.py) must say whether the step thread itself
moves. The step thread reports two things here, with no lock, no system call and no etcd write:

- **progress points**: `point()` bumps a counter (one int attribute write) at every compute chunk
  (each forward and backward of a microbatch: `timed`) and at every communication call it enters
  and leaves; the main thread turns a change of the counter into a time when it rewrites the
  heartbeat;
- **waiting for a peer**: `waiting(*works)` marks the step thread as waiting in a communication
  call whose own part it has posted (`works`: the call's handles, none when the call gives none).
  The main thread asks `waits_for_a_peer()`: the step thread is in such a call and some handle is
  not complete yet.

The rule that names the right worker (rendezvous/hang.py) follows: a worker that waits for a peer
is not hung, it is waiting; a step thread that makes no progress while it is not waiting for a
peer -- blocked in a plain loop, in compute, in a deadlock, or inside a communication call whose
handles have all completed (the data arrived, the thread did not come back) -- stands still. With
one worker hung, its peers sit in communication calls waiting for it (their handles cannot
complete without its part), so only it stands still. A collective hung inside the network or the
device with every part posted (all its workers wait for an incomplete handle) names nobody: the
collective's own timeout, `fault_tolerance.comm_timeout_s` (derived from the measured step times
by default, config/timing.py), ends it.

Pipeline sends and receives are waited for inside torch's schedules; `watch_pipeline_waits`
wraps the schedules' one waiting function so those waits are marked too. The collectives of
tensor parallelism run inside a layer's forward and backward, within a compute chunk, and are not
marked: a lane blocked outside them leaves its stage's other lanes standing still in them, so
every lane of that stage is cut off (they are replaced alike). On a GPU the step's one device sync
(the norm read after the gradient sums) is marked as waiting, so a kernel stuck on the device
shows as a wait and is left to the communication timeout.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional, TypeVar

__all__ = ["Progress", "STEP_PROGRESS", "watch_pipeline_waits"]

T = TypeVar("T")


class Progress:
    """Written by the step thread, read by the main thread (module docstring)."""

    def __init__(self) -> None:
        self.count = 0
        """Progress points passed so far."""
        self.waits: Optional[tuple[Any, ...]] = None
        """The handles of the communication call the step thread waits in (None: not waiting)."""

    def point(self) -> None:
        self.count += 1

    def timed(self, fn: Callable[..., T]) -> Callable[..., T]:
        """`fn` with a progress point before and after each call (a compute chunk)."""

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> T:
            self.count += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.count += 1

        return run

    @contextlib.contextmanager
    def waiting(self, *works: Any) -> Iterator[None]:
        """The step thread waits for its peers in a communication call it has posted its part of."""
        self.count += 1
        self.waits = works
        try:
            yield
        finally:
            self.waits = None
            self.count += 1

    def waits_for_a_peer(self) -> bool:
        """(The main thread) the step thread waits in a communication call that has not completed."""
        works = self.waits
        if works is None:
            return False
        try:
            return not works or not all(w.is_completed() for w in works)
        except Exception:  # noqa: BLE001 - a broken handle: its wait is about to fail
            return True


STEP_PROGRESS = Progress()
"""This process's step thread's progress (one trainer per worker process)."""


def watch_pipeline_waits(progress: Progress = STEP_PROGRESS) -> None:
    """Mark the pipeline schedules' waits for their sends and receives as waiting (once)."""
    from torch.distributed.pipelining import schedules

    wait = getattr(schedules, "_wait_batch_p2p", None)
    if wait is None or getattr(wait, "_oobleck_progress", False):
        return

    def marked(work: list) -> None:
        with progress.waiting(*work):
            wait(work)

    marked._oobleck_progress = True  # type: ignore[attr-defined]
    schedules._wait_batch_p2p = marked
