"""Re-splitting the global batch among a plan's pipelines at their measured speeds (stragglers).

Pipeline p with S_p stages and a measured bottleneck of w_p seconds per microbatch (its slowest
stage's compute per microbatch, engine/straggler.py) takes about T_p(b) = (b + S_p - 1) w_p for b
microbatches (1F1B: the first microbatch crosses every stage, the others follow at the
bottleneck's pace). `rebalance` hands the global batch's microbatches out one at a time to the
pipeline that would finish it first, each pipeline keeping at least one: for a makespan of
increasing functions this greedy split is optimal. `rebalanced_plan` turns it into the next
generation's plan on the same nodes, stages and ranks (`Plan.rebalanced`), or None when it would
not shorten the estimated step by at least `MIN_GAIN` (measurement noise must not re-plan every
few steps). Pure numbers: tested on made-up speeds.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Optional, Sequence

from .plan import Plan

__all__ = ["MIN_GAIN", "rebalance", "rebalanced_plan", "step_estimate"]

MIN_GAIN = 0.1
"""A re-split is published only when it shortens the estimated step by at least this fraction."""


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


def rebalanced_plan(plan: Plan, per_mb: Sequence[float], *, min_gain: float = MIN_GAIN) -> Optional[Plan]:
    """The next generation's plan with the microbatches re-split at `per_mb` (seconds per microbatch
    of each pipeline, in plan order), or None: the speeds do not fit the plan, or the split would
    shorten the estimated step by less than `min_gain`."""
    if len(per_mb) != len(plan.pipelines) or any(w <= 0 for w in per_mb):
        return None
    stages = [len(p.stages) for p in plan.pipelines]
    now = [p.microbatches for p in plan.pipelines]
    counts = rebalance(stages, per_mb, sum(now))
    before, after = step_estimate(stages, per_mb, now), step_estimate(stages, per_mb, counts)
    if list(counts) == now or after > (1 - min_gain) * before:
        return None
    pipelines = tuple(dataclasses.replace(p, microbatches=b, est_time_s=(b + s - 1) * w)
                      for p, b, s, w in zip(plan.pipelines, counts, stages, per_mb))
    return dataclasses.replace(plan, generation=plan.generation + 1, pipelines=pipelines, est_step_time_s=after,
                               donors=(), rebalanced=True)
