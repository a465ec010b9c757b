"""Pipeline templates: the best way to run ONE replica on exactly n nodes, for every n.

A template on n nodes has S = n x g / tp stages of contiguous layers. Stage i's time per
microbatch is w_i = compute + its two receives, and T(m) = sum_i w_i + (m - 1) max_i w_i + the
exposed gradient all-reduce (overlap.py). Memory is a hard constraint: parameters, gradients,
optimizer state and the microbatches in flight (S - i under 1F1B, m under GPipe). The search is
exact (partition.py, O(S L^2) per template, its first pass shared by every size), checked against
`brute_force_template` in the tests. docs/planning.md.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from ..comm import Links
from ..errors import PlanningError
from ..profile.profile import ModelProfile
from .overlap import Ready, exposed_sync_s, layer_ready_times
from .partition import StageCosts, best_partition

GIB = 1024**3


@dataclass(frozen=True)
class StageSpec:
    index: int
    """Position of the stage in the pipeline (0 = embedding side)."""
    start: int
    """First layer (inclusive)."""
    end: int
    """Last layer (exclusive)."""
    node: int
    """Node index within the template (0 .. n-1)."""
    local_rank: int
    """First device of the stage on that node (its tensor-parallel lanes follow)."""
    time_s: float
    """Time of one microbatch on this stage: forward + backward + receives from its neighbours."""
    memory_bytes: int
    """Peak memory of one device: params + grads + optimizer state + in-flight activations."""
    comm_s: float = 0.0
    """The part of time_s spent receiving activations and gradients from the neighbours."""
    grad_bytes: int = 0
    """Gradient bytes one device of the stage all-reduces with the other replicas."""
    recompute: bool = False
    """Whether the stage recomputes its activations, as chosen by `training.activation_checkpoint:
    auto` (it does not fit without); False under the other modes (the templates' profile is then
    that mode's)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "layers": [self.start, self.end],
            "node": self.node,
            "local_rank": self.local_rank,
            "time_s": self.time_s,
            "comm_s": self.comm_s,
            "memory_bytes": self.memory_bytes,
            "grad_bytes": self.grad_bytes,
            **({"recompute": True} if self.recompute else {}),
        }


@dataclass(frozen=True)
class Template:
    num_nodes: int
    """Nodes one replica of this template uses."""
    gpus_per_node: int
    """Devices per node."""
    stages: tuple[StageSpec, ...]
    """Stages in pipeline order."""
    total_time_s: float
    """sum of stage times (one microbatch through the whole pipeline)."""
    bottleneck_s: float
    """The slowest stage's time."""
    tensor_parallel: int = 1
    """Devices (lanes) per stage."""
    links: Optional[Links] = None
    """Links the communication was costed with (None: communication not counted)."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def peak_memory_bytes(self) -> int:
        return max(s.memory_bytes for s in self.stages)

    @property
    def compute_s(self) -> float:
        """Forward + backward time of one microbatch through every stage, communication excluded."""
        return sum(s.time_s - s.comm_s for s in self.stages)

    sync_ready: tuple[tuple[Ready, ...], ...] = ()
    """Per stage, its layers' (when the gradient is final, relative to the schedule's end; bytes)
    under 1F1B and GPipe (`make_template`); empty: no all-reduce counted."""

    @functools.cached_property
    def _exposed(self) -> dict[int, float]:
        return {}

    def grad_sync_s(self, replicas: int) -> float:
        """The part of the cross-replica gradient all-reduce the schedule leaves exposed (overlap.py)."""
        if self.links is None or not self.sync_ready:
            return 0.0
        if replicas not in self._exposed:
            self._exposed[replicas] = exposed_sync_s(self.sync_ready, 0.0, self.links, replicas)
        return self._exposed[replicas]

    def iteration_time(self, microbatches: int, replicas: int = 1) -> float:
        """Estimated time of one iteration with `microbatches` microbatches, gradients all-reduced
        among `replicas` pipelines (model above)."""
        return self.total_time_s + (microbatches - 1) * self.bottleneck_s + self.grad_sync_s(replicas)

    def layer_ranges(self) -> list[tuple[int, int]]:
        return [(s.start, s.end) for s in self.stages]

    def to_json(self) -> dict[str, Any]:
        return {
            "num_nodes": self.num_nodes,
            "num_stages": self.num_stages,
            "tensor_parallel": self.tensor_parallel,
            "total_time_s": self.total_time_s,
            "bottleneck_s": self.bottleneck_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "stages": [s.to_json() for s in self.stages],
        }


def best_template(
    costs: StageCosts, num_nodes: int, gpus_per_node: int, tensor_parallel: int = 1
) -> Optional[Template]:
    """The exact minimum-bottleneck template on `num_nodes` nodes, or None when none fits."""
    ranges = best_partition(costs, num_nodes * gpus_per_node // tensor_parallel)
    if ranges is None:
        return None
    return make_template(
        costs, ranges, num_nodes=num_nodes, gpus_per_node=gpus_per_node, tensor_parallel=tensor_parallel
    )


def make_template(
    costs: StageCosts,
    ranges: Sequence[tuple[int, int]],
    *,
    num_nodes: int,
    gpus_per_node: int,
    tensor_parallel: int = 1,
) -> Template:
    """A Template from explicit layer ranges (also used by tests and reconfiguration)."""
    num_stages = len(ranges)
    per_node = gpus_per_node // tensor_parallel
    stages = tuple(
        StageSpec(
            index=i,
            start=u,
            end=v,
            node=i // per_node,
            local_rank=(i % per_node) * tensor_parallel,
            time_s=costs.stage_time(u, v, i, num_stages),
            memory_bytes=costs.memory(u, v, i, num_stages),
            comm_s=costs.comm(u, v, i, num_stages),
            grad_bytes=costs.grad_bytes(u, v),
            recompute=costs.recomputes(u, v, i, num_stages),
        )
        for i, (u, v) in enumerate(ranges)
    )
    return Template(
        num_nodes=num_nodes,
        gpus_per_node=gpus_per_node,
        stages=stages,
        total_time_s=sum(s.time_s for s in stages),
        bottleneck_s=max(s.time_s for s in stages),
        tensor_parallel=tensor_parallel,
        links=costs.links,
        sync_ready=_sync_ready(costs, ranges, [s.recompute for s in stages]),
    )


def _sync_ready(
    costs: StageCosts, ranges: Sequence[tuple[int, int]], recompute: Sequence[bool]
) -> tuple[tuple[Ready, ...], ...]:
    """When each layer's gradient is final under 1F1B or GPipe, relative to the schedule's end:
    stage 0's last backward ends the schedule, and stage s's ended before it by the backwards and
    gradient receives of the stages before it (the cool-down's chain), each stage's layers
    finishing last to first within its last backward (overlap.py)."""
    layers = costs.profile.layers
    out = []
    end = 0.0
    for i, (u, v) in enumerate(ranges):
        backward = [(la.recomputed() if recompute[i] else la).backward_s for la in layers[u:v]]
        out.append(
            tuple(
                layer_ready_times(
                    end - sum(backward), end, backward, [la.grad_bytes for la in layers[u:v]], split=False
                )
            )
        )
        recv = costs.boundary_s(v, i) if i < len(ranges) - 1 else 0.0
        end -= sum(backward) + recv
    return tuple(out)


def brute_force_template(
    costs: StageCosts, num_nodes: int, gpus_per_node: int, microbatches: int, tensor_parallel: int = 1
) -> Optional[tuple[float, list[tuple[int, int]]]]:
    """Reference for tests: try every partition; return (min T(m), ranges) or None. With
    communication, the minimum of (bottleneck, then sum) is the one returned (as the planner's)."""
    n, s = costs.num_layers, num_nodes * gpus_per_node // tensor_parallel
    best: Optional[tuple[tuple[float, float], list[tuple[int, int]]]] = None
    for cuts in itertools.combinations(range(1, n), s - 1):
        bounds = (0, *cuts, n)
        ranges = list(zip(bounds, bounds[1:]))
        if any(costs.memory(u, v, i, s) > costs.memory_limit for i, (u, v) in enumerate(ranges)):
            continue
        times = [costs.stage_time(u, v, i, s) for i, (u, v) in enumerate(ranges)]
        rank = (max(times), sum(times)) if costs.links is not None or microbatches > 1 else (sum(times), 0.0)
        eps = 1e-12 * max(1.0, abs(rank[0]))
        if (
            best is None
            or rank[0] < best[0][0] - eps
            or (abs(rank[0] - best[0][0]) <= eps and rank[1] < best[0][1] - eps)
        ):
            best = (rank, ranges)
    if best is None:
        return None
    times = [costs.stage_time(u, v, i, s) for i, (u, v) in enumerate(best[1])]
    return sum(times) + (microbatches - 1) * max(times), best[1]


@dataclass(frozen=True)
class TemplateSet:
    templates: dict[int, Template]
    """Node count -> template, for every node count that fits in memory."""
    gpus_per_node: int
    """Devices per node."""
    num_layers: int
    """Layers in the model."""
    device_memory_gb: float | None = None
    """Memory of one device (GiB) the templates were planned with."""
    memory_source: str = "planning.device_memory_gb"
    """Where device_memory_gb came from: `planning.device_memory_gb`, or the profile's device."""
    tensor_parallel: int = 1
    """Devices per stage (tensor-parallel lanes); a node runs gpus_per_node / tensor_parallel stages."""
    links: Optional[Links] = None
    """The links communication was costed with (None: not counted)."""
    microbatch_size: Optional[int] = None
    """Samples per microbatch the activations were counted for (None: not recorded; plan_job
    then uses training.microbatch_size)."""
    profile: Optional[ModelProfile] = field(default=None, compare=False, repr=False)
    """The profile the templates were built from (at microbatch_size): what simulated schedules
    are costed with (schedules/choice.py). None: not kept (closed-form schedules only)."""
    activation_checkpoint: str = "none"
    """`training.activation_checkpoint` the templates were built for: `none` or `full` (every stage,
    the profile holds that mode's numbers) or `auto` (per stage, `StageSpec.recompute`)."""

    @property
    def n0(self) -> int:
        """Fewest nodes that can hold one replica."""
        return min(self.templates)

    @property
    def n_max(self) -> int:
        """Largest node count of the contiguous template range starting at n0."""
        n = self.n0
        while n + 1 in self.templates:
            n += 1
        return n

    def sizes(self) -> list[int]:
        return sorted(self.templates)

    def __getitem__(self, num_nodes: int) -> Template:
        return self.templates[num_nodes]

    def to_json(self) -> list[dict[str, Any]]:
        return [self.templates[n].to_json() for n in self.sizes()]


def memory_limit_bytes(device_memory_gb: float, margin: float) -> float:
    return device_memory_gb * GIB * (1.0 - margin)


def build_templates(
    profile: ModelProfile,
    *,
    gpus_per_node: int,
    device_memory_gb: float,
    memory_margin: float = 0.0,
    schedule: str = "1f1b",
    gpipe_microbatches: int = 1,
    max_nodes: Optional[int] = None,
    node_counts: Optional[Iterable[int]] = None,
    memory_source: str = "planning.device_memory_gb",
    tensor_parallel: int = 1,
    links: Optional[Links] = None,
    activation_checkpoint: str = "none",
) -> TemplateSet:
    """Templates for every node count from 1 to min(max_nodes, layers // stages per node) that fit.

    The profile holds per-device numbers at `tensor_parallel` devices per stage, in the mode of
    `activation_checkpoint` (`auto`: without recomputation and recomputed, chosen per stage:
    partition.py). `links` costs the communication (None: compute only). `memory_source` says
    where device_memory_gb came from (`planning.device_memory_gb`, or a description of the
    profiled device); errors name it.
    Raises PlanningError naming the layer and the memory it needs when no template fits.
    """
    if gpus_per_node < 1:
        raise PlanningError(f"gpus_per_node must be >= 1 (got {gpus_per_node})")
    if tensor_parallel < 1 or gpus_per_node % tensor_parallel:
        raise PlanningError(
            f"planning.tensor_parallel={tensor_parallel} must divide planning.gpus_per_node="
            f"{gpus_per_node}: a stage's devices are on one node"
        )
    per_node = gpus_per_node // tensor_parallel
    costs = StageCosts(
        profile,
        memory_limit_bytes=memory_limit_bytes(device_memory_gb, memory_margin),
        schedule=schedule,
        gpipe_microbatches=gpipe_microbatches,
        links=links,
        stages_per_node=per_node,
        recompute_auto=activation_checkpoint == "auto",
    )
    cap = profile.num_layers // per_node
    if cap < 1:
        raise PlanningError(
            f"the model has {profile.num_layers} layers but one node runs {per_node} stages "
            f"({gpus_per_node} devices, {tensor_parallel} per stage) and every stage needs at least one layer: "
            "lower planning.gpus_per_node or raise planning.tensor_parallel"
        )
    if max_nodes is not None:
        cap = min(cap, max_nodes)
    counts = sorted(set(node_counts)) if node_counts is not None else list(range(1, cap + 1))
    templates = {}
    for n in counts:
        if 1 <= n <= profile.num_layers // per_node:
            t = best_template(costs, n, gpus_per_node, tensor_parallel)
            if t is not None:
                templates[n] = t
    if not templates:
        raise PlanningError(_no_fit_message(costs, device_memory_gb, memory_margin, cap * per_node, memory_source))
    return TemplateSet(
        templates=templates,
        gpus_per_node=gpus_per_node,
        num_layers=profile.num_layers,
        device_memory_gb=device_memory_gb,
        memory_source=memory_source,
        tensor_parallel=tensor_parallel,
        links=links,
        activation_checkpoint=activation_checkpoint,
    )


def _no_fit_message(
    costs: StageCosts,
    device_memory_gb: float,
    margin: float,
    max_stages: int,
    memory_source: str = "planning.device_memory_gb",
) -> str:
    if memory_source == "planning.device_memory_gb":
        budget = f"{costs.memory_limit / GIB:.2f} GiB usable of planning.device_memory_gb={device_memory_gb:g}"
        raise_it = "raise planning.device_memory_gb"
    else:  # the device's real memory: raising it in the config would only plan an out-of-memory job
        budget = (
            f"{costs.memory_limit / GIB:.2f} GiB usable of the {device_memory_gb:.2f} GiB of {memory_source} "
            "(planning.device_memory_gb is not set)"
        )
        raise_it = "use devices with more memory"
    if margin:
        budget += f" (memory_margin {margin:g})"
    if costs.recompute_auto:
        mode, more = " even with its activations recomputed (training.activation_checkpoint=auto)", ""
    elif costs.profile.base_mode == "full":
        mode, more = " with its activations recomputed (training.activation_checkpoint=full)", ""
    elif "full" in costs.profile.modes:  # numbers under recomputation: auto can plan with them
        mode, more = "", ", set training.activation_checkpoint=auto (recomputes where a stage needs it)"
    else:
        mode, more = "", ""
    for i, layer in enumerate(costs.profile.layers):
        # a layer alone on the LAST stage has the fewest microbatches in flight: its best case
        need = costs.memory(i, i + 1, max_stages - 1, max_stages)
        if need > costs.memory_limit:
            acts = (layer.recomputed() if costs.recompute_auto else layer).activation_bytes
            return (
                f"the model cannot fit even with one layer per device: layer {i} '{layer.name}' "
                f"alone needs {need / GIB:.2f} GiB{mode} (params+grads+optimizer "
                f"{layer.static_bytes / GIB:.2f} GiB, activations "
                f"{acts / GIB:.2f} GiB per microbatch) but a device has "
                f"{budget}: {raise_it}{more} or lower training.microbatch_size"
            )
    total = costs.memory(0, costs.num_layers, 0, 1)
    return (
        f"no split of the model into at most {max_stages} stages fits in memory{mode} (the whole model "
        f"needs {total / GIB:.2f} GiB for one microbatch; early stages keep more microbatches "
        f"in flight under 1F1B) with {budget}: {raise_it}{more}, lower "
        f"training.microbatch_size, or use more devices per node"
    )
