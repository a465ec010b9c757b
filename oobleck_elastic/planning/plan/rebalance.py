"""Mitigating a straggler: re-split the global batch at the pipelines' measured speeds, or leave it out.

Pipeline p of S_p stages with a measured bottleneck w_p per microbatch takes about
(b + S_p - 1) w_p for b microbatches; `rebalance` hands microbatches out one at a time to the
pipeline that would finish first (optimal for increasing functions). `mitigate` weighs the
re-split against the planner's plan without the stragglers, on the measured scale; either is
applied only when it shortens the step by `MIN_GAIN`, leaving nodes out only when it beats the
re-split by as much. docs/planning.md.
"""

from __future__ import annotations

import dataclasses
import heapq
import statistics
from dataclasses import dataclass
from typing import Collection, Optional, Sequence

from .plan import Plan

__all__ = ["MIN_GAIN", "Remedy", "mitigate", "rebalance", "rebalanced_plan", "step_estimate"]

MIN_GAIN = 0.1
"""A remedy is applied only when it shortens the estimated step by at least this fraction."""


def step_estimate(stages: Sequence[int], per_mb: Sequence[float], microbatches: Sequence[int]) -> float:
    """The step's estimated time: the slowest pipeline's (b + S - 1) x w."""
    return max((b + s - 1) * w for s, w, b in zip(stages, per_mb, microbatches, strict=True))


def rebalance(stages: Sequence[int], per_mb: Sequence[float], total: int) -> tuple[int, ...]:
    """`total` microbatches split among pipelines of `stages` stages and `per_mb` measured seconds
    per microbatch, at least one each, minimising the estimated step (ties to the lower index)."""
    if total < len(stages):
        raise ValueError(f"{total} microbatches cannot give {len(stages)} pipelines one each")
    counts = [1] * len(stages)
    heap = [((2 + s - 1) * w, i) for i, (s, w) in enumerate(zip(stages, per_mb, strict=True))]
    heapq.heapify(heap)
    for _ in range(total - len(stages)):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, ((counts[i] + 1 + stages[i] - 1) * per_mb[i], i))
    return tuple(counts)


def _fits(plan: Plan, per_mb: Sequence[float]) -> bool:
    return len(per_mb) == len(plan.pipelines) and all(w > 0 for w in per_mb)


def _resplittable(plan: Plan) -> bool:
    """Every pipeline runs 1F1B or GPipe: any microbatch count runs, at the model above. Interleaved
    and zero-bubble schedules run microbatches in rounds (planning/schedules/schedules.py), so a re-split
    could hand a pipeline a count its schedule cannot run; those plans are not re-split."""
    return all(p.schedule in ("1f1b", "gpipe") for p in plan.pipelines)


def rebalanced_plan(plan: Plan, per_mb: Sequence[float], *, min_gain: float = MIN_GAIN) -> Optional[Plan]:
    """The next generation's plan with the microbatches re-split at `per_mb` (seconds per microbatch
    of each pipeline, in plan order), or None: the speeds do not fit the plan, or the split would
    shorten the estimated step by less than `min_gain`, or a pipeline runs a schedule in rounds
    (`_resplittable`)."""
    if not _fits(plan, per_mb) or not _resplittable(plan):
        return None
    stages = [len(p.stages) for p in plan.pipelines]
    now = [p.microbatches for p in plan.pipelines]
    counts = rebalance(stages, per_mb, sum(now))
    before, after = step_estimate(stages, per_mb, now), step_estimate(stages, per_mb, counts)
    if list(counts) == now or after > (1 - min_gain) * before:
        return None
    pipelines = tuple(
        dataclasses.replace(p, microbatches=b, est_time_s=p.est_time_s * (b + s - 1) / (p.microbatches + s - 1))
        for p, b, s in zip(plan.pipelines, counts, stages)
    )
    return dataclasses.replace(
        plan,
        generation=plan.generation + 1,
        pipelines=pipelines,
        est_step_time_s=max(p.est_time_s for p in pipelines),
        donors=(),
        rebalanced=True,
    )


@dataclass(frozen=True)
class Remedy:
    """What `mitigate` chose, with the estimates it compared (measured scale, seconds per step)."""

    plan: Optional[Plan]
    """The re-split plan to publish as it is, or None."""
    leave_out: tuple[str, ...] = ()
    """Or: the stragglers to leave out of the plan (the leader re-plans without them)."""
    now_s: float = 0.0
    split_s: Optional[float] = None
    without_s: Optional[float] = None

    def describe(self) -> str:
        parts = [f"the step now {self.now_s:.4f} s"]
        if self.split_s is not None:
            parts.append(f"re-split {self.split_s:.4f} s")
        if self.without_s is not None:
            parts.append(f"without the straggler(s) {self.without_s:.4f} s")
        return ", ".join(parts)


def mitigate(
    plan: Plan,
    per_mb: Sequence[float],
    slow: Collection[str],
    without: Optional[Plan] = None,
    *,
    min_gain: float = MIN_GAIN,
) -> Optional[Remedy]:
    """The better of re-splitting `plan` at `per_mb` and the plan `without` the `slow` nodes (module
    docstring), or None when neither shortens the estimated step by `min_gain`."""
    if not _fits(plan, per_mb):
        return None
    stages = [len(p.stages) for p in plan.pipelines]
    now_s = step_estimate(stages, per_mb, [p.microbatches for p in plan.pipelines])
    split = rebalanced_plan(plan, per_mb, min_gain=0.0)
    split_s = step_estimate(stages, per_mb, [p.microbatches for p in split.pipelines]) if split else None
    without_s = None
    healthy = [
        (b + s - 1) * w / p.est_time_s
        for p, s, w, b in zip(plan.pipelines, stages, per_mb, [p.microbatches for p in plan.pipelines])
        if p.est_time_s > 0 and not set(p.nodes) & set(slow)
    ]
    if without is not None and healthy and without.est_step_time_s > 0:
        without_s = without.est_step_time_s * statistics.median(healthy)
    # leaving nodes out costs capacity and replicas: it must beat the re-split by min_gain too
    leave = without_s is not None and (split_s is None or without_s <= (1 - min_gain) * split_s)
    best_s = without_s if leave else split_s
    if best_s is None or best_s > (1 - min_gain) * now_s:
        return None
    if leave:
        return Remedy(plan=None, leave_out=tuple(sorted(slow)), now_s=now_s, split_s=split_s, without_s=without_s)
    return Remedy(plan=split, now_s=now_s, split_s=split_s, without_s=without_s)
