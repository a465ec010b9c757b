"""Activation checkpointing in a plan: each stage's mode as the planner chose it, and in words.

Under `training.activation_checkpoint: auto` a stage recomputes when the simulated schedule (or,
for 1F1B and GPipe, the template) does not fit its device without; under `none` and `full` every
stage runs that mode. `StagePlacement.activation_checkpoint` carries it to the worker that runs
the stage (engine/stage/build.py). docs/planning.md.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..schedules.cost import ScheduleCost
from ..templates.templates import TemplateSet
from .plan import PipelineSpec, Plan

__all__ = ["recomputed_stages", "stage_mode", "stage_runs", "summary"]


def stage_mode(templates: TemplateSet, cost: Optional[ScheduleCost], device: int, template_choice: bool) -> str:
    """The mode of the stage on `device`: the job's, or under auto the simulated cost's choice
    (its placement's stages), else the template's."""
    if templates.activation_checkpoint != "auto":
        return templates.activation_checkpoint
    if cost is not None:
        return "full" if any(r for r, d in zip(cost.recompute, cost.placement) if d == device) else "none"
    return "full" if template_choice else "none"


def recomputed_stages(pipeline: PipelineSpec) -> list[int]:
    """The indices of the pipeline's stages that recompute."""
    return [s.index for s in pipeline.stages if s.activation_checkpoint == "full"]


def stage_runs(indices: Sequence[int]) -> str:
    """`none`, or runs of stage indices: `0-3,7`."""
    runs: list[list[int]] = []  # [first, last] of each run
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs) or "none"


def summary(plan: Plan, mode: str) -> str:
    """`training.activation_checkpoint` and, under auto, how many stages recompute."""
    if mode != "auto":
        return mode
    chosen = sum(len(recomputed_stages(p)) for p in plan.pipelines)
    stages = sum(len(p.stages) for p in plan.pipelines)
    return f"auto: {chosen} of {stages} stages recompute (full), the others none"
