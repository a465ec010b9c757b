"""Run a step where the main thread can stop waiting for it (`StepRunner`).

A collective blocked on a hung peer does not fail: NCCL usually hangs, and gloo waits for its
timeout (a stopped or partitioned peer keeps its sockets open). So each step runs in a thread,
and the main thread waits in slices of `fault_tolerance.watch_interval_s`, asking the control
plane between slices whether to abandon it; if so `run` raises `StepAbandoned` at once and leaves
the thread behind. Invariant: an abandoned step changes nothing (engine/step/apply.py), and a
process that abandoned one ends with `exit_now_if_abandoned`, never the interpreter's shutdown.
docs/liveness.md.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Optional, TypeVar

import torch

from .resilience.errors import StepAbandoned

T = TypeVar("T")
_abandoned: list[threading.Thread] = []  # step threads left behind, possibly still blocked
_hard_exit_reasons: list[str] = []  # other reasons why this process must not run the interpreter's shutdown


def require_hard_exit(reason: str) -> None:
    """Make `exit_now_if_abandoned` end this process at once whatever happens: a donor worker
    leaves the generation while its peers go on with the groups it was part of, and freeing
    those at shutdown intermittently aborts the process the same way (see below)."""
    _hard_exit_reasons.append(reason)


def exit_now_if_abandoned(code: int) -> None:
    """End the process with `code` at once when a step was ever abandoned in it.

    The abandoned step's collectives may still be blocked on the hung peer, in the step thread or
    in the process group's own worker threads. At interpreter shutdown either kind hangs or
    aborts the process: a thread that wakes up cannot take the GIL back and its forced unwind
    through C++ aborts ("terminate called without an active exception", exit status -6), and
    freeing the old process group joins worker threads that never return. torchrun would report
    a failed or hung worker. A worker script calls this after training (examples/train.py does)."""
    if _abandoned or _hard_exit_reasons:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def abandoned_threads() -> list[threading.Thread]:
    """The step threads left behind by an abandonment that are still running."""
    return [t for t in _abandoned if t.is_alive()]


class StepRunner:
    """Runs functions in one long-lived daemon thread (torch's intra-op thread pools are per
    calling thread, so a new thread per step would build a new pool every step). After an
    abandonment the blocked thread is left behind (a daemon: it never keeps the process from
    exiting) and the next call starts a new one."""

    def __init__(self, device: Optional[torch.device] = None, name: str = "oobleck-step") -> None:
        self.device, self.name = device, name
        self._jobs: Optional[queue.SimpleQueue] = None
        self._thread: Optional[threading.Thread] = None

    def run(self, fn: Callable[[], T], *, should_abandon: Callable[[], Optional[str]], interval_s: float) -> T:
        """`fn()` in the runner's thread; its result, or its exception re-raised here with its
        traceback. Raises StepAbandoned(reason) as soon as `should_abandon()` returns a reason."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, args=(self._jobs,), name=self.name, daemon=True)
            self._thread.start()
        future: Future = Future()
        self._jobs.put((fn, future))
        while True:
            try:
                return future.result(timeout=interval_s)
            except FutureTimeout:
                pass
            reason = should_abandon()
            if reason:
                if self._thread is not None:
                    _abandoned.append(self._thread)
                self.close()  # the blocked thread ends by itself once its call returns or fails
                raise StepAbandoned(reason)

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        while True:
            item = jobs.get()
            if item is None:
                return
            fn, future = item
            try:
                future.set_result(fn())
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(err)

    def close(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None
            self._thread = None
