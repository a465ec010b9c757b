"""The step thread's progress (`Progress`): what it tells the worker's main thread, which rewrites
the heartbeat the agent watches (heartbeat.py, rendezvous/hang.py).

Invariant, the rule that names the right worker: a step thread waiting for a peer in a call whose
own part it posted is not hung; one that makes no progress while not waiting (a plain loop,
compute, a deadlock, a call whose handles all completed) stands still. With one worker hung its
peers wait for it, so only it stands still; a collective hung with every part posted names nobody
and is left to `fault_tolerance.comm_timeout_s`. On CUDA a wait returns before its kernel ran, so a
step whose posted data-plane work has not completed counts as waiting (`track_posted`).
`watch_pipeline_waits` marks the waits inside torch's pipeline schedules, under the current
timeout (`Progress.p2p_timeout`). docs/liveness.md.
"""

from __future__ import annotations

import contextlib
import functools
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, TypeVar

__all__ = ["Progress", "STEP_PROGRESS", "watch_pipeline_waits"]

T = TypeVar("T")


class Progress:
    """Written by the step thread, read by the main thread, with plain attribute writes (no lock,
    no system call). `point()` bumps a counter at every compute chunk (`timed`) and communication
    call; `waiting(*works)` marks a communication call whose own part is posted; the main thread
    asks `waits_for_a_peer()`: in such a call, with some handle not complete yet. Tensor-parallel
    collectives run inside a compute chunk and are not marked (a lane blocked outside them leaves
    its stage's other lanes standing still in them, and they are replaced alike); on a GPU the
    step's one device sync is marked as a wait, so a stuck kernel is left to the comm timeout."""

    def __init__(self) -> None:
        self.count = 0
        """Progress points passed so far."""
        self.waits: Optional[tuple[Any, ...]] = None
        """The handles of the communication call the step thread waits in (None: not waiting)."""
        self.p2p_timeout: Optional[timedelta] = None
        """The timeout the pipeline's marked sends and receives wait under (None: their group's).
        The trainer sets it to the communication timeout on the CPU: gloo's point-to-point waits
        keep the timeout their group connected with, which `_set_pg_timeout` does not change."""
        self.track_posted = False
        """Keep the handles of marked waits that returned before their work completed (`posted`):
        on CUDA (the trainer sets it) NCCL's `wait()` only orders the compute stream after the
        collective and returns at once, and a healthy peer of a hung worker blocks later, in a
        kernel launch or an implicit sync outside any marked wait (docs/nccl.md)."""
        self.posted: tuple[Any, ...] = ()
        """Handles of this step's marked waits not completed when the wait returned (`track_posted`)."""

    def point(self) -> None:
        self.count += 1

    def new_step(self) -> None:
        """The step thread starts a step: the previous one's posted handles are forgotten."""
        self.posted = ()

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
            if self.track_posted and works:  # one tuple swap: the main thread reads it unlocked
                self.posted = (*self.posted, *works)
            self.waits = None
            self.count += 1

    def waits_for_a_peer(self) -> bool:
        """(The main thread) the step thread waits in a communication call that has not completed,
        or (`track_posted`) some work of a marked wait of this step has not completed yet."""
        works = self.waits
        try:
            if works is not None:
                return not works or not all(w.is_completed() for w in works)
            return not all(w.is_completed() for w in self.posted)
        except Exception:  # noqa: BLE001 - a broken handle: its wait is about to fail
            return True


STEP_PROGRESS = Progress()
"""This process's step thread's progress (one trainer per worker process)."""


def watch_pipeline_waits(progress: Progress = STEP_PROGRESS) -> None:
    """Mark the pipeline schedules' waits for their sends and receives as waiting (once)."""
    from torch.distributed.pipelining import schedules

    wait = getattr(schedules, "_wait_batch_p2p", None)
    if wait is None:  # check_start refuses such a torch; never lose the marks in silence
        raise RuntimeError("torch.distributed.pipelining.schedules._wait_batch_p2p is missing: see torch_internals")
    if getattr(wait, "_oobleck_progress", False):
        return

    def marked(work: list) -> None:
        with progress.waiting(*work):
            timeout = progress.p2p_timeout
            if timeout is None:
                wait(work)
            else:
                for w in work:
                    w.wait(timeout)

    marked._oobleck_progress = True  # type: ignore[attr-defined]
    schedules._wait_batch_p2p = marked
