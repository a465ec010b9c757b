"""A template's step time and memory under a pipeline schedule, from one simulation.

`schedule_cost` turns a profile and the stages' layer ranges into stage times (F, and B or its
I/W split: measured, else `weight_share`), messages (`Links.p2p_s` across stage boundaries on
different devices), the schedule's placement of stages on devices, and simulates one step
(sim.py). Memory is a hard limit: parameters, gradients, optimizer state and the simulated peak
of activations in flight. The step adds the exposed gradient all-reduce (templates/overlap.py).
Stages flagged `recompute` are costed with the profile's recomputed numbers (`auto`, choice.py).
`chunk_ranges` splits the model into v x D stages exactly. docs/schedules.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ..comm import Links
from ..profile.profile import LayerProfile, ModelProfile
from ..templates.overlap import Ready, exposed_sync_s, layer_ready_times
from ..templates.partition import StageCosts, best_partition
from ..templates.templates import Template
from .schedules import ScheduleError, schedule_order, stage_placement
from .sim import Comm, Simulation, StageTimes, simulate

__all__ = [
    "ScheduleCost",
    "chunk_ranges",
    "schedule_cost",
    "stage_times",
    "template_cost",
]


@dataclass(frozen=True)
class ScheduleCost:
    """One pipeline's step under one schedule, as simulated."""

    schedule: str
    """The schedule's name (schedules.SCHEDULES)."""
    chunks: int
    """Stages per device."""
    microbatches: int
    """Microbatches per step."""
    makespan_s: float
    """The schedule's time: first forward to last backward."""
    grad_sync_s: float
    """The part of the cross-replica gradient all-reduce the schedule does not hide (overlap.py)."""
    bubble_fraction: float
    """Share of the devices' time not computing."""
    peak_in_flight: tuple[int, ...]
    """Per device: the most forwards whose activations it holds at once."""
    activation_bytes: tuple[int, ...]
    """Per device: the peak of activations held."""
    memory_bytes: tuple[int, ...]
    """Per device: parameters + gradients + optimizer state of its stages + activation_bytes."""
    simulation: Simulation
    """The simulation itself (per-action spans, busy and receive times)."""
    ranges: tuple[tuple[int, int], ...] = ()
    """The layer range of every stage, in pipeline order (chunks x devices of them)."""
    placement: tuple[int, ...] = ()
    """The device of every stage."""
    device_compute_s: tuple[float, ...] = ()
    """Per device: forward + backward time of one microbatch through its stages."""
    grad_bytes: tuple[int, ...] = ()
    """Per device: the gradient bytes of its stages (what the all-reduce sums)."""
    sync_ready: tuple[tuple[Ready, ...], ...] = ()
    """Per device: when each of its layers' gradients is final, and its bytes (overlap.py)."""
    recompute: tuple[bool, ...] = ()
    """Per stage (as `ranges`): whether it recomputes its activations (`auto`); empty: none does,
    or every one does when the profile is `full`'s."""

    def for_replicas(self, replicas: int, links: Optional[Links]) -> "ScheduleCost":
        """The same schedule in a job of `replicas` pipelines: only the all-reduce changes (the
        simulation does not depend on it, so the planner need not run it again)."""
        sync = exposed_sync_s(self.sync_ready, self.makespan_s, links, replicas) if links is not None else 0.0
        return dataclasses.replace(self, grad_sync_s=sync)

    def device_ranges(self, device: int) -> tuple[tuple[int, int], ...]:
        """The layer ranges device `device` runs, in pipeline order."""
        return tuple(r for r, d in zip(self.ranges, self.placement) if d == device)

    @property
    def step_s(self) -> float:
        """Estimated step time: the schedule, then the gradient all-reduce."""
        return self.makespan_s + self.grad_sync_s

    @property
    def peak_memory_bytes(self) -> int:
        return max(self.memory_bytes)

    def fits(self, memory_limit_bytes: float) -> bool:
        """Whether every device stays within `memory_limit_bytes`."""
        return self.peak_memory_bytes <= memory_limit_bytes


def _check_ranges(profile: ModelProfile, ranges: Sequence[tuple[int, int]]) -> None:
    bounds = [0] + [v for _, v in ranges]
    if [u for u, _ in ranges] != bounds[:-1] or bounds[-1] != profile.num_layers or any(u >= v for u, v in ranges):
        raise ScheduleError(
            f"stage ranges {list(ranges)} must cover layers 0..{profile.num_layers} contiguously, "
            "at least one layer each"
        )


def _stage_layers(
    profile: ModelProfile, ranges: Sequence[tuple[int, int]], recompute: Sequence[bool]
) -> list[list[LayerProfile]]:
    """Each stage's layers: the recomputed numbers where `recompute` flags the stage."""
    return [
        [la.recomputed() for la in profile.layers[u:v]] if s < len(recompute) and recompute[s] else profile.layers[u:v]
        for s, (u, v) in enumerate(ranges)
    ]


def stage_times(
    profile: ModelProfile,
    ranges: Sequence[tuple[int, int]],
    weight_share: float = 0.5,
    recompute: Sequence[bool] = (),
) -> StageTimes:
    """Per stage forward, input-gradient and weight-gradient times and activation bytes. Where the
    profile measured the split (`LayerProfile.input_grad_s`, `weight_grad_s`), a stage's I and W
    are its layers' measured ones and its full backward B their `backward_s` (measured apart:
    a schedule running B whole does not pay for the split); a layer without them is split by
    `weight_share`. A profile without any measured split: I and W are `weight_share` of the
    stage's backward, and B = I + W. Stages flagged in `recompute` take the recomputed numbers."""
    if not 0.0 <= weight_share <= 1.0:
        raise ScheduleError(f"weight_share must be within [0, 1] (got {weight_share})")
    _check_ranges(profile, ranges)
    stages = _stage_layers(profile, ranges, recompute)
    fwd = [sum(la.forward_s for la in layers) for layers in stages]
    bwd = [sum(la.backward_s for la in layers) for layers in stages]
    act = [sum(la.activation_bytes for la in layers) for layers in stages]
    if not any(la.split_measured for la in profile.layers):
        return StageTimes(
            forward_s=fwd,
            input_grad_s=[b * (1.0 - weight_share) for b in bwd],
            weight_grad_s=[b * weight_share for b in bwd],
            activation_bytes=act,
        )
    split = [[la.split_backward(weight_share) for la in layers] for layers in stages]
    return StageTimes(
        forward_s=fwd,
        input_grad_s=[sum(i for i, _ in stage) for stage in split],
        weight_grad_s=[sum(w for _, w in stage) for stage in split],
        activation_bytes=act,
        backward_s=bwd,
    )


def link_comm(profile: ModelProfile, ranges: Sequence[tuple[int, int]], links: Links, stages_per_node: int) -> Comm:
    """comm(boundary, src, dst): the activation leaving stage `boundary` over the link between
    devices src and dst (one node: device // stages_per_node equal)."""
    out = [profile.layers[v - 1].output_bytes for _, v in ranges]

    def comm(boundary: int, src: int, dst: int) -> float:
        return links.p2p_s(out[boundary], same_node=src // stages_per_node == dst // stages_per_node)

    return comm


def chunk_ranges(profile: ModelProfile, stages: int) -> list[tuple[int, int]]:
    """The least-bottleneck split of the layers into `stages` contiguous stages (forward +
    backward; ties: least total), memory not bounded. ScheduleError when there are fewer layers."""
    costs = StageCosts(profile, memory_limit_bytes=math.inf, schedule="gpipe", gpipe_microbatches=0)
    ranges = best_partition(costs, stages)
    if ranges is None:
        raise ScheduleError(f"the model has {profile.num_layers} layers: it cannot be cut into {stages} stages")
    return ranges


def schedule_cost(
    profile: ModelProfile,
    ranges: Sequence[tuple[int, int]],
    schedule: str,
    microbatches: int,
    *,
    chunks: int = 1,
    links: Optional[Links] = None,
    stages_per_node: int = 1,
    replicas: int = 1,
    weight_share: float = 0.5,
    recompute: Sequence[bool] = (),
) -> ScheduleCost:
    """Simulate `schedule` on len(ranges) / chunks devices, stage s running layers ranges[s],
    recomputed where `recompute[s]` (module docstring). Raises ScheduleError when the ranges do
    not fit the schedule."""
    if len(ranges) % chunks:
        raise ScheduleError(f"{len(ranges)} stages do not divide into {chunks} chunks per device")
    devices = len(ranges) // chunks
    order = schedule_order(schedule, devices, microbatches, chunks)
    placement = stage_placement(schedule, devices, chunks)
    if order.stage_devices() != dict(enumerate(placement)):
        raise ScheduleError(f"schedule {schedule}: its order places stages unlike {placement}")  # a bug here
    times = stage_times(profile, ranges, weight_share, recompute)
    comm = link_comm(profile, ranges, links, stages_per_node) if links is not None else None
    sim = simulate(  # schedule_order's orders are complete
        order, times, comm, checked=True, rebuild=lambda: schedule_order(schedule, devices, microbatches, chunks)
    )
    split = times.backward_s is not None and any(a.kind == "I" for a in order.devices[0])  # split backwards
    static = [0] * devices
    grads = [0] * devices
    compute = [0.0] * devices
    for s, (u, v) in enumerate(ranges):
        static[placement[s]] += sum(la.static_bytes for la in profile.layers[u:v])
        grads[placement[s]] += sum(la.grad_bytes for la in profile.layers[u:v])
        if times.backward_s is not None and not split:  # B measured whole
            compute[placement[s]] += times.forward_s[s] + times.backward_s[s]
        else:
            compute[placement[s]] += times.forward_s[s] + times.input_grad_s[s] + times.weight_grad_s[s]
    ready = sync_ready(profile, ranges, placement, sim, recompute)
    sync = exposed_sync_s(ready, sim.makespan_s, links, replicas) if links is not None else 0.0
    return ScheduleCost(
        schedule=schedule,
        chunks=chunks,
        microbatches=microbatches,
        makespan_s=sim.makespan_s,
        grad_sync_s=sync,
        bubble_fraction=sim.bubble_fraction,
        peak_in_flight=sim.peak_in_flight,
        activation_bytes=sim.peak_activation_bytes,
        memory_bytes=tuple(s + a for s, a in zip(static, sim.peak_activation_bytes)),
        simulation=sim,
        ranges=tuple((int(u), int(v)) for u, v in ranges),
        placement=tuple(placement),
        device_compute_s=tuple(compute),
        grad_bytes=tuple(grads),
        sync_ready=ready,
        recompute=tuple(bool(r) for r in recompute) if any(recompute) else (),
    )


def sync_ready(
    profile: ModelProfile,
    ranges: Sequence[tuple[int, int]],
    placement: Sequence[int],
    sim: Simulation,
    recompute: Sequence[bool] = (),
) -> tuple[tuple[Ready, ...], ...]:
    """Per device, when each of its layers' gradients is final (overlap.py): during its stage's
    last B, layer by layer, or at the end of its last W."""
    devices: list[list[Ready]] = [[] for _ in range(max(placement) + 1)]
    for s, layers in enumerate(_stage_layers(profile, ranges, recompute)):
        start, end, split = sim.last_backward[s]
        devices[placement[s]] += layer_ready_times(
            start, end, [la.backward_s for la in layers], [la.grad_bytes for la in layers], split=split
        )
    return tuple(tuple(d) for d in devices)


def template_cost(
    profile: ModelProfile,
    template: Template,
    schedule: str,
    microbatches: int,
    *,
    chunks: int = 1,
    replicas: int = 1,
    weight_share: float = 0.5,
    ranges: Optional[Sequence[tuple[int, int]]] = None,
    recompute: Sequence[bool] = (),
) -> ScheduleCost:
    """`schedule_cost` of a template: its stages and links for one chunk per device; for more,
    the model re-cut into chunks x stages by `chunk_ranges` on the template's devices (`ranges`:
    that cut, when the caller has it already)."""
    if ranges is None:
        ranges = template.layer_ranges() if chunks == 1 else chunk_ranges(profile, chunks * template.num_stages)
    return schedule_cost(
        profile,
        ranges,
        schedule,
        microbatches,
        chunks=chunks,
        links=template.links,
        stages_per_node=template.gpus_per_node // template.tensor_parallel,
        replicas=replicas,
        weight_share=weight_share,
        recompute=recompute,
    )
