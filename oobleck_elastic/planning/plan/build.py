"""The plan builder: `make_plan` instantiates the templates on concrete nodes for one generation.

The `Plan` type and its JSON are plan/plan.py's; this module only builds one (docs/planning.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Optional, Sequence

from ..errors import PlanningError
from ..schedules.choice import PipelineSchedules
from ..templates.templates import TemplateSet
from .instantiate import Assignment, instantiate, instantiate_near
from .mixed import MixedAssignment
from .placement import bytes_received, keep_layers_in_place, shard_bytes_of
from .plan import PipelineSpec, Plan, StagePlacement
from .recompute import stage_mode

__all__ = ["make_plan", "make_mixed_plan"]


def _forward_s(templates: TemplateSet, ranges: Sequence[tuple[int, int]]) -> float:
    """Forward time of one microbatch through `ranges` in the templates' profile (0: none kept)."""
    if templates.profile is None:
        return 0.0
    return sum(la.forward_s for u, v in ranges for la in templates.profile.layers[u:v])


def _chunk_times(
    templates: TemplateSet, ranges: Sequence[tuple[int, int]], recompute: bool
) -> tuple[tuple[float, float], ...]:
    """Each chunk's (forward + backward, forward) of one microbatch in the templates' profile
    (`recompute`: with the profile's recomputed backward, under auto)."""
    if templates.profile is None or len(ranges) < 2:
        return ()
    layers = templates.profile.layers
    return tuple(
        (
            sum(la.forward_s + (la.recomputed() if recompute else la).backward_s for la in layers[u:v]),
            sum(la.forward_s for la in layers[u:v]),
        )
        for u, v in ranges
    )


def make_plan(
    templates: TemplateSet,
    *,
    nodes: Sequence[str],
    num_microbatches: int,
    microbatch_size: int,
    f: int,
    generation: int = 0,
    microbatch_cap: Optional[int] = None,
    previous: Optional[Plan] = None,
    schedules: Optional[PipelineSchedules] = None,
    schedule: str = "1f1b",
    replan_tolerance: float = 0.0,
) -> Plan:
    """Instantiate templates on `nodes` (ids, in preference order) for one generation. With the
    `previous` plan, the nodes that will run are placed where they keep the most of the layers
    they already hold (fewer layers to copy in the reconfiguration, placement.py); who runs and
    who is a spare still follows the preference order. With `schedules`, each pipeline runs the
    schedule chosen for its microbatches (schedules/choice.py) and its estimate is simulated;
    without, every pipeline runs `schedule` (1f1b or gpipe) under templates.py's closed form.
    With `previous` and `replan_tolerance` > 0, plans that keep the pipelines whose nodes all
    remain (all of them, or all but one or two, `instantiate_near`) compete with the fastest:
    among those whose step is at most that fraction slower, the one whose busiest receiver gets
    the fewest bytes is taken (`planning.replan_tolerance`)."""
    if len(set(nodes)) != len(nodes):
        raise PlanningError(f"duplicate node ids in {list(nodes)}")
    planned = templates if schedules is None else schedules.lines(len(nodes), num_microbatches, f + 1)
    a: Assignment = instantiate(
        planned, num_nodes=len(nodes), num_microbatches=num_microbatches, f=f, microbatch_cap=microbatch_cap
    )
    build = functools.partial(
        _build, templates, nodes=nodes, microbatch_size=microbatch_size, f=f, generation=generation,
        previous=previous, schedules=schedules, schedule=schedule,
    )  # fmt: skip
    plan = build(a)
    if previous is None or replan_tolerance <= 0:
        return plan
    present = set(nodes)
    kept = [p.template_nodes for p in previous.pipelines if all(n in present for n in p.nodes)]
    shards = shard_bytes_of(templates.profile.layers) if templates.profile is not None else [1] * templates.num_layers
    tried = {a.pipelines}
    for level in _dissolutions(kept):  # fewer pipelines formed again first: they move less
        candidates = []
        for dissolved in level:
            left = list(kept)
            for n in dissolved:
                left.remove(n)
            near = instantiate_near(
                planned, kept=left, num_nodes=len(nodes), num_microbatches=num_microbatches, f=f, best=a,
                microbatch_cap=microbatch_cap,
            )  # fmt: skip
            if near is None or near.pipelines in tried or near.makespan_s > a.makespan_s * (1 + replan_tolerance):
                continue
            tried.add(near.pipelines)
            candidate = build(near)
            if candidate.est_step_time_s <= plan.est_step_time_s * (1 + replan_tolerance):
                candidates.append(candidate)
        if candidates:  # the fewest bytes to the busiest receiver, then the shortest step
            held = previous.layers_by_worker()
            return min(
                [plan, *candidates],
                key=lambda q: (
                    max(bytes_received(previous, q, shards, held=held).values(), default=0),
                    q.est_step_time_s,
                ),
            )
    return plan


def _dissolutions(kept: Sequence[int]) -> list[list[tuple[int, ...]]]:
    """Which kept pipelines a re-plan may also form again, by template size, in levels: none;
    one of some size; two (the survivors of a touched pipeline, too few for a template of their
    own, join one or two others)."""
    sizes = sorted(set(kept))
    twos: list[tuple[int, ...]] = [
        (a, b) for i, a in enumerate(sizes) for b in sizes[i:] if a != b or kept.count(a) > 1
    ]
    return [[()], [(n,) for n in sizes], twos]


def _build(
    templates: TemplateSet,
    a: Assignment,
    *,
    nodes: Sequence[str],
    microbatch_size: int,
    f: int,
    generation: int,
    previous: Optional[Plan],
    schedules: Optional[PipelineSchedules],
    schedule: str,
    replicas: Optional[int] = None,
) -> Plan:
    """The plan of assignment `a` on `nodes`, placed to keep `previous`'s layers (make_plan);
    gradients all-reduced among `replicas` pipelines (default: a's)."""
    if previous is not None:
        nodes = keep_layers_in_place(templates, a, list(nodes), previous)
    g = templates.gpus_per_node
    auto = templates.activation_checkpoint == "auto"  # the profile's plain numbers are without recomputation
    pipelines = []
    cursor = 0
    k = replicas or len(a.pipelines)
    for index, (n, mb) in enumerate(a.pipelines):
        tpl = templates[n]
        pnodes = tuple(nodes[cursor : cursor + n])
        cost = schedules.cost(n, mb, k) if schedules is not None else None
        modes = [stage_mode(templates, cost, s.index, s.recompute) for s in tpl.stages]
        stages = tuple(
            StagePlacement(
                index=s.index,
                start=s.start if cost is None else cost.device_ranges(s.index)[0][0],
                end=s.end if cost is None else cost.device_ranges(s.index)[0][1],
                node=pnodes[s.node],
                local_rank=s.local_rank,
                rank=(cursor + s.node) * g + s.local_rank,
                compute_s=s.time_s - s.comm_s if cost is None else cost.device_compute_s[s.index],
                forward_s=_forward_s(templates, ((s.start, s.end),) if cost is None else cost.device_ranges(s.index)),
                chunks=cost.device_ranges(s.index) if cost is not None and cost.chunks > 1 else (),
                chunk_times=(
                    _chunk_times(templates, cost.device_ranges(s.index), auto and modes[s.index] == "full")
                    if cost is not None
                    else ()
                ),
                activation_checkpoint=modes[s.index],
            )
            for s in tpl.stages
        )
        pipelines.append(
            PipelineSpec(
                index=index,
                template_nodes=n,
                nodes=pnodes,
                microbatches=mb,
                stages=stages,
                est_time_s=tpl.iteration_time(mb, k) if cost is None else cost.step_s,
                schedule=schedule if cost is None else cost.schedule,
                num_chunks=1 if cost is None else cost.chunks,
            )
        )
        cursor += n
    plan = Plan(
        generation=generation,
        nodes=tuple(nodes),
        spares=tuple(nodes[cursor:]),
        gpus_per_node=g,
        num_layers=templates.num_layers,
        microbatch_size=microbatch_size,
        pipelines=tuple(pipelines),
        est_step_time_s=a.makespan_s if schedules is None else max(p.est_time_s for p in pipelines),
        f=f,
        warnings=a.warnings,
        tensor_parallel=templates.tensor_parallel,
    )
    plan.check()
    return plan


def make_mixed_plan(
    sets: Mapping[str, TemplateSet],
    a: MixedAssignment,
    *,
    nodes: Mapping[str, Sequence[str]],
    microbatch_size: int,
    f: int,
    generation: int = 0,
    schedules: Optional[Mapping[str, Optional[PipelineSchedules]]] = None,
    schedule: str = "1f1b",
    previous: Optional[Plan] = None,
) -> Plan:
    """The plan of a mixed fleet's assignment `a` (plan/mixed.py) on `nodes[c]` (ids of class c, in
    preference order): each class's pipelines built as `make_plan` builds them (with `previous`,
    its nodes placed to keep the layers they hold), then joined into one plan (the classes'
    running nodes in order, then every spare), each stage naming its class."""
    g = {sets[c].gpus_per_node for c in sets}
    if len(g) != 1:
        raise PlanningError(f"classes with {sorted(g)} devices per node: mixed node sizes are not planned yet")
    parts: list[PipelineSpec] = []
    spares: list[str] = []
    offset = 0  # running nodes of the classes before this one
    for c in sets:
        mine = tuple((n, b) for cc, n, b in a.pipelines if cc == c)
        if len(nodes[c]) < a.nodes_used[c]:
            raise PlanningError(f"class {c}: {len(nodes[c])} node ids for {a.nodes_used[c]} nodes used")
        if not mine:
            spares += nodes[c]
            continue
        part = _build(
            sets[c], Assignment(pipelines=mine, nodes_used=a.nodes_used[c], makespan_s=a.makespan_s),
            nodes=list(nodes[c]), microbatch_size=microbatch_size, f=f, generation=generation, previous=previous,
            schedules=(schedules or {}).get(c), schedule=schedule, replicas=len(a.pipelines),
        )  # fmt: skip
        spares += part.spares
        shift = offset * sets[c].gpus_per_node
        parts += [
            dataclasses.replace(
                p, stages=tuple(dataclasses.replace(s, rank=s.rank + shift, device_class=c) for s in p.stages)
            )
            for p in part.pipelines
        ]
        offset += a.nodes_used[c]
    pipelines = tuple(dataclasses.replace(p, index=i) for i, p in enumerate(parts))
    running = tuple(n for p in pipelines for n in p.nodes)
    first = next(iter(sets.values()))
    plan = Plan(
        generation=generation,
        nodes=running + tuple(spares),
        spares=tuple(spares),
        gpus_per_node=first.gpus_per_node,
        num_layers=first.num_layers,
        microbatch_size=microbatch_size,
        pipelines=pipelines,
        est_step_time_s=max(p.est_time_s for p in pipelines),
        f=f,
        warnings=a.warnings,
        tensor_parallel=first.tensor_parallel,
    )
    plan.check()
    return plan
