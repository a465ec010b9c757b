"""The step guard: a step whose loss or gradient norm is not finite, or whose loss spikes
(`fault_tolerance.loss_spike_factor` times the largest applied loss), is never applied; it is
replayed once, then skipped (`StepGuard`); too many skipped in a row fail the job.

Invariant: every worker reaches the same verdict at the same step with no collective of its own:
`judge` is a pure function of the global loss and norm and of the running maximum of the loss,
which rides on the commit (engine/step/commit.py). A rejected step is neither committed nor kept
for a roll-forward, so an entry after a failure replays it. docs/recovery.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping
from enum import Enum

__all__ = ["Verdict", "judge", "GuardDecision", "StepGuard", "TooManySkipped"]


@dataclass(frozen=True)
class Verdict:
    apply: bool
    """Whether the step may be applied."""
    reason: str = ""
    """Why not (empty when it may)."""


def judge(loss: float, norm2: float, *, running_max: float, spike_factor: float) -> Verdict:
    """The verdict on a step from its global loss, squared gradient norm and the largest loss of any
    applied step so far (0: none yet)."""
    if not math.isfinite(loss):
        return Verdict(False, f"the loss is {loss}")
    if not math.isfinite(norm2):
        return Verdict(False, f"the gradient norm is {math.sqrt(norm2) if norm2 > 0 else norm2}")
    if spike_factor > 0 and running_max > 0 and loss > spike_factor * running_max:
        return Verdict(
            False, f"loss spike: {loss:.4g} > {spike_factor:g} x the largest loss so far ({running_max:.4g})"
        )
    return Verdict(True)


class GuardDecision(Enum):
    """What `StepGuard.decide` makes of a verdict: apply the step, replay it, or skip its batch."""

    APPLY = "apply"
    REPLAY = "replay"
    SKIP = "skip"


class TooManySkipped(RuntimeError):
    """`fault_tolerance.max_skipped_steps` steps in a row were skipped: the job stops as failed."""


@dataclass
class StepGuard:
    """What follows a verdict, a pure state machine: the first rejection of a step replays it on
    the same batch (a transient fault does not recur); a second skips the batch: the step counts
    as done with no update, the learning-rate schedule does not shift. `max_skipped` skips in a
    row stop the job, naming the steps. Its state goes in the checkpoint manifest (`extra.guard`),
    so a resumed job's skip history goes on from the checkpoint's."""

    max_skipped: int
    """Skips in a row that stop the job."""
    attempts: dict[int, int] = field(default_factory=dict)
    """Rejections so far, by step."""
    skipped: list[int] = field(default_factory=list)
    """Every step skipped, in order."""
    in_a_row: list[int] = field(default_factory=list)
    """The steps skipped since the last applied one."""

    def decide(self, step: int, verdict: Verdict) -> GuardDecision:
        """APPLY, REPLAY (the first rejection of `step`) or SKIP; raises TooManySkipped when this skip
        makes `max_skipped` in a row."""
        if verdict.apply:
            self.in_a_row.clear()
            return GuardDecision.APPLY
        self.attempts[step] = self.attempts.get(step, 0) + 1
        if self.attempts[step] == 1:
            return GuardDecision.REPLAY
        self.skipped.append(step)
        self.in_a_row.append(step)
        if len(self.in_a_row) >= self.max_skipped:
            raise TooManySkipped(
                f"{len(self.in_a_row)} steps in a row were not applied (steps {self.in_a_row}, the "
                f"last because {verdict.reason}; fault_tolerance.max_skipped_steps="
                f"{self.max_skipped}): lower the learning rate or check the data of those steps"
            )
        return GuardDecision.SKIP

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the skipped steps (all, and those since the last applied one).
        Rejections of steps not yet applied are not kept: a resumed job judges them afresh."""
        return {"skipped": list(self.skipped), "in_a_row": list(self.in_a_row)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Back to a checkpoint's state (a checkpoint without one: nothing skipped)."""
        self.skipped = [int(s) for s in state.get("skipped", [])]
        self.in_a_row = [int(s) for s in state.get("in_a_row", [])]
        self.attempts = {}
