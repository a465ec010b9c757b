"""A step's writes to the worker state (`StepApplier`): the update applied after the commit (on the
shadow copies too), the step guard's verdict settled, a twice-rejected step skipped.

Invariant: a step writes the `WorkerState` only while it is current. A step may run in a thread
the control plane abandons (engine/worker.py): `abandon` bumps the epoch, a step of an older
epoch raises `StepAbandoned` instead of writing, and the next generation works on copies of the
kept layers (`detach_kept`). A non-finite norm is never applied, a roll-forward included.
docs/recovery.md.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator, Optional

from ...config import JobConfig
from ..resilience.errors import StepAbandoned
from ..resilience.guard import Verdict
from .optim import apply_update
from .state import WorkerState

__all__ = ["StepApplier"]


class StepApplier:
    """The worker state's writes by a step, each only while the step's epoch is current (module docstring)."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.lock = threading.Lock()
        self.epoch = 0
        """Grows at every abandonment (`abandon`): a step started in an older one writes nothing."""
        self.detach_kept = False
        """The next generation works on copies of the layers it keeps (set by `abandon`)."""

    @contextlib.contextmanager
    def current(self, epoch: int) -> Iterator[None]:
        """Hold the state lock, or raise StepAbandoned when the step of `epoch` was abandoned."""
        with self.lock:
            if self.epoch != epoch:
                raise StepAbandoned(f"the step of epoch {epoch} was abandoned (now {self.epoch})")
            yield

    def abandon(self) -> None:
        """The running step was abandoned: it writes nothing any more, and the next generation
        works on copies of the layers it keeps."""
        with self.lock:
            self.epoch += 1
            self.detach_kept = True

    def apply(self, state: WorkerState, step: int, norm2: float, epoch: Optional[int] = None) -> None:
        """Apply step `step`, whose global squared gradient norm is `norm2` (the current epoch's
        when `epoch` is None: a roll-forward)."""
        with self.current(self.epoch if epoch is None else epoch):
            assert state.optimizer is not None
            shadows = state.shadows
            if not math.isfinite(norm2):  # never applied (engine/resilience/guard.py), a roll-forward included
                state.optimizer.zero_grad(set_to_none=True)
                if shadows is not None:
                    shadows.discard()
                return
            apply_update(state.optimizer, state.params, step, norm2, self.cfg.training)
            if shadows is not None:  # the same update on the shadow copies this worker keeps
                shadows.apply(step, norm2, self.cfg, background=True)
            state.committed_step = step

    def settle(self, state: WorkerState, verdict: Verdict, loss: float, running_max: float, epoch: int) -> None:
        """The step guard's verdict on `state` (engine/resilience/guard.py): an applied step raises
        the running maximum of the loss; a rejected one is neither committed nor kept for a
        roll-forward, and its gradients are dropped."""
        with self.current(epoch):
            if verdict.apply:
                state.max_loss = max(running_max, loss)
            else:
                state.max_loss = running_max
                state.synced_step = state.committed_step
                assert state.optimizer is not None
                state.optimizer.zero_grad(set_to_none=True)
                if state.shadows is not None:
                    state.shadows.discard()

    def skip(self, state: WorkerState, step: int) -> None:
        """Count `step` as done with no update: the step guard rejected it twice (engine/resilience/guard.py)."""
        with self.lock:
            assert state.optimizer is not None
            state.optimizer.zero_grad(set_to_none=True)
            state.committed_step = state.synced_step = step
            if state.shadows is not None:
                state.shadows.skip(step)
