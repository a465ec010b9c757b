"""The goodput ledger: where a job's wall time went, in seconds per category.

Invariant: every second from the job's start lies in exactly one category, and charges never go
negative. The transitions are pure functions of a ledger and the time; the ledger travels with
the job's progress as rank 0 moves. The story: docs/operations.md.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Mapping, Optional

__all__ = [
    "Category",
    "Ledger",
    "Origin",
    "opening",
    "continue_from",
    "began_step",
    "ended_step",
    "switch",
    "entering",
    "job_origin",
    "describe",
]


class Category(str, Enum):
    """Where a second of the job's wall time went (docs/operations.md)."""

    USEFUL = "useful"
    REPLAYED = "replayed"
    SKIPPED = "skipped"
    SHADOWS = "shadows"
    RECONFIGURATION = "reconfiguration"
    CHECKPOINTING = "checkpointing"
    WAITING = "waiting"
    STARTUP = "startup"


MEANING = {
    Category.USEFUL: "steps applied for the first time, with their bookkeeping",
    Category.REPLAYED: "step runs rejected by the step guard and replayed, or re-run after a checkpoint restore",
    Category.SKIPPED: "step runs whose batch the step guard skipped",
    Category.SHADOWS: "steps' time on the shadow copies' gradient exchange (fault_tolerance.shadow_copies)",
    Category.RECONFIGURATION: "failures, joins and drains: from the step they interrupted to the next first step",
    Category.CHECKPOINTING: "writing checkpoints",
    Category.WAITING: "from the job's start to the first plan (nodes registering, the rendezvous)",
    Category.STARTUP: "from the first plan to the first step (workers starting, entering generation 1)",
}
"""One line per category for `describe`."""


@dataclass(frozen=True)
class Ledger:
    """The job's wall time accounted up to `at`, in seconds per category."""

    start: float
    """Unix time the job started (its first event in etcd)."""
    at: float
    """Unix time up to which the seconds are accounted."""
    seconds: Mapping[str, float] = field(default_factory=dict)
    """Seconds per `Category` value (categories with none are absent)."""
    open: Optional[Category] = Category.STARTUP
    """The category the time after `at` goes to, or None while a step runs (its category is known
    when it ends: applied, replayed or skipped)."""
    done: int = 0
    """Steps completed so far in the job (applied or skipped): an applied step below it is a re-run."""

    def get(self, category: Category) -> float:
        return self.seconds.get(category.value, 0.0)

    @property
    def total(self) -> float:
        """Seconds accounted (the sum of the categories: `at - start` for a ledger kept without a gap)."""
        return sum(self.seconds.values())

    @property
    def fraction(self) -> float:
        """Useful seconds over all seconds accounted (0 before any)."""
        return self.get(Category.USEFUL) / self.total if self.total > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """The value sent with progress (the open interval is not sent: a successor's starts as
        `reconfiguration`)."""
        return {
            "start": self.start,
            "at": self.at,
            "done": self.done,
            "seconds": {c.value: round(self.get(c), 6) for c in Category},
        }

    @classmethod
    def from_json(cls, data: Any) -> "Ledger":
        """Validate a reported ledger; raises ValueError naming what is wrong."""
        try:
            start, at, done, seconds = float(data["start"]), float(data["at"]), data["done"], data["seconds"]
            if not isinstance(done, int) or done < 0 or not isinstance(seconds, dict):
                raise ValueError(f"done {done!r} must be an integer >= 0 and seconds a mapping")
            known = {c.value for c in Category}
            out = {str(k): float(v) for k, v in seconds.items()}
            bad = [k for k, v in out.items() if k not in known or not math.isfinite(v) or v < 0]
            if bad or not (math.isfinite(start) and math.isfinite(at)) or at < start:
                raise ValueError(f"unknown or negative categories {bad}, or at {at} before start {start}")
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"not a goodput ledger ({type(err).__name__}: {err})") from None
        return cls(start=start, at=at, seconds=out, open=Category.RECONFIGURATION, done=done)


@dataclass(frozen=True)
class Origin:
    """What a worker that enters a generation as rank 0 continues from (`ControlPlane.goodput_origin`)."""

    reported: Optional[Ledger]
    """The ledger last reported with the job's progress (None: no step reported yet)."""
    start: Optional[float] = None
    """Unix time the job started (its first event); read only when nothing was reported."""
    first_plan: Optional[float] = None
    """Unix time the first plan was published; read only when nothing was reported."""


# ---------------------------------------------------------------------------- pure transitions
def _charge(ledger: Ledger, category: Category, until: float) -> Ledger:
    """The interval from `ledger.at` to `until` charged to `category` (nothing when the clock went back)."""
    if until <= ledger.at:
        return ledger
    seconds = dict(ledger.seconds)
    seconds[category.value] = seconds.get(category.value, 0.0) + (until - ledger.at)
    return dataclasses.replace(ledger, seconds=seconds, at=until)


def opening(start: float, first_plan: Optional[float]) -> Ledger:
    """A new ledger at the job's start: the wait for the first plan is `waiting`, and the time
    after it `startup` (until the first step begins)."""
    ledger = Ledger(start=start, at=start, open=Category.WAITING)
    if first_plan is not None:
        ledger = _charge(ledger, Category.WAITING, first_plan)
    return dataclasses.replace(ledger, open=Category.STARTUP)


def switch(ledger: Ledger, now: float, to: Category) -> Ledger:
    """The open interval ends at `now` (charged to its category) and one of `to` begins."""
    if ledger.open is not None:
        ledger = _charge(ledger, ledger.open, now)
    return dataclasses.replace(ledger, open=to)


def began_step(ledger: Ledger, now: float) -> Ledger:
    """A step begins at `now`; the interval before it ends (its bookkeeping, a reconfiguration,
    the startup)."""
    ledger = switch(ledger, now, Category.USEFUL)
    return dataclasses.replace(ledger, open=None)


def ended_step(ledger: Ledger, now: float, step: int, outcome: Category, shadows_s: float = 0.0) -> Ledger:
    """Step `step` (0-based), begun at `ledger.at`, ended at `now`: `outcome` is USEFUL when it was
    applied (REPLAYED when the job had completed it before), REPLAYED or SKIPPED when the step guard
    rejected it. `shadows_s` of the step (at most all of it) went to the shadow copies' exchange:
    `shadows`; the rest to `outcome`. The bookkeeping after it is `useful` until the next transition."""
    counts = outcome in (Category.USEFUL, Category.SKIPPED)  # the step is done (a guard replay is not)
    if outcome is Category.USEFUL and step < ledger.done:
        outcome = Category.REPLAYED
    done = max(ledger.done, step + 1) if counts else ledger.done
    if shadows_s > 0 and now > ledger.at:
        ledger = _charge(ledger, Category.SHADOWS, ledger.at + min(shadows_s, now - ledger.at))
    ledger = _charge(ledger, outcome, now)
    return dataclasses.replace(ledger, open=Category.USEFUL, done=done)


def entering(ledger: Ledger) -> Ledger:
    """This worker, holding its own ledger, entered a new generation: the open interval (the step
    a failure interrupted, or the wait since the last step boundary) is `reconfiguration` until
    the next step begins; before the job's first step it stays `startup`."""
    open_ = Category.STARTUP if ledger.open is Category.STARTUP else Category.RECONFIGURATION
    return dataclasses.replace(ledger, open=open_)


def continue_from(own: Optional[Ledger], origin: Origin, now: float) -> Ledger:
    """The ledger of a worker that entered a generation as rank 0 at `now`: its own when it held
    rank 0 until now (and nobody reported a newer one), else the last reported one (the gap since
    its `at` is `reconfiguration`), else a new one at the job's start."""
    reported = origin.reported
    if own is not None and (reported is None or reported.at <= own.at):
        return entering(own)
    if reported is not None:
        return dataclasses.replace(reported, open=Category.RECONFIGURATION)
    return opening(origin.start if origin.start is not None else now, origin.first_plan)


def job_origin(events: Iterable[tuple[float, str, Optional[int]]]) -> tuple[Optional[float], Optional[float]]:
    """(the job's start, the first plan's publication) from its events as (time, kind, generation):
    the first event of any kind, and the first `plan` event."""
    start = first_plan = None
    for t, kind, _generation in events:
        start = t if start is None else min(start, t)
        if kind == "plan":
            first_plan = t if first_plan is None else min(first_plan, t)
    return start, first_plan


# ---------------------------------------------------------------------------- the report
def describe(ledger: Ledger, *, start: float, end: float, closed: bool) -> list[str]:
    """`oobleck goodput`: one line per category with its share of the wall time from `start` (the
    job's first event) to `end` (its `closed` record, or now while it runs), then the sum."""
    wall = max(end - start, 0.0)

    def share(seconds: float) -> str:
        return f"{100 * seconds / wall:6.1f} %" if wall > 0 else "     - %"

    until = "closed" if closed else "now (running)"
    out = [f"wall time {wall:.2f} s, from the job's start {_stamp(start)} to {until} {_stamp(end)}"]
    for c in Category:
        out.append(f"  {c.value:<16} {ledger.get(c):10.2f} s {share(ledger.get(c))}  {MEANING[c]}")
    gap = end - ledger.at
    out.append(
        f"  {'sum':<16} {ledger.total:10.2f} s {share(ledger.total)}  accounted up to the last report, "
        f"{gap:.2f} s before the {'close' if closed else 'time of reading'}"
    )
    out.append(
        f"goodput: {100 * ledger.fraction:.1f} % of the time accounted went to useful steps "
        f"({ledger.done} step(s) completed)"
    )
    return out


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"
