"""Pipeline templates: the best way to run ONE replica on exactly n nodes.

A template on n nodes has S = n x gpus_per_node stages (one worker per device, one stage per
worker); stage k runs the contiguous layers [start, end) on node k // g, local rank k % g.

Cost model (per 1F1B or GPipe iteration with m microbatches, stage times w_i = fwd + bwd):

    T(m) = sum_i w_i + (m - 1) * max_i w_i

the first microbatch crosses every stage once, every further one is paced by the bottleneck.
For a fixed stage count sum_i w_i is the model's total work, so minimising T(m) for ANY m >= 2
is the same as minimising the bottleneck W = max_i w_i: one partition is optimal for every
microbatch count. (Oobleck's memoised divide-and-conquer keeps one best sub-plan per
sub-problem and is not exact; p2p and gradient all-reduce times are not in the model yet
because they cannot be measured on one CPU machine.)

Memory is a HARD constraint: stage i of S holds its parameters, gradients and optimizer state
plus the activations of the microbatches in flight: S - i of them under 1F1B, all m under GPipe.

Exact search: W is one of the O(L^2) segment costs. For a candidate W, a greedy pass that gives
each stage, left to right, as many layers as fit (time <= W, memory at that stage position <=
limit, while leaving one layer for each later stage) finds an S-stage partition iff one exists:
stage constraints only get looser for later positions and for sub-segments, so greedy reaches at
least as far as any feasible partition after every stage. Binary search over the sorted
candidates then gives the minimal W in O(L^2 log L) for the candidates plus O(L log L) per
template. `brute_force_template` checks this on small cases in the tests.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from .profile import ModelProfile

GIB = 1024 ** 3


class PlanningError(ValueError):
    """The model and the devices cannot be planned; the message says what to change."""


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
    """Device on that node."""
    time_s: float
    """Forward + backward time of one microbatch on this stage."""
    memory_bytes: int
    """Peak memory: params + grads + optimizer state + in-flight activations."""

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "layers": [self.start, self.end], "node": self.node,
                "local_rank": self.local_rank, "time_s": self.time_s,
                "memory_bytes": self.memory_bytes}


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

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def peak_memory_bytes(self) -> int:
        return max(s.memory_bytes for s in self.stages)

    def iteration_time(self, microbatches: int) -> float:
        """Estimated time of one iteration with `microbatches` microbatches (model above)."""
        return self.total_time_s + (microbatches - 1) * self.bottleneck_s

    def layer_ranges(self) -> list[tuple[int, int]]:
        return [(s.start, s.end) for s in self.stages]

    def to_json(self) -> dict[str, Any]:
        return {"num_nodes": self.num_nodes, "num_stages": self.num_stages,
                "total_time_s": self.total_time_s, "bottleneck_s": self.bottleneck_s,
                "peak_memory_bytes": self.peak_memory_bytes,
                "stages": [s.to_json() for s in self.stages]}


class StageCosts:
    """Prefix sums over a profile: O(1) time and memory of any layer range at any position."""

    def __init__(self, profile: ModelProfile, *, memory_limit_bytes: float, schedule: str = "1f1b",
                 gpipe_microbatches: int = 1) -> None:
        if schedule not in ("1f1b", "gpipe"):
            raise PlanningError(f"unknown schedule '{schedule}': use 1f1b or gpipe")
        self.profile = profile
        self.num_layers = profile.num_layers
        self.memory_limit = float(memory_limit_bytes)
        self.schedule = schedule
        self.gpipe_microbatches = gpipe_microbatches
        self._time = [0.0]
        self._static = [0]
        self._act = [0]
        for layer in profile.layers:
            self._time.append(self._time[-1] + layer.time_s)
            self._static.append(self._static[-1] + layer.static_bytes)
            self._act.append(self._act[-1] + layer.activation_bytes)

    def time(self, start: int, end: int) -> float:
        return self._time[end] - self._time[start]

    def in_flight(self, position: int, num_stages: int) -> int:
        """Microbatches whose activations stage `position` of `num_stages` keeps at once."""
        if self.schedule == "gpipe":
            return self.gpipe_microbatches
        return num_stages - position

    def memory(self, start: int, end: int, position: int, num_stages: int) -> int:
        return (self._static[end] - self._static[start]
                + self.in_flight(position, num_stages) * (self._act[end] - self._act[start]))

    def candidate_bottlenecks(self) -> list[float]:
        """Every distinct segment time, sorted: the optimal bottleneck is one of them."""
        t = self._time
        n = self.num_layers
        return sorted({t[v] - t[u] for u in range(n) for v in range(u + 1, n + 1)})


def partition(costs: StageCosts, num_stages: int, bottleneck: float) -> Optional[list[tuple[int, int]]]:
    """Greedy position-aware partition into exactly `num_stages` stages with every stage time
    <= bottleneck and every stage within memory; None if no such partition exists."""
    n = costs.num_layers
    if num_stages > n:
        return None
    ranges = []
    start = 0
    for pos in range(num_stages):
        limit = n - (num_stages - pos - 1)  # leave one layer for every later stage
        end = start
        while (end < limit and costs.time(start, end + 1) <= bottleneck
               and costs.memory(start, end + 1, pos, num_stages) <= costs.memory_limit):
            end += 1
        if end == start:
            return None
        ranges.append((start, end))
        start = end
    return ranges if start == n else None


def best_template(costs: StageCosts, num_nodes: int, gpus_per_node: int,
                  candidates: Optional[Sequence[float]] = None) -> Optional[Template]:
    """The exact minimum-bottleneck template on `num_nodes` nodes, or None when none fits."""
    num_stages = num_nodes * gpus_per_node
    if partition(costs, num_stages, math.inf) is None:
        return None
    cands = candidates if candidates is not None else costs.candidate_bottlenecks()
    lo = bisect.bisect_left(cands, costs.time(0, costs.num_layers) / num_stages - 1e-12)
    lo = max(0, min(lo, len(cands) - 1))
    hi = len(cands) - 1
    while lo < hi:  # first candidate that is feasible (feasibility is monotone in W)
        mid = (lo + hi) // 2
        if partition(costs, num_stages, cands[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    ranges = partition(costs, num_stages, cands[lo])
    if ranges is None:  # the largest candidate is the whole model: always feasible if any is
        ranges = partition(costs, num_stages, math.inf)
    assert ranges is not None
    return make_template(costs, ranges, num_nodes=num_nodes, gpus_per_node=gpus_per_node)


def make_template(costs: StageCosts, ranges: Sequence[tuple[int, int]], *, num_nodes: int,
                  gpus_per_node: int) -> Template:
    """A Template from explicit layer ranges (also used by tests and reconfiguration)."""
    num_stages = len(ranges)
    stages = tuple(
        StageSpec(index=i, start=u, end=v, node=i // gpus_per_node, local_rank=i % gpus_per_node,
                  time_s=costs.time(u, v), memory_bytes=costs.memory(u, v, i, num_stages))
        for i, (u, v) in enumerate(ranges))
    return Template(num_nodes=num_nodes, gpus_per_node=gpus_per_node, stages=stages,
                    total_time_s=sum(s.time_s for s in stages),
                    bottleneck_s=max(s.time_s for s in stages))


def brute_force_template(costs: StageCosts, num_nodes: int, gpus_per_node: int,
                         microbatches: int) -> Optional[tuple[float, list[tuple[int, int]]]]:
    """Reference for tests: try every partition; return (min T(m), ranges) or None."""
    n, s = costs.num_layers, num_nodes * gpus_per_node
    best: Optional[tuple[float, list[tuple[int, int]]]] = None
    for cuts in itertools.combinations(range(1, n), s - 1):
        bounds = (0, *cuts, n)
        ranges = list(zip(bounds, bounds[1:]))
        if any(costs.memory(u, v, i, s) > costs.memory_limit for i, (u, v) in enumerate(ranges)):
            continue
        times = [costs.time(u, v) for u, v in ranges]
        t = sum(times) + (microbatches - 1) * max(times)
        if best is None or t < best[0] - 1e-12:
            best = (t, ranges)
    return best


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


def build_templates(profile: ModelProfile, *, gpus_per_node: int, device_memory_gb: float,
                    memory_margin: float = 0.0, schedule: str = "1f1b",
                    gpipe_microbatches: int = 1, max_nodes: Optional[int] = None,
                    node_counts: Optional[Iterable[int]] = None,
                    memory_source: str = "planning.device_memory_gb") -> TemplateSet:
    """Templates for every node count from 1 to min(max_nodes, layers // gpus_per_node) that fit.

    `memory_source` says where device_memory_gb came from (`planning.device_memory_gb`, or a
    description of the profiled device); errors name it. Raises PlanningError naming the layer
    and the memory it needs when no template fits.
    """
    if gpus_per_node < 1:
        raise PlanningError(f"gpus_per_node must be >= 1 (got {gpus_per_node})")
    costs = StageCosts(profile, memory_limit_bytes=memory_limit_bytes(device_memory_gb, memory_margin),
                       schedule=schedule, gpipe_microbatches=gpipe_microbatches)
    cap = profile.num_layers // gpus_per_node
    if cap < 1:
        raise PlanningError(
            f"the model has {profile.num_layers} layers but one node has {gpus_per_node} devices and "
            f"every device needs at least one layer: lower planning.gpus_per_node")
    if max_nodes is not None:
        cap = min(cap, max_nodes)
    counts = sorted(set(node_counts)) if node_counts is not None else list(range(1, cap + 1))
    candidates = costs.candidate_bottlenecks()
    templates = {}
    for n in counts:
        if 1 <= n <= profile.num_layers // gpus_per_node:
            t = best_template(costs, n, gpus_per_node, candidates)
            if t is not None:
                templates[n] = t
    if not templates:
        raise PlanningError(_no_fit_message(costs, device_memory_gb, memory_margin, cap * gpus_per_node,
                                            memory_source))
    return TemplateSet(templates=templates, gpus_per_node=gpus_per_node, num_layers=profile.num_layers,
                       device_memory_gb=device_memory_gb, memory_source=memory_source)


def _no_fit_message(costs: StageCosts, device_memory_gb: float, margin: float, max_stages: int,
                    memory_source: str = "planning.device_memory_gb") -> str:
    if memory_source == "planning.device_memory_gb":
        budget = f"{costs.memory_limit / GIB:.2f} GiB usable of planning.device_memory_gb={device_memory_gb:g}"
        raise_it = "raise planning.device_memory_gb"
    else:  # the device's real memory: raising it in the config would only plan an out-of-memory job
        budget = (f"{costs.memory_limit / GIB:.2f} GiB usable of the {device_memory_gb:.2f} GiB of {memory_source} "
                  "(planning.device_memory_gb is not set)")
        raise_it = "use devices with more memory"
    if margin:
        budget += f" (memory_margin {margin:g})"
    for i, layer in enumerate(costs.profile.layers):
        # a layer alone on the LAST stage has the fewest microbatches in flight: its best case
        need = costs.memory(i, i + 1, max_stages - 1, max_stages)
        if need > costs.memory_limit:
            return (f"the model cannot fit even with one layer per device: layer {i} '{layer.name}' "
                    f"alone needs {need / GIB:.2f} GiB (params+grads+optimizer "
                    f"{layer.static_bytes / GIB:.2f} GiB, activations "
                    f"{layer.activation_bytes / GIB:.2f} GiB per microbatch) but a device has "
                    f"{budget}: {raise_it} or lower training.microbatch_size")
    total = costs.memory(0, costs.num_layers, 0, 1)
    return (f"no split of the model into at most {max_stages} stages fits in memory (the whole model "
            f"needs {total / GIB:.2f} GiB for one microbatch; early stages keep more microbatches "
            f"in flight under 1F1B) with {budget}: {raise_it}, lower "
            f"training.microbatch_size, or use more devices per node")
