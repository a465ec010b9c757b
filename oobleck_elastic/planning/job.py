"""Planning a job: the one entry for callers outside planning, from a config and a profile to a plan.

`plan_job(cfg, nodes=..., profile=...)` builds the templates and the plan, with links from
`links_for(cfg)`; `planning.tensor_parallel=auto` and `training.microbatch_size: auto` choose the
degree and the size with the best estimated throughput (`choose_tensor_parallel`,
`choose_microbatch_size`); a re-plan keeps the previous plan's microbatch size. A device's memory
is `planning.device_memory_gb`, else what the profile recorded, else an error naming the setting.
`with_shadows` places host-memory shadow copies within `host_memory`. docs/planning.md.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ..config import JobConfig
from .comm import Links
from .errors import PlanningError
from .plan.build import make_plan
from .plan.plan import Plan
from .profile.microbatch import (
    MicrobatchChoice,
    MicrobatchOption,
    fixed_microbatch_size,
    microbatch_candidates,
    pick_microbatch_size,
    profile_at,
)
from .profile.profile import ModelProfile, ProfileError, recompute_mismatch
from .schedules.choice import PipelineSchedules, candidates, closed_form
from .templates.templates import GIB, TemplateSet, build_templates, memory_limit_bytes
from .tolerance.guarantee import Guarantee, guarantee
from .tolerance.shadows import place_shadows, shadow_bytes

__all__ = [
    "JobPlan",
    "device_memory",
    "host_memory",
    "with_shadows",
    "links_for",
    "tensor_parallel_degrees",
    "load_profiles",
    "choose_microbatch_size",
    "single_worker_microbatch_size",
    "compare_tensor_parallel",
    "choose_tensor_parallel",
    "templates_for",
    "pipeline_schedules",
    "plan_job",
]


@dataclass(frozen=True)
class JobPlan:
    templates: TemplateSet
    """Templates for every feasible node count."""
    guarantee: Guarantee
    """What the templates promise for f."""
    plan: Plan
    """The plan for the given nodes."""
    microbatch: Optional[MicrobatchChoice] = None
    """With training.microbatch_size auto, how this plan's microbatch size was chosen (None: the
    size was fixed, by the config or by the job's earlier plans)."""
    schedules: Optional[PipelineSchedules] = dataclasses.field(default=None, compare=False, repr=False)
    """What chose each pipeline's schedule, with every candidate it simulated (None: 1f1b or
    gpipe, templates.py's closed form)."""

    @property
    def efficiency(self) -> float:
        """Estimated fraction of the devices' step time spent computing (1 - the bubble fraction,
        communication counted as idle): the work of every microbatch on every stage over the
        stages x the step time."""
        p = self.plan
        work = sum(pipe.microbatches * self.templates[pipe.template_nodes].compute_s for pipe in p.pipelines)
        busy = sum(len(pipe.stages) for pipe in p.pipelines) * p.est_step_time_s
        return work / busy if busy > 0 else 0.0


def device_memory(cfg: JobConfig, profile: ModelProfile) -> tuple[float, str]:
    """(GiB of one device, where that figure comes from): `planning.device_memory_gb` if set,
    else the memory of the device the profile was measured on. Raises PlanningError when
    neither is known (CPU profiles and most profile files record no device memory)."""
    if cfg.planning.device_memory_gb is not None:
        return float(cfg.planning.device_memory_gb), "planning.device_memory_gb"
    if profile.device_memory_bytes:
        name = profile.key.get("device_name") if isinstance(profile.key, dict) else None
        return profile.device_memory_bytes / GIB, f"the profiled device ({name or 'unnamed'})"
    raise PlanningError(
        "planning.device_memory_gb is not set and the profile records no device memory (profiles "
        "measured on the CPU and profile files without device_memory_bytes have none): set "
        "planning.device_memory_gb to the GiB of memory one device gives one stage, e.g. "
        "planning.device_memory_gb=80"
    )


def host_memory(cfg: JobConfig) -> tuple[float, str]:
    """(GiB of host memory each node gives shadow copies, where that figure comes from):
    `planning.host_memory_gb` if set, else the memory available now on this machine."""
    if cfg.planning.host_memory_gb is not None:
        return float(cfg.planning.host_memory_gb), "planning.host_memory_gb"
    return _available_host_bytes() / GIB, "the memory available on this machine (planning.host_memory_gb unset)"


def _available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo; elsewhere the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def with_shadows(
    cfg: JobConfig,
    plan: Plan,
    profile: ModelProfile | Mapping[int, ModelProfile],
    host: Optional[tuple[float, str]] = None,
    *,
    fewer: bool = False,
) -> Plan:
    """`plan` with `fault_tolerance.shadow_copies` shadow copies of each layer placed (shadows.py),
    sized from the profile at the plan's tensor-parallel degree, within `host` (GiB per node and
    its source; default `host_memory(cfg)`); `plan` itself with 0. Raises PlanningError when they
    cannot be placed; with `fewer` (a job after losses: too few nodes may be left) it places as
    many copies as fit instead, and the plan's warnings say why it keeps fewer."""
    copies = cfg.fault_tolerance.shadow_copies
    if copies == 0:
        return plan
    profiles = {profile.tensor_parallel: profile} if isinstance(profile, ModelProfile) else dict(profile)
    if plan.tensor_parallel not in profiles:
        raise PlanningError(f"no profile at tensor_parallel={plan.tensor_parallel} to size the shadow copies from")
    gib, source = host if host is not None else host_memory(cfg)
    sizes = shadow_bytes(profiles[plan.tensor_parallel].layers, plan.tensor_parallel)
    why = ""
    for n in range(copies, 0 if fewer else copies - 1, -1):
        try:
            placed = place_shadows(plan, n, sizes, int(gib * GIB), budget_source=source)
        except PlanningError as err:
            if not fewer:
                raise
            why = why or str(err)
            continue
        if n < copies:
            warning = f"{n} shadow copies of each layer instead of fault_tolerance.shadow_copies={copies}: {why}"
            return dataclasses.replace(plan, shadows=placed, warnings=(*plan.warnings, warning))
        return dataclasses.replace(plan, shadows=placed)
    warning = f"no shadow copies instead of fault_tolerance.shadow_copies={copies}: {why}"
    return dataclasses.replace(plan, warnings=(*plan.warnings, warning))


def links_for(cfg: JobConfig) -> Optional[Links]:
    """The links of `planning.*` (None when planning.count_communication is off)."""
    p = cfg.planning
    if not p.count_communication:
        return None
    return Links(
        intra_node_gb_s=p.intra_node_bandwidth_gb_s,
        inter_node_gb_s=p.inter_node_bandwidth_gb_s,
        latency_s=p.link_latency_us * 1e-6,
    )


def tensor_parallel_degrees(cfg: JobConfig) -> list[int]:
    """The degrees the job may use: planning.tensor_parallel, or every divisor of gpus_per_node (auto)."""
    tp, g = cfg.planning.tensor_parallel, cfg.planning.gpus_per_node
    return [d for d in range(1, g + 1) if g % d == 0] if tp == "auto" else [int(tp)]


def load_profiles(cfg: JobConfig, path: Optional[str] = None) -> dict[int, ModelProfile]:
    """Profiles by tensor-parallel degree from `path` (default planning.profile_path): with `{tp}`
    in it, one file per degree the job may use (missing files skipped, at least one needed); else
    the one file, whose recorded degree must be one the job may use."""
    path = path or cfg.planning.profile_path
    if not path:
        raise ProfileError("no profile file: set planning.profile_path (or --profile)")
    degrees = tensor_parallel_degrees(cfg)
    if "{tp}" not in path:
        profile = ModelProfile.load(path)
        if mismatch := recompute_mismatch(cfg, profile, path):
            raise ProfileError(mismatch)
        if profile.tensor_parallel not in degrees:
            raise ProfileError(
                f"{path} was measured at tensor_parallel={profile.tensor_parallel} but "
                f"planning.tensor_parallel={cfg.planning.tensor_parallel}: use a profile of that "
                "degree (profile_path with {tp} in it picks one per degree)"
            )
        return {profile.tensor_parallel: profile}
    found = {d: path.replace("{tp}", str(d)) for d in degrees}
    profiles = {d: ModelProfile.load(f) for d, f in found.items() if Path(f).is_file()}
    if not profiles:
        raise ProfileError(f"none of the profile files {', '.join(found.values())} exists")
    for d, profile in profiles.items():
        if profile.tensor_parallel != d:
            raise ProfileError(f"{found[d]} records tensor_parallel={profile.tensor_parallel}, not {d}")
        if mismatch := recompute_mismatch(cfg, profile, found[d]):
            raise ProfileError(mismatch)
    return profiles


def _build(cfg: JobConfig, profile: ModelProfile, microbatch_size: int) -> TemplateSet:
    """Templates at `microbatch_size` (with auto, the profile fitted to that size)."""
    p, t = cfg.planning, cfg.training
    profile = profile.in_mode(t.activation_checkpoint)  # the mode's numbers (auto: both)
    if fixed_microbatch_size(cfg) is None:
        profile = profile_at(profile, microbatch_size)
    microbatches = t.global_batch_size // microbatch_size
    memory_gb, source = device_memory(cfg, profile)
    tset = build_templates(
        profile,
        gpus_per_node=p.gpus_per_node,
        device_memory_gb=memory_gb,
        memory_margin=p.memory_margin,
        schedule="gpipe" if p.schedule == "gpipe" else "1f1b",  # the others: simulated per pipeline
        gpipe_microbatches=-(-microbatches // (cfg.fault_tolerance.f + 1)),
        max_nodes=p.max_template_nodes,
        memory_source=source,
        tensor_parallel=profile.tensor_parallel,
        links=links_for(cfg),
        activation_checkpoint=t.activation_checkpoint,
    )
    return dataclasses.replace(tset, microbatch_size=microbatch_size, profile=profile)


def _choose(cfg: JobConfig, profile: ModelProfile, nodes: int) -> tuple[MicrobatchChoice, dict[int, TemplateSet]]:
    """The choice of `choose_microbatch_size`, and the templates of every size that fits."""
    options, built = [], {}
    total = cfg.training.global_batch_size
    memory = ""
    too_big: Optional[tuple[int, list[int]]] = None  # a size no template fits at, and its activations
    mode = cfg.training.activation_checkpoint
    profile = profile.in_mode(mode)
    least = profile.in_mode("full") if mode == "auto" else profile  # the least activations a stage can keep
    for b in microbatch_candidates(cfg):
        if too_big is not None and cfg.planning.schedule == "1f1b":
            # 1F1B keeps as many microbatches in flight at every size: no less activation memory
            # on any layer than at a size that fit nowhere cannot fit either
            acts = [la.activation_bytes for la in profile_at(least, b).layers]
            if all(x >= y for x, y in zip(acts, too_big[1])):
                options.append(
                    MicrobatchOption(
                        size=b,
                        microbatches=total // b,
                        memory_bound=True,
                        error=f"more activation memory than size {too_big[0]}, which does not fit",
                    )
                )
                continue
        try:
            tset = _build(cfg, profile, b)
        except PlanningError as err:
            options.append(MicrobatchOption(size=b, microbatches=total // b, error=str(err), memory_bound=True))
            if fixed_microbatch_size(cfg) is None and profile.measurements():
                too_big = (b, [la.activation_bytes for la in profile_at(least, b).layers])
            continue
        memory = f"{tset.device_memory_gb:.4g} GiB per device (from {tset.memory_source})"
        try:
            jp = plan_job(cfg, nodes=nodes, templates=tset)
        except PlanningError as err:
            options.append(MicrobatchOption(size=b, microbatches=total // b, error=str(err)))
            continue
        built[b] = tset
        plan = jp.plan
        peak = max(tset[pipe.template_nodes].peak_memory_bytes for pipe in plan.pipelines)
        options.append(
            MicrobatchOption(
                size=b,
                microbatches=total // b,
                step_s=plan.est_step_time_s,
                samples_per_s=plan.samples_per_s,
                pipelines=len(plan.pipelines),
                peak_memory_bytes=peak,
            )
        )
    choice = pick_microbatch_size(
        options,
        nodes=nodes,
        min_pipelines=cfg.fault_tolerance.f + 1,
        measured_sizes=sorted(profile.measurements()),
        memory=memory,
    )
    return choice, built


def choose_microbatch_size(cfg: JobConfig, profile: ModelProfile, nodes: int) -> MicrobatchChoice:
    """training.microbatch_size=auto: the candidate size (`microbatch_candidates`) whose plan on
    `nodes` nodes has the best estimated samples/s, time and memory at each size fitted from the
    profile's measured sizes (profile/microbatch.py); ties go to the larger size. The result lists every
    candidate. Raises MicrobatchError (a PlanningError) when none can be planned."""
    return _choose(cfg, profile, nodes)[0]


def single_worker_microbatch_size(cfg: JobConfig, profile: ModelProfile) -> MicrobatchChoice:
    """training.microbatch_size=auto for a one-worker job (engine/control.py `LocalControl`): the
    choice for one stage holding every layer on one device (one node, f = 0)."""
    local = dataclasses.replace(
        cfg,
        planning=dataclasses.replace(
            cfg.planning, gpus_per_node=1, tensor_parallel=1, max_nodes=None, max_template_nodes=1
        ),
        fault_tolerance=dataclasses.replace(cfg.fault_tolerance, f=0),
    )
    return choose_microbatch_size(local, profile, 1)


def compare_tensor_parallel(
    cfg: JobConfig, profiles: Mapping[int, ModelProfile], nodes: int
) -> dict[int, "JobPlan | PlanningError"]:
    """For each degree: the templates, guarantee and plan on `nodes` nodes, or why none fits
    (with training.microbatch_size auto, each degree at its own best size for `nodes` nodes)."""
    out: dict[int, JobPlan | PlanningError] = {}
    for d in sorted(profiles):
        try:
            tset, choice = _sized(cfg, profiles[d], nodes, None)
            out[d] = dataclasses.replace(plan_job(cfg, nodes=nodes, templates=tset), microbatch=choice)
        except PlanningError as err:
            out[d] = err
    return out


def choose_tensor_parallel(cfg: JobConfig, profiles: Mapping[int, ModelProfile], nodes: int) -> int:
    """The degree whose plan on `nodes` nodes has the best estimated samples/s (ties: the smaller
    degree). Raises PlanningError when no degree can be planned."""
    return _best_degree(compare_tensor_parallel(cfg, profiles, nodes))


def _best_degree(plans: Mapping[int, "JobPlan | PlanningError"]) -> int:
    """The degree of `compare_tensor_parallel`'s plans with the best samples/s (ties: the smaller)."""
    ok = {d: jp.plan.samples_per_s for d, jp in plans.items() if isinstance(jp, JobPlan)}
    if not ok:
        raise PlanningError(
            "no tensor-parallel degree can be planned: " + "; ".join(f"tp={d}: {err}" for d, err in plans.items())
        )
    return max(sorted(ok), key=lambda d: ok[d])


def _sized(
    cfg: JobConfig, profile: ModelProfile, nodes: Optional[int], microbatch_size: Optional[int]
) -> tuple[TemplateSet, Optional[MicrobatchChoice]]:
    """Templates at the configured microbatch size, at `microbatch_size` (auto, size already
    chosen), or at the size chosen now for planning.max_nodes or `nodes` nodes (auto)."""
    size = fixed_microbatch_size(cfg) or microbatch_size
    if size is not None:
        return _build(cfg, profile, size), None
    reference = cfg.planning.max_nodes or nodes
    if reference is None:
        raise PlanningError("training.microbatch_size=auto needs a node count to choose for: set planning.max_nodes")
    choice, built = _choose(cfg, profile, reference)
    return built[choice.size], choice


def _resolve(
    cfg: JobConfig,
    profile: ModelProfile | Mapping[int, ModelProfile],
    nodes: Optional[int],
    microbatch_size: Optional[int],
    previous: Optional[Plan] = None,
) -> tuple[TemplateSet, Optional[MicrobatchChoice]]:
    """Templates and, when the microbatch size was chosen now, the choice. With the `previous`
    plan, its tensor-parallel degree and microbatch size are kept (chosen once for the job)."""
    profiles = {profile.tensor_parallel: profile} if isinstance(profile, ModelProfile) else dict(profile)
    tp = cfg.planning.tensor_parallel
    if previous is not None:
        microbatch_size = previous.microbatch_size
    if tp == "auto":
        if len(profiles) == 1:
            return _sized(cfg, next(iter(profiles.values())), nodes, microbatch_size)
        if previous is not None and previous.tensor_parallel in profiles:
            return _sized(cfg, profiles[previous.tensor_parallel], nodes, microbatch_size)
        reference = cfg.planning.max_nodes or nodes
        if reference is None:
            raise PlanningError(
                "planning.tensor_parallel=auto needs a node count to choose for: set planning.max_nodes"
            )
        plans = compare_tensor_parallel(cfg, profiles, reference)
        best = plans[_best_degree(plans)]
        assert isinstance(best, JobPlan)
        if microbatch_size is None:  # the comparison built these very templates: do not build them again
            return best.templates, best.microbatch
        return _sized(cfg, profiles[best.plan.tensor_parallel], nodes, microbatch_size)
    if int(tp) not in profiles:
        have = ", ".join(str(d) for d in sorted(profiles))
        raise PlanningError(
            f"planning.tensor_parallel={tp} but the profile was measured at tensor_parallel={have}: "
            "use a profile measured at that degree"
        )
    return _sized(cfg, profiles[int(tp)], nodes, microbatch_size)


def templates_for(
    cfg: JobConfig,
    profile: ModelProfile | Mapping[int, ModelProfile],
    nodes: Optional[int] = None,
    *,
    microbatch_size: Optional[int] = None,
) -> TemplateSet:
    """Templates for a job config and a profile (memory limit, schedule, devices per node, links,
    tensor-parallel degree, microbatch size). Given profiles by degree and
    planning.tensor_parallel=auto, the degree is chosen for `nodes` nodes (planning.max_nodes when
    set); with training.microbatch_size=auto, the size is `microbatch_size` when given (the job's
    size, chosen before), else chosen for the same node count. `TemplateSet.microbatch_size` is
    the size they were built for."""
    return _resolve(cfg, profile, nodes, microbatch_size)[0]


def pipeline_schedules(cfg: JobConfig, tset: TemplateSet, *, engine_only: bool = False) -> Optional[PipelineSchedules]:
    """What chooses each pipeline's schedule (schedules/choice.py), or None for 1f1b and gpipe
    (templates.py's closed form). PlanningError for a bad schedule or chunk count."""
    p = cfg.planning
    options = candidates(p.schedule, p.chunks_per_device, engine_only=engine_only)
    if closed_form(p.schedule):
        return None
    if tset.profile is None or tset.device_memory_gb is None:
        raise PlanningError(f"planning.schedule={p.schedule}: the templates were built without their profile")
    limit = memory_limit_bytes(tset.device_memory_gb, p.memory_margin)
    return PipelineSchedules(tset.profile, tset, limit, options)


def plan_job(
    cfg: JobConfig,
    *,
    nodes: Sequence[str] | int,
    profile: Optional[ModelProfile | Mapping[int, ModelProfile]] = None,
    generation: int = 0,
    templates: Optional[TemplateSet] = None,
    previous: Optional[Plan] = None,
    engine_only: bool = False,
    schedules: Optional[PipelineSchedules] = None,
) -> JobPlan:
    """Templates, guarantee and the plan for `nodes` (ids, or a count: node0, node1, ...).

    Give the profile, or templates already computed from it (their `microbatch_size` is the
    plan's). With the `previous` generation's plan, nodes are placed where they keep the most
    layers they hold, the pipelines a change did not touch are kept when that costs at most
    `planning.replan_tolerance` of the step, and its tensor-parallel degree and microbatch size
    are kept (`auto`).
    `planning.schedule` other than 1f1b and gpipe is chosen per pipeline (schedules/choice.py);
    with `engine_only` only among the schedules the engine runs (a job's plans). `schedules`: the
    `JobPlan.schedules` of an earlier call with the same config and templates, reused with the
    simulations it has cached (a study planning many node counts; the plans are the same)."""
    if isinstance(nodes, int):
        if nodes < 1:
            raise PlanningError(f"--nodes must be >= 1 (got {nodes})")
        nodes = [f"node{i}" for i in range(nodes)]
    if templates is None and profile is None:
        raise ValueError("plan_job needs a profile or templates")
    choice = None
    if templates is not None:
        tset = templates
    else:
        tset, choice = _resolve(cfg, profile, len(nodes), None, previous)  # type: ignore[arg-type]
    size = fixed_microbatch_size(cfg) or tset.microbatch_size
    if size is None:
        raise PlanningError(
            "training.microbatch_size=auto but the templates were built without a microbatch "
            "size: build them with templates_for"
        )
    g = guarantee(tset, cfg.fault_tolerance.f, max_nodes=cfg.planning.max_nodes)
    microbatches = cfg.training.global_batch_size // size
    cap = -(-microbatches // (cfg.fault_tolerance.f + 1)) if cfg.planning.schedule == "gpipe" else None
    if len(nodes) < tset.n0:
        raise PlanningError(
            f"{len(nodes)} node(s) cannot hold one replica of the model: at least "
            f"n0={tset.n0} nodes of {tset.gpus_per_node} device(s) are needed; the "
            "job waits for more nodes"
        )
    if schedules is None:
        schedules = pipeline_schedules(cfg, tset, engine_only=engine_only)
    elif schedules.templates is not tset:
        raise ValueError("plan_job: the schedules given were made for other templates")
    plan = make_plan(
        tset,
        schedules=schedules,
        schedule=cfg.planning.schedule,
        nodes=list(nodes),
        num_microbatches=microbatches,
        microbatch_size=size,
        f=cfg.fault_tolerance.f,
        generation=generation,
        microbatch_cap=cap,
        previous=previous,
        replan_tolerance=cfg.planning.replan_tolerance,
    )
    return JobPlan(templates=tset, guarantee=g, plan=plan, microbatch=choice, schedules=schedules)
