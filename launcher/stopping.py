"""A Ctrl-C (SIGINT) or SIGTERM to the local launcher stops the job instead of killing it.

The first signal asks the job to stop (`oobleck_elastic.cluster_ops.stop_job`): every worker
finishes the step in flight, saves it as a checkpoint and exits 0, and the job closes as stopped.
Nodes still running `grace_s` later (the job's `fault_tolerance.preempt_grace_s`) are killed;
a second signal kills them at once. The launcher's `done:` line then names the newest complete
checkpoint. The story: docs/running.md.
"""

from __future__ import annotations

import signal
import time
from typing import Callable, Optional

from oobleck_elastic.checkpoint import latest_checkpoint
from oobleck_elastic.cluster_ops import stop_job
from oobleck_elastic.etcd import EtcdClient, EtcdError
from oobleck_elastic.records.keys import Keys

__all__ = ["Interrupt"]


class Interrupt:
    """What the launcher does with a stop signal (module docstring)."""

    def __init__(self, *, grace_s: float, checkpoint_dir: Optional[str], say: Callable[[str], None]) -> None:
        self.grace_s, self.checkpoint_dir, self.say = grace_s, checkpoint_dir, say
        self.signal: Optional[signal.Signals] = None
        """The first stop signal received, once one was."""
        self.running = False
        """The job's nodes run and the launcher watches them: a first signal can ask them to stop."""
        self._deadline: Optional[float] = None

    @property
    def name(self) -> str:
        return "Ctrl-C (SIGINT)" if self.signal is signal.SIGINT else (self.signal.name if self.signal else "")

    def received(self, signum: int) -> bool:
        """A stop signal arrived: True when it asks the job to stop (the first while nodes run),
        False when every node must stop now (a second one, or nothing runs yet)."""
        if self.signal is not None or not self.running:
            self.say(f"{signal.Signals(signum).name}: stopping every node now")
            return False
        self.signal = signal.Signals(signum)
        self.say(
            f"{self.name}: the job stops at its next step boundary and saves that step (up to {self.grace_s:g}s, "
            "fault_tolerance.preempt_grace_s); press Ctrl-C again to stop every node now"
        )
        return True

    def due(self, client: EtcdClient, keys: Keys) -> bool:
        """Called while nodes run: ask the job to stop once a signal arrived; True when the grace
        ran out (or the job could not be asked) and the nodes must be killed."""
        if self.signal is None or self._deadline == float("inf"):
            return False
        if self._deadline is None:
            self._deadline = time.monotonic() + self.grace_s
            try:
                self.say(stop_job(client, keys, f"{self.name} to the local launcher"))
            except EtcdError as err:
                self.say(f"could not ask the job to stop ({err}): stopping every node")
                self._deadline = float("inf")
                return True
        if time.monotonic() > self._deadline:
            self.say(
                f"the job did not stop within {self.grace_s:g}s of the {self.name} (fault_tolerance.preempt_grace_s): "
                "stopping every node"
            )
            self._deadline = float("inf")
            return True
        return False

    def summary(self) -> str:
        """What the `done:` line adds after a stop signal: the newest complete checkpoint."""
        if self.signal is None:
            return ""
        if not self.checkpoint_dir:
            where = "unknown (the script names no config)"
        else:
            newest = latest_checkpoint(self.checkpoint_dir)
            where = str(newest) if newest is not None else f"none in {self.checkpoint_dir}"
        return f"; stopped on request ({self.name}); newest complete checkpoint: {where}"
