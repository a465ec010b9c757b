"""Planning plane: profile -> templates -> plan. Pure functions of numbers (no torch.distributed,
no etcd), so they can be tested exhaustively and benchmarked at scale.

`plan_job(cfg, nodes=..., profile=...)` is the one call the control plane and the CLI make.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..config import JobConfig
from .instantiate import Assignment, best_cover, instantiate
from .plan import Guarantee, PipelineSpec, Plan, StagePlacement, guarantee, make_plan
from .profile import LayerProfile, ModelProfile, ProfileError
from .templates import PlanningError, Template, TemplateSet, build_templates

__all__ = [
    "Assignment", "Guarantee", "JobPlan", "LayerProfile", "ModelProfile", "PipelineSpec", "Plan",
    "PlanningError", "ProfileError", "StagePlacement", "Template", "TemplateSet", "best_cover",
    "build_templates", "guarantee", "instantiate", "make_plan", "plan_job", "templates_for",
]


@dataclass(frozen=True)
class JobPlan:
    templates: TemplateSet
    """Templates for every feasible node count."""
    guarantee: Guarantee
    """What the templates promise for f."""
    plan: Plan
    """The plan for the given nodes."""


def templates_for(cfg: JobConfig, profile: ModelProfile) -> TemplateSet:
    """Templates for a job config and a profile (memory limit, schedule, devices per node)."""
    p, t = cfg.planning, cfg.training
    microbatches = t.global_batch_size // t.microbatch_size
    return build_templates(profile, gpus_per_node=p.gpus_per_node, device_memory_gb=p.device_memory_gb,
                           memory_margin=p.memory_margin, schedule=p.schedule,
                           gpipe_microbatches=-(-microbatches // (cfg.fault_tolerance.f + 1)),
                           max_nodes=p.max_template_nodes)


def plan_job(cfg: JobConfig, *, nodes: Sequence[str] | int, profile: Optional[ModelProfile] = None,
             generation: int = 0, templates: Optional[TemplateSet] = None,
             previous: Optional[Plan] = None) -> JobPlan:
    """Templates, guarantee and the plan for `nodes` (ids, or a count: node0, node1, ...).

    Give the profile, or templates already computed from it. With the `previous` generation's
    plan, nodes are placed where they keep the most layers they hold."""
    if isinstance(nodes, int):
        if nodes < 1:
            raise PlanningError(f"--nodes must be >= 1 (got {nodes})")
        nodes = [f"node{i}" for i in range(nodes)]
    if templates is None and profile is None:
        raise ValueError("plan_job needs a profile or templates")
    tset = templates if templates is not None else templates_for(cfg, profile)  # type: ignore[arg-type]
    g = guarantee(tset, cfg.fault_tolerance.f, max_nodes=cfg.planning.max_nodes)
    t = cfg.training
    microbatches = t.global_batch_size // t.microbatch_size
    cap = -(-microbatches // (cfg.fault_tolerance.f + 1)) if cfg.planning.schedule == "gpipe" else None
    if len(nodes) < tset.n0:
        raise PlanningError(f"{len(nodes)} node(s) cannot hold one replica of the model: at least "
                            f"n0={tset.n0} nodes of {tset.gpus_per_node} device(s) are needed; the "
                            "job waits for more nodes")
    plan = make_plan(tset, nodes=list(nodes), num_microbatches=microbatches,
                     microbatch_size=t.microbatch_size, f=cfg.fault_tolerance.f,
                     generation=generation, microbatch_cap=cap, previous=previous)
    return JobPlan(templates=tset, guarantee=g, plan=plan)
