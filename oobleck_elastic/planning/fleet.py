"""Planning a mixed fleet: nodes of several device classes (`planning.classes`) in one plan.

Each class gets a profile (its own `profile_path`, or the profiled class's times divided by the
class's speed: `speed`, else the ratio of `peak_tflops`) and templates built for its devices'
memory; `instantiate_mixed` chooses every class's pipelines at once (a pipeline runs on one
class) and `make_mixed_plan` joins them, each stage naming its class. `homogeneous` plans the
profiled class alone at the same peak FLOPS: the MFU gap of mixing. docs/planning.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from ..config import JobConfig
from .errors import PlanningError
from .job import load_profiles, pipeline_schedules, plan_job, templates_for
from .plan.build import make_mixed_plan
from .plan.mixed import instantiate_mixed
from .plan.plan import Plan
from .profile.microbatch import fixed_microbatch_size
from .profile.profile import LayerProfile, ModelProfile, ProfileError
from .schedules.choice import PipelineSchedules
from .templates.templates import TemplateSet

__all__ = [
    "FleetPlan",
    "parse_class_counts",
    "class_speed",
    "scaled_profile",
    "plan_fleet",
    "FleetTemplates",
    "fleet_templates",
    "class_templates",
    "fleet_plan",
    "format_fleet",
    "fleet_json",
]


def parse_class_counts(text: str, cfg: JobConfig) -> dict[str, int]:
    """`--classes h100=512,a100=384`: nodes per class, in the order given, each class defined in
    `planning.classes`."""
    known = cfg.planning.classes
    out: dict[str, int] = {}
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        name, eq, count = part.partition("=")
        if not eq or not count.strip().isdigit():
            raise PlanningError(f"--classes: '{part}' is not NAME=COUNT (e.g. --classes h100=512,a100=384)")
        if name not in known:
            have = ", ".join(sorted(known)) or "none"
            raise PlanningError(
                f"--classes: class '{name}' is not defined: planning.classes defines {have}; add "
                f"planning.classes.{name}.peak_tflops (and its memory and devices) to the config"
            )
        if name in out:
            raise PlanningError(f"--classes: class '{name}' is given twice")
        out[name] = int(count)
    if not out or sum(out.values()) < 1:
        raise PlanningError("--classes: give at least one node, e.g. --classes h100=512,a100=384")
    return out


def class_speed(cfg: JobConfig, name: str) -> tuple[float, str]:
    """(speed relative to the profiled devices, where it comes from) of class `name`."""
    classes, base = cfg.planning.classes, cfg.planning.profiled_class
    own = classes[name]
    if own.profile_path:
        return 1.0, f"its own profile ({own.profile_path})"
    if own.speed is not None:
        return float(own.speed), f"planning.classes.{name}.speed"
    if base is None:
        raise PlanningError(
            f"class {name} has no profile_path of its own and planning.profiled_class is not set: name the "
            "class the profile was measured on (planning.profiled_class), or give "
            f"planning.classes.{name}.speed"
        )
    if name == base:
        return 1.0, "the profiled class"
    ref = classes[base].peak_tflops
    if own.peak_tflops is None or ref is None:
        missing = name if own.peak_tflops is None else base
        raise PlanningError(
            f"class {name}: its speed relative to {base} (the profiled class) is unknown: set "
            f"planning.classes.{missing}.peak_tflops, or planning.classes.{name}.speed"
        )
    return own.peak_tflops / ref, f"peak {own.peak_tflops:g} / {ref:g} TFLOP/s of {base}"


def _scaled_layer(la: LayerProfile, speed: float) -> LayerProfile:
    def div(x: Optional[float]) -> Optional[float]:
        return None if x is None else x / speed

    return dataclasses.replace(
        la,
        forward_s=la.forward_s / speed,
        backward_s=la.backward_s / speed,
        input_grad_s=div(la.input_grad_s),
        weight_grad_s=div(la.weight_grad_s),
        recomputed_backward_s=div(la.recomputed_backward_s),
    )


def scaled_profile(profile: ModelProfile, speed: float) -> ModelProfile:
    """`profile` on devices `speed` times as fast: every time divided by it, bytes unchanged."""
    if speed == 1.0:
        return profile
    key = dict(profile.key) if isinstance(profile.key, dict) else {}
    key["speed"] = key.get("speed", 1.0) * speed
    return dataclasses.replace(
        profile,
        layers=[_scaled_layer(la, speed) for la in profile.layers],
        at_microbatch_sizes={
            b: [_scaled_layer(la, speed) for la in ls] for b, ls in profile.at_microbatch_sizes.items()
        },
        key=key,
    )


def class_config(cfg: JobConfig, name: str) -> JobConfig:
    """`cfg` as a job of class `name` alone: its devices per node, memory and profile path."""
    own, p = cfg.planning.classes[name], cfg.planning
    planning = dataclasses.replace(
        p,
        gpus_per_node=own.gpus_per_node or p.gpus_per_node,
        device_memory_gb=own.device_memory_gb if own.device_memory_gb is not None else p.device_memory_gb,
        profile_path=own.profile_path or p.profile_path,
        classes={},
        profiled_class=None,
    )
    return dataclasses.replace(cfg, planning=planning)


@dataclass(frozen=True)
class FleetPlan:
    plan: Plan
    """The plan: every stage names its class."""
    counts: dict[str, int]
    """Nodes of each class, in the order given."""
    templates: dict[str, TemplateSet]
    """Each class's templates (its devices' speed and memory)."""
    speeds: dict[str, tuple[float, str]]
    """Each class's speed relative to the profiled devices, and where it comes from."""
    homogeneous: Optional[Plan] = None
    """The profiled class alone on the nodes that give the fleet's peak FLOPS (None: a peak is unknown)."""
    homogeneous_why: str = ""
    """Why `homogeneous` is None."""

    @property
    def mfu_ratio(self) -> Optional[float]:
        """The fleet's estimated MFU over the one-class fleet's at the same peak FLOP/s: their
        samples/s ratio (None: not compared)."""
        h = self.homogeneous
        return self.plan.samples_per_s / h.samples_per_s if h is not None and h.samples_per_s else None


def _class_profile(cfg: JobConfig, name: str, base: Mapping[int, ModelProfile]) -> Mapping[int, ModelProfile]:
    own = cfg.planning.classes[name]
    if own.profile_path:
        try:
            return load_profiles(class_config(cfg, name), own.profile_path)
        except ProfileError as err:  # one line naming the class and its key
            raise PlanningError(f"class {name} (planning.classes.{name}.profile_path): {err}") from None
    speed = class_speed(cfg, name)[0]
    return {tp: scaled_profile(p, speed) for tp, p in base.items()}


@dataclass(frozen=True)
class FleetTemplates:
    """What a mixed fleet is planned with: per class its templates, the lines of its schedules
    (the templates themselves under 1F1B and GPipe) and what chooses its pipelines' schedules."""

    sets: dict[str, TemplateSet]
    planned: dict[str, TemplateSet]
    schedules: dict[str, Optional[PipelineSchedules]]
    microbatch_size: int
    microbatches: int


def _fleet_microbatch_size(cfg: JobConfig) -> int:
    """The fleet's one microbatch size; PlanningError naming the key when the degree or the size
    is `auto` (a mixed fleet is planned at a given degree and size)."""
    if cfg.planning.tensor_parallel == "auto":
        raise PlanningError(
            "planning.tensor_parallel=auto with device classes: give the degree, e.g. planning.tensor_parallel=8"
        )
    size = fixed_microbatch_size(cfg)
    if size is None:
        raise PlanningError(
            "training.microbatch_size=auto with device classes: give the size, e.g. training.microbatch_size=1"
        )
    return size


def class_templates(
    cfg: JobConfig, name: str, profiles: Mapping[int, ModelProfile], nodes: Optional[int] = None
) -> tuple[TemplateSet, Optional[PipelineSchedules]]:
    """Class `name`'s templates, from its own profile or the profiled class's `profiles` scaled,
    and what chooses its pipelines' schedules (None under 1F1B and GPipe)."""
    _fleet_microbatch_size(cfg)
    ccfg = class_config(cfg, name)
    profile = _class_profile(cfg, name, profiles)  # its errors name the class's profile_path
    try:
        tset = templates_for(ccfg, profile, nodes or None)
    except PlanningError as err:
        why = str(err)
        if cfg.planning.classes[name].device_memory_gb is not None:  # the class's key, not the one it was copied to
            why = why.replace("planning.device_memory_gb", f"planning.classes.{name}.device_memory_gb")
        raise PlanningError(f"class {name} (planning.classes.{name}): {why}") from None
    tp = int(cfg.planning.tensor_parallel)
    if tset.tensor_parallel != tp:
        raise PlanningError(f"class {name}: its profile is at tensor_parallel={tset.tensor_parallel}, not {tp}")
    return tset, pipeline_schedules(ccfg, tset, engine_only=True)


def fleet_templates(
    cfg: JobConfig,
    counts: Mapping[str, int],
    profiles: Mapping[int, ModelProfile],
    built: Optional[Mapping[str, tuple[TemplateSet, Optional[PipelineSchedules]]]] = None,
) -> FleetTemplates:
    """Each class's templates (`class_templates`, or `built[c]` when given: a leader's, kept
    between plans) and their lines for `counts[c]` nodes. Needs a fixed tensor-parallel degree and
    microbatch size, one for the whole fleet."""
    size = _fleet_microbatch_size(cfg)
    B, f = cfg.training.global_batch_size // size, cfg.fault_tolerance.f
    sets, planned, schedules = {}, {}, {}
    for c in counts:
        sets[c], schedules[c] = built[c] if built and c in built else class_templates(cfg, c, profiles, counts[c])
        planned[c] = sets[c]
        sched = schedules[c]
        if sched is not None and counts[c] >= sets[c].n0:
            planned[c] = sched.lines(counts[c], B, f + 1)
    return FleetTemplates(sets=sets, planned=planned, schedules=schedules, microbatch_size=size, microbatches=B)


def fleet_plan(
    cfg: JobConfig,
    nodes: Mapping[str, Sequence[str]],
    ft: FleetTemplates,
    *,
    generation: int = 0,
    previous: Optional[Plan] = None,
) -> Plan:
    """The plan for the node ids `nodes[c]` of each class on templates `ft`; with the `previous`
    plan, each class's nodes placed where they keep the most layers they hold."""
    f = cfg.fault_tolerance.f
    cap = -(-ft.microbatches // (f + 1)) if cfg.planning.schedule == "gpipe" else None
    counts = {c: len(ids) for c, ids in nodes.items()}
    a = instantiate_mixed(ft.planned, counts, num_microbatches=ft.microbatches, f=f, microbatch_cap=cap)
    return make_mixed_plan(
        ft.sets, a, nodes=nodes, microbatch_size=ft.microbatch_size, f=f, generation=generation,
        schedules=ft.schedules, schedule=cfg.planning.schedule, previous=previous,
    )  # fmt: skip


def plan_fleet(
    cfg: JobConfig, counts: Mapping[str, int], profiles: Mapping[int, ModelProfile], *, compare: bool = True
) -> FleetPlan:
    """The plan for `counts[c]` nodes of each class `c`, from the profiled class's `profiles` by
    tensor-parallel degree; with `compare`, beside the profiled class alone at the same peak FLOP/s."""
    speeds = {c: class_speed(cfg, c) for c in counts}
    ft = fleet_templates(cfg, counts, profiles)
    plan = fleet_plan(cfg, {c: [f"{c}-{i}" for i in range(n)] for c, n in counts.items()}, ft)
    homogeneous, why = _homogeneous(cfg, counts, profiles, ft.sets) if compare else (None, "not asked")
    return FleetPlan(
        plan=plan, counts=dict(counts), templates=ft.sets, speeds=speeds, homogeneous=homogeneous, homogeneous_why=why
    )


def _homogeneous(
    cfg: JobConfig, counts: Mapping[str, int], profiles: Mapping[int, ModelProfile], sets: Mapping[str, TemplateSet]
) -> tuple[Optional[Plan], str]:
    """The profiled class alone, on as many nodes as give the fleet's peak FLOP/s (rounded down)."""
    base = cfg.planning.profiled_class
    classes = cfg.planning.classes
    peaks = {c: classes[c].peak_tflops for c in [*counts, *([base] if base else [])]}
    if base is None or any(v is None for v in peaks.values()):
        return None, "the comparison needs planning.profiled_class and every class's peak_tflops"
    peak = sum(counts[c] * sets[c].gpus_per_node * float(peaks[c] or 0) for c in counts)
    bcfg = class_config(cfg, base)
    per_node = bcfg.planning.gpus_per_node * float(peaks[base] or 0)
    n = math.floor(peak / per_node + 1e-9)
    try:
        if base in sets:  # the templates do not depend on the node count at a fixed degree and size
            return plan_job(bcfg, nodes=n, templates=sets[base], engine_only=True).plan, ""
        return plan_job(bcfg, nodes=n, profile=profiles, engine_only=True).plan, ""
    except PlanningError as err:
        return None, f"{n} node(s) of {base}: {err}"


def _class_rows(fp: FleetPlan) -> dict[str, dict]:
    """Per class: its nodes, those used, speed and its source, memory, n0, pipelines, microbatches."""
    rows = {}
    for c, n in fp.counts.items():
        pipes = [q for q in fp.plan.pipelines if q.stages[0].device_class == c]
        rows[c] = {
            "nodes": n,
            "used": sum(q.template_nodes for q in pipes),
            "speed": fp.speeds[c][0],
            "speed_source": fp.speeds[c][1],
            "device_memory_gib": fp.templates[c].device_memory_gb,
            "n0": fp.templates[c].n0,
            "pipelines": len(pipes),
            "microbatches": sum(q.microbatches for q in pipes),
        }
    return rows


def fleet_json(fp: FleetPlan) -> dict:
    """`oobleck plan --classes ... --json`: the plan, the classes, the one-class comparison."""
    h, ratio = fp.homogeneous, fp.mfu_ratio
    return {
        "plan": fp.plan.to_json() | {"samples_per_s": fp.plan.samples_per_s},
        "classes": _class_rows(fp),
        "homogeneous": (
            {"nodes": len(h.nodes), "samples_per_s": h.samples_per_s, "mfu_ratio": ratio}
            if h is not None and ratio is not None
            else {"error": fp.homogeneous_why}
        ),
    }


def format_fleet(fp: FleetPlan, cfg: JobConfig) -> str:
    """The summary of a mixed fleet's plan: per class what it uses and why, then the comparison."""
    p = fp.plan
    lines = [
        f"plan for {sum(fp.counts.values())} node(s) of {len(fp.counts)} class(es): {len(p.pipelines)} pipeline(s), "
        f"step {p.est_step_time_s:.4g} s, {p.samples_per_s:.4g} samples/s "
        f"(tensor_parallel={p.tensor_parallel}, microbatch {p.microbatch_size}, f={p.f})",
        "",
        f"  {'class':<10} {'nodes':>6} {'used':>6} {'speed':>7} {'memory':>9} {'n0':>4} {'pipelines':>9} "
        f"{'microbatches':>12}  speed from",
    ]
    for c, r in _class_rows(fp).items():
        lines.append(
            f"  {c:<10} {r['nodes']:>6} {r['used']:>6} {r['speed']:>6.3g}x {r['device_memory_gib'] or 0:>6.4g} GiB "
            f"{r['n0']:>4} {r['pipelines']:>9} {r['microbatches']:>12}  {r['speed_source']}"
        )
    if p.warnings:
        lines += ["", *[f"warning: {w}" for w in p.warnings]]
    lines.append("")
    h, ratio = fp.homogeneous, fp.mfu_ratio
    if h is None:
        lines.append(f"against one class: not compared ({fp.homogeneous_why})")
    else:
        ratio = ratio or 0.0
        base = cfg.planning.profiled_class
        lines.append(
            f"against {len(h.nodes)} node(s) of {base} alone (the same peak FLOP/s): {h.samples_per_s:.4g} samples/s; "
            f"the mixed fleet's MFU is {ratio:.3f}x theirs (gap {100 * (1 - ratio):+.1f} %)"
        )
    return "\n".join(lines)
