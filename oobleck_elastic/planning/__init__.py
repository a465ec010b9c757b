"""Planning plane: profile -> templates -> plan. Pure functions of numbers (no torch.distributed,
no etcd), so they can be tested exhaustively and benchmarked at scale.

`plan_job(cfg, nodes=..., profile=...)` is the one call the control plane and the CLI make.

The memory of one device is `planning.device_memory_gb` when set, else the total memory the
profile recorded for the device it was measured on (`device_memory`); with neither, planning
stops with an error that names `planning.device_memory_gb`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..config import JobConfig
from .instantiate import Assignment, best_cover, instantiate
from .plan import Guarantee, PipelineSpec, Plan, StagePlacement, guarantee, make_plan
from .profile import LayerProfile, ModelProfile, ProfileError
from .templates import GIB, PlanningError, Template, TemplateSet, build_templates

__all__ = [
    "Assignment", "Guarantee", "JobPlan", "LayerProfile", "ModelProfile", "PipelineSpec", "Plan",
    "PlanningError", "ProfileError", "StagePlacement", "Template", "TemplateSet", "best_cover",
    "build_templates", "device_memory", "guarantee", "instantiate", "make_plan", "plan_job", "templates_for",
]


@dataclass(frozen=True)
class JobPlan:
    templates: TemplateSet
    """Templates for every feasible node count."""
    guarantee: Guarantee
    """What the templates promise for f."""
    plan: Plan
    """The plan for the given nodes."""


def device_memory(cfg: JobConfig, profile: ModelProfile) -> tuple[float, str]:
    """(GiB of one device, where that figure comes from): `planning.device_memory_gb` if set,
    else the memory of the device the profile was measured on. Raises PlanningError when
    neither is known (CPU profiles and most profile files record no device memory)."""
    if cfg.planning.device_memory_gb is not None:
        return float(cfg.planning.device_memory_gb), "planning.device_memory_gb"
    if profile.device_memory_bytes:
        name = profile.key.get("device_name") if isinstance(profile.key, dict) else None
        return profile.device_memory_bytes / GIB, f"the profiled device ({name or 'unnamed'})"
    raise PlanningError("planning.device_memory_gb is not set and the profile records no device memory (profiles "
                        "measured on the CPU and profile files without device_memory_bytes have none): set "
                        "planning.device_memory_gb to the GiB of memory one device gives one stage, e.g. "
                        "planning.device_memory_gb=80")


def templates_for(cfg: JobConfig, profile: ModelProfile) -> TemplateSet:
    """Templates for a job config and a profile (memory limit, schedule, devices per node)."""
    p, t = cfg.planning, cfg.training
    microbatches = t.global_batch_size // t.microbatch_size
    memory_gb, source = device_memory(cfg, profile)
    return build_templates(profile, gpus_per_node=p.gpus_per_node, device_memory_gb=memory_gb,
                           memory_margin=p.memory_margin, schedule=p.schedule,
                           gpipe_microbatches=-(-microbatches // (cfg.fault_tolerance.f + 1)),
                           max_nodes=p.max_template_nodes, memory_source=source)


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
