"""One system's run over time: steps, stalls, checkpoints, rollbacks, and where the time went.

A `Timeline` is advanced from event to event by a system model; every second lies in one
category. The story: docs/simulate.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

CATEGORIES = ("useful", "redundant", "lost", "checkpoint", "reconfiguration", "restart", "stopped")


@dataclass
class Timeline:
    batch: float
    """Samples per step (the global batch)."""
    checkpoint_every: Optional[int] = None
    """Steps between checkpoints (None: no checkpoints)."""
    checkpoint_s: float = 0.0
    """Seconds one checkpoint stalls training."""
    redundant_fraction: float = 0.0
    """Share of training time that is redundant computation (reported apart from useful work)."""
    t: float = 0.0
    """Current time, seconds."""
    rate: float = 0.0
    """Samples per second while training now (0: cannot train)."""
    samples: float = 0.0
    """Samples committed (kept)."""
    breakdown: dict[str, float] = field(default_factory=lambda: {c: 0.0 for c in CATEGORIES})
    """Seconds per category."""
    node_s: float = 0.0
    """Node-seconds of usable nodes over the run (filled by `systems.replay`)."""
    idle_node_s: float = 0.0
    """Of those, node-seconds of nodes that did not train: waiting to be admitted, left out of
    the plan, or all of them while the job stalls or is stopped (filled by `systems.replay`)."""
    counts: dict[str, float] = field(default_factory=dict)
    """What the system did, counted by its model (`OobleckElastic`: `restores` after a lost layer,
    `shadow_recoveries`, `steps_not_redone`, `host_shadow_bytes_per_node`)."""
    curve: list[tuple[float, float]] = field(default_factory=list)
    """(time, committed samples) at every change of state, for the throughput plot: between two
    points the samples grow linearly (whole steps at a constant rate) or not at all."""
    _into_step: float = 0.0
    _steps_since_ckpt: int = 0
    _uncheckpointed_s: float = 0.0  # training time since the last checkpoint (lost on a rollback)
    _busy_until: float = 0.0
    _busy_category: str = "stopped"

    def set_rate(self, samples_per_s: float) -> None:
        """Train at this throughput from now on (0: stopped); the step in flight, if any, must
        have been settled by the system (a new configuration starts a fresh step)."""
        self.rate = max(0.0, samples_per_s)
        self._into_step = 0.0

    def stall(self, seconds: float, category: str) -> None:
        """Nothing trains for `seconds` from now (an event's cost)."""
        assert category in CATEGORIES, category
        self._busy_until = self.t + max(0.0, seconds)  # replaces a stall in progress
        self._busy_category = category

    @property
    def stalled(self) -> bool:
        return self._busy_until > self.t

    @property
    def busy_until(self) -> float:
        """When the current stall ends (<= t: none)."""
        return self._busy_until

    @property
    def steps_since_checkpoint(self) -> int:
        """Committed steps a rollback now would discard."""
        return self._steps_since_ckpt

    @property
    def into_step(self) -> float:
        """Seconds of the step in flight done so far."""
        return self._into_step

    def finish_step_now(self, *, extra_s: float = 0.0) -> None:
        """Complete the step in flight before anything else (it commits), `extra_s` slower (charged
        to reconfiguration): the clock moves on by what it takes."""
        if self.rate <= 0 or self._into_step <= 0:
            return
        self._busy_until = max(self._busy_until, self.t)
        rest = self.batch / self.rate - self._into_step
        self._train(rest)
        self.breakdown["reconfiguration"] += extra_s
        self.t += rest + extra_s
        self._into_step = 0.0
        self.samples += self.batch
        self._steps_since_ckpt += 1
        self.curve.append((self.t, self.samples))

    def lose_partial_step(self) -> float:
        """Discard the step in flight; returns the seconds lost."""
        lost = self._into_step
        self._move("lost", lost)
        self._uncheckpointed_s -= lost
        self._into_step = 0.0
        return lost

    def rollback(self) -> float:
        """Discard everything since the last checkpoint (training time and samples); returns the
        seconds lost."""
        lost = self._uncheckpointed_s  # (includes the step in flight)
        self._move("lost", lost)
        self.samples -= self._steps_since_ckpt * self.batch
        self._steps_since_ckpt, self._uncheckpointed_s, self._into_step = 0, 0.0, 0.0
        self.curve.append((self.t, self.samples))
        return lost

    def _move(self, to: str, seconds: float) -> None:
        """Re-label training time already spent (useful and redundant in their proportions)."""
        if seconds <= 0:
            return
        self.breakdown["useful"] -= seconds * (1 - self.redundant_fraction)
        self.breakdown["redundant"] -= seconds * self.redundant_fraction
        self.breakdown[to] += seconds

    def _train(self, seconds: float) -> None:
        self.breakdown["useful"] += seconds * (1 - self.redundant_fraction)
        self.breakdown["redundant"] += seconds * self.redundant_fraction
        self._uncheckpointed_s += seconds

    def advance(self, until: float) -> None:
        """Run to time `until`: finish the stall, then train (or stay stopped)."""
        while self.t < until - 1e-12:
            if not self.curve or self.curve[-1] != (self.t, self.samples):
                self.curve.append((self.t, self.samples))
            if self._busy_until > self.t:
                end = min(self._busy_until, until)
                self.breakdown[self._busy_category] += end - self.t
                self.t = end
                continue
            if self.rate <= 0:
                self.breakdown["stopped"] += until - self.t
                self.t = until
                break
            step = self.batch / self.rate
            left = until - self.t
            to_finish = step - self._into_step
            if left < to_finish:  # the step stays in flight
                self._train(left)
                self._into_step += left
                self.t = until
                break
            # finish the current step, then as many whole steps as fit before `until` or the checkpoint
            self._train(to_finish)
            self.t += to_finish
            done = 1
            room = self.checkpoint_every - self._steps_since_ckpt - 1 if self.checkpoint_every else math.inf
            whole = int(min(room, max(0.0, (until - self.t) // step)))
            if whole > 0:
                self._train(whole * step)
                self.t += whole * step
                done += whole
            self._into_step = 0.0
            self.samples += done * self.batch
            self._steps_since_ckpt += done
            if self.checkpoint_every and self._steps_since_ckpt >= self.checkpoint_every:
                self._steps_since_ckpt, self._uncheckpointed_s = 0, 0.0
                self.stall(self.checkpoint_s, "checkpoint")
            self.curve.append((self.t, self.samples))

    @property
    def idle_fraction(self) -> float:
        """Share of the usable node-time in which nodes did not train."""
        return self.idle_node_s / self.node_s if self.node_s > 0 else 0.0

    def average_samples_per_s(self) -> float:
        return self.samples / self.t if self.t > 0 else 0.0
