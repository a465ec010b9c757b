"""Shadow copies in the simulator: which simultaneous losses they turn from a checkpoint restore
into a re-plan, and what they cost when nothing fails.

The story: docs/simulate.md (the shadows themselves: docs/shadows.md).
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache
from typing import Optional, Sequence

from ..planning.plan.plan import PipelineSpec, Plan, ShadowPlacement, StagePlacement, device_holders
from ..planning.tolerance.shadows import place_shadows, survives

SHADOW_STEP_OVERHEAD = 0.014
"""Failure-free step-time overhead of one shadow copy of every layer (fault_tolerance.shadow_copies
= 1): step_s(shadows) / step_s(none) - 1 as `bench/shadows.py` measures it (bench/RESULTS.md,
"Figures moved from code comments", names the run). A model
with more parameters per second of compute pays more (the traffic and the host update scale with
the parameters, the step with the tokens): pass `--shadow-overhead` for another."""

UNIT_BYTES = 2**30
"""Bytes of a whole replica in the segment plan when the model's size is unknown (only the
segments' relative sizes matter for the placement)."""

_NO_LIMIT = 2**62  # host memory is reported, not charged: no budget refuses a shadow


def segment_plan(configured: Sequence[str], sizes: Sequence[int], num_layers: int = 0) -> tuple[Plan, list[Fraction]]:
    """The configuration as a `Plan` of segments (docs/simulate.md), and each segment's share of
    the model. Pipelines take `configured` in order, `sizes[i]` nodes each; `num_layers`: the
    model's layers (0: unknown)."""
    if sum(sizes) > len(configured) or any(k <= 0 for k in sizes):
        raise ValueError(f"pipelines of {list(sizes)} nodes do not fit {len(configured)} configured nodes")
    cuts = set(sizes) | ({num_layers} if num_layers > 0 else set())
    bounds = sorted({Fraction(i, k) for k in cuts for i in range(k + 1)})
    index = {b: j for j, b in enumerate(bounds)}
    pipelines = []
    cursor = rank = 0
    for p, k in enumerate(sizes):
        nodes = tuple(configured[cursor : cursor + k])
        cursor += k
        stages = []
        for i, node in enumerate(nodes):
            start, end = index[Fraction(i, k)], index[Fraction(i + 1, k)]
            stages.append(StagePlacement(index=i, start=start, end=end, node=node, local_rank=0, rank=rank))
            rank += 1
        pipelines.append(
            PipelineSpec(index=p, template_nodes=k, nodes=nodes, microbatches=1, stages=tuple(stages), est_time_s=0.0)
        )
    used = tuple(configured[:cursor])
    plan = Plan(
        generation=0,
        nodes=used,
        spares=(),
        gpus_per_node=1,
        num_layers=len(bounds) - 1,
        microbatch_size=1,
        pipelines=tuple(pipelines),
        est_step_time_s=0.0,
        f=len(sizes) - 1,
    )
    return plan, [b - a for a, b in zip(bounds, bounds[1:])]


def shadow_placement(
    plan: Plan, shares: Sequence[Fraction], copies: int, replica_bytes: float = 0.0
) -> Optional[ShadowPlacement]:
    """`copies` shadows of every segment by the planner's `place_shadows` (fewer where fewer
    nodes do not hold some segment, as the engine keeps as many as fit; None when none fit).
    `replica_bytes`: one replica's parameters and optimizer state (0: unknown)."""
    held = device_holders(plan)
    fit = min((len(plan.nodes) - len(h) for h in held), default=0)
    copies = min(copies, fit)
    if copies <= 0:
        return None
    whole = replica_bytes if replica_bytes > 0 else UNIT_BYTES
    sizes = [max(1, int(share * Fraction(whole))) for share in shares]
    return place_shadows(plan, copies, sizes, _NO_LIMIT, budget_source="the simulator (not charged)")


def loss_outcome(
    configured: Sequence[str], sizes: Sequence[int], removed: Sequence[str], copies: int, num_layers: int = 0
) -> str:
    """What losing `removed` at once from the configuration does: `replica`, `shadow` or
    `restore` (docs/simulate.md), with `copies` shadows of every layer."""
    plan, shares = segment_plan(configured, sizes, num_layers)
    if survives(plan, None, removed):
        return "replica"
    placement = shadow_placement(plan, shares, copies) if copies > 0 else None
    if placement is not None and survives(plan, placement, removed):
        return "shadow"
    return "restore"


def host_bytes_per_node(
    configured: Sequence[str], sizes: Sequence[int], copies: int, replica_bytes: float, num_layers: int = 0
) -> int:
    """The most host memory the shadows take on one node of the configuration (0 without any)."""
    if copies <= 0 or not sizes:
        return 0
    return _host_bytes(tuple(configured), tuple(sizes), copies, replica_bytes, num_layers)


@lru_cache(maxsize=16)  # the same start for every checkpoint interval the scale study tries
def _host_bytes(
    configured: tuple[str, ...], sizes: tuple[int, ...], copies: int, replica_bytes: float, layers: int
) -> int:
    plan, shares = segment_plan(configured, sizes, layers)
    placement = shadow_placement(plan, shares, copies, replica_bytes)
    return max(placement.load().values()) if placement is not None else 0


def step_overhead(copies: int, per_copy: float = SHADOW_STEP_OVERHEAD) -> float:
    """The failure-free step-time overhead of `copies` shadow copies of every layer (a fraction)."""
    if copies < 0 or per_copy < 0:
        raise ValueError(
            f"shadow copies must be >= 0 and their step overhead (--shadow-overhead) a fraction >= 0 "
            f"(got {copies} and {per_copy:g})"
        )
    return copies * per_copy
