"""What a loss would do, asked before it happens: `oobleck plan --previous PLAN.json --lose NODE,...`.

The survivors of a plan are re-planned as the leader would (`plan_job` with the previous plan,
so the move-aware choice of `planning.replan_tolerance` applies), beside the fastest plan for
them; the report counts the pipelines with a node that receives layers and names the bytes each
node would receive. docs/planning.md ("Move-aware re-planning").
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from ..config import JobConfig
from .errors import PlanningError
from .job import plan_job
from .plan.placement import bytes_received, shard_bytes_of
from .plan.plan import Plan
from .profile.profile import ModelProfile

__all__ = ["LossPreview", "format_preview", "preview_loss", "read_plan"]


def read_plan(path: str | Path) -> Plan:
    """A plan from a JSON file: a plan object, or the object `oobleck plan --json` prints (its
    `plan` key)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise PlanningError(f"--previous {path}: cannot read a plan JSON ({err})") from None
    if isinstance(data, dict) and isinstance(data.get("plan"), dict):
        data = data["plan"]
    if not isinstance(data, dict):
        raise PlanningError(f"--previous {path}: not a plan JSON object")
    return Plan.from_json(data)


@dataclass(frozen=True)
class LossPreview:
    """The re-plan after a loss, beside the fastest plan for the same survivors."""

    lost: tuple[str, ...]
    plan: Plan
    """The plan the leader would publish (move-aware under planning.replan_tolerance)."""
    fastest: Plan
    """The fastest plan for the survivors (tolerance 0)."""
    received: dict[str, int]
    """node -> bytes its workers would receive entering `plan`."""
    fastest_received: dict[str, int]
    formed: tuple[int, ...]
    """Indexes of `plan`'s pipelines with a node that receives layers (the others' nodes all
    keep theirs; a pipeline may still group them anew, which moves nothing)."""


def preview_loss(
    cfg: JobConfig, profiles: Mapping[int, ModelProfile], previous: Plan, lose: Sequence[str]
) -> LossPreview:
    """Re-plan `previous` without the nodes `lose` (module docstring)."""
    unknown = [n for n in lose if n not in previous.nodes]
    if unknown or not lose:
        raise PlanningError(
            f"--lose {','.join(lose)}: "
            + (f"{', '.join(unknown)} not in the previous plan" if unknown else "name at least one node")
            + f" (its nodes: {', '.join(previous.nodes[:8])}{', ...' if len(previous.nodes) > 8 else ''})"
        )
    lost = set(lose)
    survivors = [n for n in previous.nodes if n not in lost]
    profile = profiles.get(previous.tensor_parallel)
    if profile is None:
        raise PlanningError(
            f"the previous plan runs tensor parallel {previous.tensor_parallel}, but no profile at that degree "
            f"was given (degrees: {sorted(profiles)})"
        )

    def replan(tolerance: float) -> Plan:
        c = dataclasses.replace(cfg, planning=dataclasses.replace(cfg.planning, replan_tolerance=tolerance))
        generation = previous.generation + 1
        return plan_job(
            c, nodes=survivors, profile=profiles, previous=previous, generation=generation, engine_only=True
        ).plan

    plan = replan(cfg.planning.replan_tolerance)
    fastest = replan(0.0) if cfg.planning.replan_tolerance > 0 else plan
    shards = shard_bytes_of(profile.layers)
    held = previous.layers_by_worker()
    received = bytes_received(previous, plan, shards, held=held)
    return LossPreview(
        lost=tuple(lose),
        plan=plan,
        fastest=fastest,
        received=received,
        fastest_received=bytes_received(previous, fastest, shards, held=held),
        formed=tuple(p.index for p in plan.pipelines if any(node in received for node in p.nodes)),
    )


def _bytes(n: float) -> str:
    return f"{n / 1e12:.2f} TB" if n >= 1e12 else f"{n / 1e9:.1f} GB"


def format_preview(pv: LossPreview, *, tolerance: float) -> str:
    """The report `oobleck plan --previous ... --lose ...` prints."""
    plan, fastest = pv.plan, pv.fastest
    total, busiest = sum(pv.received.values()), max(pv.received.values(), default=0)
    lines = [
        f"losing {', '.join(pv.lost)}: {len(plan.pipelines)} pipeline(s) on {len(plan.nodes) - len(plan.spares)} "
        f"node(s), step {plan.est_step_time_s:.4g} s ({plan.samples_per_s:.4g} samples/s)",
        f"  pipelines with a node that receives layers: {len(pv.formed)} of {len(plan.pipelines)}; "
        "every other node keeps its layers",
        f"  bytes to receive: {_bytes(total)} over {len(pv.received)} node(s), the busiest {_bytes(busiest)}",
    ]
    if fastest != plan:
        f_total = sum(pv.fastest_received.values())
        f_busiest = max(pv.fastest_received.values(), default=0)
        lines.append(
            f"  the fastest plan instead: {len(fastest.pipelines)} pipeline(s), step {fastest.est_step_time_s:.4g} s "
            f"({plan.est_step_time_s / fastest.est_step_time_s - 1:+.2%} kept here, within "
            f"planning.replan_tolerance={tolerance:g}), {_bytes(f_total)} to receive, the busiest {_bytes(f_busiest)}"
        )
    else:
        lines.append(f"  this is the fastest plan (planning.replan_tolerance={tolerance:g})")
    for node, n in sorted(pv.received.items(), key=lambda kv: (-kv[1], kv[0]))[:10]:
        lines.append(f"  {node} receives {_bytes(n)}")
    if len(pv.received) > 10:
        lines.append(f"  ... and {len(pv.received) - 10} more node(s)")
    return "\n".join(lines)
