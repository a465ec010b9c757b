"""Preemption notices: a signal to a node's agent drains the node instead of failing it.

Slurm, Kubernetes and spot reclaims send SIGTERM (or a signal chosen in advance, e.g. Slurm's
`--signal=USR1@90`) some time before they kill a node. By default torchrun's agent turns SIGTERM
into an exception that kills its workers: the job then re-plans around a failure, and when the
node held the last copies of some layers it needs a checkpoint.

`PreemptionWatch` takes `fault_tolerance.preempt_signals` away from torchrun (it removes them
from `TORCHELASTIC_SIGNALS_TO_HANDLE`, the list torchrun's agent installs its own handler for
when it starts workers) and handles them itself:

1. On the first notice it marks the node `draining` (`membership.mark_draining`, the same
   compare-and-swap under the node's lease as `oobleck kill-agent`) and records a `drain` event
   naming the signal. A Python signal handler only sets a flag; a thread does the etcd writes.
2. The leader re-plans without the node at the next step boundary; when the node holds layers
   nobody else holds, the plan names it a donor and its workers hand their layers and optimizer
   state over before they leave (engine/generation.py). Its workers exit 0, and so does its agent.
3. If the node is still there `fault_tolerance.preempt_grace_s` after the notice (the job is
   stuck, or the grace was too short), the watch hands the signal back to torchrun's handling
   (SIGINT to its own agent): the workers are killed and the job handles it as a failure.

Later notices while draining are ignored. The launcher's `--preempt NODE@STEP[:GRACE]` sends
SIGTERM to a node's agent at a step, as a scheduler would.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable, Optional, Sequence


from ..logs import JobLog
from ..config import parse_signals

__all__ = ["TORCHRUN_SIGNALS", "parse_signals", "PreemptionWatch"]

log = JobLog(logging.getLogger(__name__))

TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
"""What torchrun's agent handles when TORCHELASTIC_SIGNALS_TO_HANDLE is unset."""


class PreemptionWatch:
    """Drains this node when one of `signals` arrives (module docstring)."""

    def __init__(
        self,
        signals: Sequence[signal.Signals],
        *,
        grace_s: float,
        node: str,
        drain: Callable[[str], bool],
        alive: Callable[[], bool],
        give_up: Optional[Callable[[], None]] = None,
    ) -> None:
        """`drain(detail)` marks the node draining; `alive()` says whether the agent still runs;
        `give_up()` hands the node to torchrun's own handling (default: SIGINT to this process)."""
        self.signals, self.grace_s, self.node = list(signals), grace_s, node
        self._drain, self._alive = drain, alive
        self._give_up = give_up or (lambda: os.kill(os.getpid(), signal.SIGINT))
        self.noticed: Optional[float] = None
        """Monotonic time of the first notice."""
        self._wake = threading.Event()
        self._signal: Optional[signal.Signals] = None

    def install(self) -> None:
        """Take the signals away from torchrun's agent and handle them here (main thread only)."""
        mine = {s.name for s in self.signals}
        current = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", ",".join(TORCHRUN_SIGNALS))
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(
            s for s in (x.strip() for x in current.split(",")) if s and s not in mine
        )
        for sig in self.signals:
            signal.signal(sig, self._on_signal)
        threading.Thread(target=self._run, name="oobleck-preempt", daemon=True).start()

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.noticed is None:
            self.noticed, self._signal = time.monotonic(), signal.Signals(signum)
            self._wake.set()

    def _run(self) -> None:
        self._wake.wait()
        assert self._signal is not None
        name = self._signal.name
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
        while self._alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._alive():
            log.at(node=self.node).error(
                "still running %.0f s after its preemption notice (%s): stopping its workers; the job "
                "handles this as a failure",
                self.grace_s,
                name,
            )
            self._give_up()  # torchrun's own handling: its workers are stopped
