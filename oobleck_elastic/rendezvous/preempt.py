"""Preemption notices: a signal to a node's agent drains the node instead of failing it.

`PreemptionWatch` takes `fault_tolerance.preempt_signals` from torchrun, marks the node
draining, and hands the signal back when the grace runs out or there is nothing to drain;
`guard_worker` keeps the workers alive through the same notice. The story: docs/recovery.md.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence


from ..logs import JobLog
from ..config import parse_signals

__all__ = ["NOTICE_ENV", "SIGNALS_ENV", "TORCHRUN_SIGNALS", "PreemptionWatch", "guard_worker", "parse_signals"]

log = JobLog(logging.getLogger(__name__))

TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
"""What torchrun's agent handles when TORCHELASTIC_SIGNALS_TO_HANDLE is unset."""

NOTICE_ENV = "OOBLECK_PREEMPT_NOTICE"
"""Workers' environment: the file their agent creates when it receives a preemption notice."""
SIGNALS_ENV = "OOBLECK_PREEMPT_SIGNALS"
"""Workers' environment: the names of the preemption signals, comma-separated."""
WORKER_WAIT_S = 1.0
"""How long a worker that received a notice waits for its agent's record of it."""


class PreemptionWatch:
    """Drains this node when one of `signals` arrives (docs/recovery.md)."""

    def __init__(
        self,
        signals: Sequence[signal.Signals],
        *,
        grace_s: float,
        node: str,
        drain: Callable[[str], bool],
        alive: Callable[[], bool],
        give_up: Optional[Callable[[], None]] = None,
        notice_file: Optional[Path] = None,
        applies: Optional[Callable[[], bool]] = None,
    ) -> None:
        """`drain(detail)` marks the node draining; `alive()` says whether the agent still runs;
        `give_up()` hands the node to torchrun's own handling (default: the signal again, answered
        as torchrun answers it); `notice_file` is created when a notice arrives, for the workers
        (`guard_worker`); `applies()` says whether the node has anything to drain (default: yes)."""
        self.signals, self.grace_s, self.node = list(signals), grace_s, node
        self.notice_file = notice_file
        self._drain, self._alive = drain, alive
        self._give_up = give_up or self._hand_back
        self._applies = applies or (lambda: True)
        self.noticed: Optional[float] = None
        """Monotonic time of the first notice."""
        self._wake = threading.Event()
        self._signal: Optional[signal.Signals] = None
        self._handed_back = False
        self._stopped = False
        self._previous: dict[signal.Signals, Any] = {}
        self._previous_env: dict[str, Optional[str]] = {}
        self._thread: Optional[threading.Thread] = None

    def install(self) -> None:
        """Take the signals away from torchrun's agent and handle them here (main thread only)."""
        mine = {s.name for s in self.signals}
        self._previous_env = {k: os.environ.get(k) for k in ("TORCHELASTIC_SIGNALS_TO_HANDLE", NOTICE_ENV, SIGNALS_ENV)}
        current = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", ",".join(TORCHRUN_SIGNALS))
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(
            s for s in (x.strip() for x in current.split(",")) if s and s not in mine
        )
        if self.notice_file is not None:
            os.environ[NOTICE_ENV] = str(self.notice_file)
            os.environ[SIGNALS_ENV] = ",".join(s.name for s in self.signals)
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._thread = threading.Thread(target=self._run, name="oobleck-preempt", daemon=True)
        self._thread.start()

    def uninstall(self) -> None:
        """Give the signals back (docs/recovery.md) and end the thread; idempotent. The handlers
        are restored from the main thread only (Python's rule); elsewhere the environment is."""
        if self._thread is None:
            return
        self._stopped = True
        self._wake.set()
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        for name, value in self._previous_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        self._thread = None

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self._handed_back:  # torchrun's answer to a stop signal (its `_terminate_process_handler`)
            from torch.distributed.elastic.multiprocessing.api import SignalException

            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
        if self.noticed is None:
            self.noticed, self._signal = time.monotonic(), signal.Signals(signum)
            self._wake.set()

    def _hand_back(self) -> None:
        """torchrun's own handling of the noticed signal: deliver it again, now answered as torchrun
        answers it (the agent stops its workers and exits)."""
        assert self._signal is not None
        self._handed_back = True
        os.kill(os.getpid(), self._signal)

    def _run(self) -> None:
        self._wake.wait()
        if self._stopped:
            return
        assert self._signal is not None
        name = self._signal.name
        try:
            applies = self._applies()
        except Exception as err:  # noqa: BLE001 - etcd out of reach: try to drain, the grace still applies
            log.at(node=self.node).warning("preemption notice (%s): cannot tell whether to drain: %s", name, err)
            applies = True
        if not applies:
            log.at(node=self.node).warning(
                "%s: nothing to drain (no worker of this node uses the worker context): stopping now", name
            )
            self._give_up()
            return
        if self.notice_file is not None:  # first: the workers that got the signal too wait for it
            try:
                self.notice_file.write_text(name)
            except OSError as err:
                log.at(node=self.node).warning("cannot record the preemption notice for its workers: %s", err)
        try:
            marked = self._drain(
                f"preemption notice ({name}): hands its layers over and leaves within "
                f"{self.grace_s:g} s (fault_tolerance.preempt_grace_s)"
            )
            log.at(node=self.node).warning(
                "preemption notice (%s): %s",
                name,
                "draining: the node leaves at the next step boundary" if marked else "could not mark the node draining",
            )
        except Exception as err:  # noqa: BLE001 - etcd out of reach: the grace still applies
            log.at(node=self.node).warning("preemption notice (%s): could not mark the node draining: %s", name, err)
        deadline = self.noticed + self.grace_s if self.noticed is not None else time.monotonic()
        while self._alive() and not self._stopped and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._alive() and not self._stopped:
            log.at(node=self.node).error(
                "still running %.0f s after its preemption notice (%s): stopping its workers; the job "
                "handles this as a failure",
                self.grace_s,
                name,
            )
            if self.notice_file is not None:  # the workers die of the SIGTERM torchrun stops them with
                self.notice_file.unlink(missing_ok=True)
            self._give_up()  # torchrun's own handling: its workers are stopped


def guard_worker(environ: Mapping[str, str] = os.environ, *, wait_s: float = WORKER_WAIT_S) -> list[signal.Signals]:
    """In a worker (main thread): a preemption signal that reaches this worker does not kill it when
    its agent recorded a notice within `wait_s` (docs/recovery.md). Returns the signals handled
    (none outside an oobleck agent that watches notices)."""
    path, names = environ.get(NOTICE_ENV), environ.get(SIGNALS_ENV)
    if not path or not names or threading.current_thread() is not threading.main_thread():
        return []
    notice, signals = Path(path), parse_signals([n for n in names.split(",") if n])
    doomed: set[signal.Signals] = set()
    warned: list[bool] = []

    def tolerate(sig: signal.Signals) -> None:
        if not warned:
            warned.append(True)
            log.warning(
                "a preemption notice (%s) reached this worker too: its agent drains the node; the worker "
                "goes on until it has handed its layers over",
                sig.name,
            )

    def decide(sig: signal.Signals) -> None:
        deadline = time.monotonic() + wait_s
        while not notice.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if notice.exists():
            tolerate(sig)
        else:  # not a notice (torchrun stops its workers), or the agent gave up: die of it
            doomed.add(sig)
            os.kill(os.getpid(), sig)

    def on_signal(signum: int, _frame: object) -> None:  # runs in the main thread
        sig = signal.Signals(signum)
        if sig in doomed:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        elif notice.exists():
            tolerate(sig)
        else:
            threading.Thread(target=decide, args=(sig,), name="oobleck-notice", daemon=True).start()

    for sig in signals:
        signal.signal(sig, on_signal)
    return signals
