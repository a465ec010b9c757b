"""Pipeline templates: the best way to run ONE replica on exactly n nodes.

A node has g devices; a stage runs on `tensor_parallel` (tp) of them, its layers sharded over
them (tensor parallelism, one "lane" per device), so a template on n nodes has S = n x g / tp
stages; stage k runs the contiguous layers [start, end) on node k // (g / tp), devices
(k % (g / tp)) x tp .. + tp - 1. The profile gives each layer's times and bytes per device at
that tp degree (its collectives included).

Cost model (per 1F1B or GPipe iteration with m microbatches): stage i's time per microbatch is

    w_i = compute(layers of i) + p2p(input of i) + p2p(gradient of the output of i)

the receives of its input activation (forward) and of its output's gradient (backward) over the
link between it and its neighbour (inside a node or across nodes, `comm.Links`; no links = no
communication counted). Then

    T(m) = sum_i w_i + (m - 1) * max_i w_i + grad_sync(replicas)

the first microbatch crosses every stage once, every further one is paced by the bottleneck,
and the cross-replica gradient all-reduce of the largest stage follows the schedule (the engine
does not overlap it). Without communication sum_i w_i is the model's total work, the same for
every partition, so minimising the bottleneck W = max_i w_i minimises T(m) for every m >= 2;
with it, the sums differ only by which layers' outputs cross the boundaries.

Memory is a HARD constraint: stage i of S holds its parameters, gradients and optimizer state
plus the activations of the microbatches in flight: S - i of them under 1F1B, all m under GPipe.

Exact search: a dynamic programme over (stage, layers covered so far) finds the minimal W for
exactly S stages (each stage's cost may depend on its position, its first and its last layer:
memory, links, boundary bytes), then a second pass finds, among partitions with every stage
<= W, the one with the least sum. O(S L^2) per template, vectorised over the first layer with
numpy. `brute_force_template` checks it on small cases in the tests. A stage's cost depends on
its position only through its distance from the last stage (microbatches in flight under 1F1B)
and its links, so the first pass runs from the last stage backwards and is shared by the
templates of every size (`StageCosts.tail`): only the second pass is paid per template.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from .comm import Links
from .profile import ModelProfile

GIB = 1024**3


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
    """First device of the stage on that node (its tensor-parallel lanes follow)."""
    time_s: float
    """Time of one microbatch on this stage: forward + backward + receives from its neighbours."""
    memory_bytes: int
    """Peak memory of one device: params + grads + optimizer state + in-flight activations."""
    comm_s: float = 0.0
    """The part of time_s spent receiving activations and gradients from the neighbours."""
    grad_bytes: int = 0
    """Gradient bytes one device of the stage all-reduces with the other replicas."""

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

    @functools.cached_property
    def _sync_bytes(self) -> int:
        return max(s.grad_bytes for s in self.stages)

    def grad_sync_s(self, replicas: int) -> float:
        """The cross-replica gradient all-reduce after the schedule: its largest stage's."""
        if self.links is None:
            return 0.0
        return self.links.all_reduce_s(self._sync_bytes, replicas, same_node=False)

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


class StageCosts:
    """Prefix sums over a profile: O(1) time and memory of any layer range at any position, and
    the communication of a stage with its neighbours (`links`, `stages_per_node`)."""

    def __init__(
        self,
        profile: ModelProfile,
        *,
        memory_limit_bytes: float,
        schedule: str = "1f1b",
        gpipe_microbatches: int = 1,
        links: Optional[Links] = None,
        stages_per_node: int = 1,
    ) -> None:
        if schedule not in ("1f1b", "gpipe"):
            raise PlanningError(f"unknown schedule '{schedule}': use 1f1b or gpipe")
        self.profile = profile
        self.num_layers = profile.num_layers
        self.memory_limit = float(memory_limit_bytes)
        self.schedule = schedule
        self.gpipe_microbatches = gpipe_microbatches
        self.links = links
        self.stages_per_node = stages_per_node
        self._time = [0.0]
        self._static = [0]
        self._act = [0]
        self._grad = [0]
        for layer in profile.layers:
            self._time.append(self._time[-1] + layer.time_s)
            self._static.append(self._static[-1] + layer.static_bytes)
            self._act.append(self._act[-1] + layer.activation_bytes)
            self._grad.append(self._grad[-1] + layer.grad_bytes)
        self._out = [0] + [layer.output_bytes for layer in profile.layers]  # _out[v]: output of layer v-1
        # the same for every template: [u, v) spans as (L+1) x (L+1) matrices, and each cut's
        # boundary time over a link in a node and across nodes
        t, st, ac = (np.asarray(x, dtype=np.float64) for x in (self._time, self._static, self._act))
        self._span_time = t[None, :] - t[:, None]
        self._span_static = st[None, :] - st[:, None]
        self._span_act = ac[None, :] - ac[:, None]
        cuts = np.arange(self.num_layers + 1)
        self._empty = cuts[:, None] >= cuts[None, :]
        self._cut_s = {
            same: np.array([links.p2p_s(self._out[c], same_node=same) if links else 0.0 for c in cuts])
            for same in (True, False)
        }
        self._matrices: dict[tuple[int, Optional[bool], Optional[bool]], np.ndarray] = {}
        self._tails: dict[int, list[np.ndarray]] = {}  # num_stages % stages_per_node -> tail(0), tail(1), ...

    def time(self, start: int, end: int) -> float:
        """Forward + backward compute of layers [start, end)."""
        return self._time[end] - self._time[start]

    def grad_bytes(self, start: int, end: int) -> int:
        return self._grad[end] - self._grad[start]

    def same_node(self, position: int) -> bool:
        """Whether stages `position` and `position + 1` are on one node."""
        return (position + 1) % self.stages_per_node != 0

    def boundary_s(self, cut: int, position: int) -> float:
        """Time to send the activation leaving layer cut-1 from stage `position` to the next (the
        gradient coming back takes as long)."""
        if self.links is None:
            return 0.0
        return self.links.p2p_s(self._out[cut], same_node=self.same_node(position))

    def comm(self, start: int, end: int, position: int, num_stages: int) -> float:
        """A stage's receives per microbatch: its input (forward) and its output's gradient (backward)."""
        t = self.boundary_s(start, position - 1) if position > 0 else 0.0
        return t + (self.boundary_s(end, position) if position < num_stages - 1 else 0.0)

    def stage_time(self, start: int, end: int, position: int, num_stages: int) -> float:
        return self.time(start, end) + self.comm(start, end, position, num_stages)

    def in_flight(self, position: int, num_stages: int) -> int:
        """Microbatches whose activations stage `position` of `num_stages` keeps at once."""
        if self.schedule == "gpipe":
            return self.gpipe_microbatches
        return num_stages - position

    def memory(self, start: int, end: int, position: int, num_stages: int) -> int:
        return (
            self._static[end]
            - self._static[start]
            + self.in_flight(position, num_stages) * (self._act[end] - self._act[start])
        )

    def matrices(self, position: int, num_stages: int) -> np.ndarray:
        """(L+1) x (L+1) stage times of [u, v) at `position`; inf where u >= v, where it does not
        fit in memory, where stage 0 does not start at 0 or the last stage does not end at L.
        The matrix depends on the position only through the microbatches in flight, whether the
        stage is first or last and which links it receives over: templates of every size share
        them, so they are kept (read-only) for the next template, up to ~64 MB of them."""
        first, last = position == 0, position == num_stages - 1
        key = (
            self.in_flight(position, num_stages),
            None if first else self.same_node(position - 1),
            None if last else self.same_node(position),
        )
        found = self._matrices.get(key)
        if found is None:
            found = self._matrix(*key)
            found.flags.writeable = False
            if len(self._matrices) * found.nbytes > 64e6:
                self._matrices.clear()
            self._matrices[key] = found
        return found

    def tail(self, stages: int, num_stages: int) -> np.ndarray:
        """[u]: the least bottleneck of the last `stages` stages of `num_stages` covering layers
        [u, L) (inf: none fits). A stage's matrix depends on its distance from the end (its
        microbatches in flight, first/last) and on its links, which repeat every
        `stages_per_node` positions; templates have num_stages = nodes x stages_per_node, so every
        template shares one chain: each is computed once, from the one before, and kept."""
        chain = self._tails.setdefault(num_stages % self.stages_per_node, [])
        if not chain:
            chain.append(np.full(self.num_layers + 1, np.inf))
            chain[0][self.num_layers] = 0.0  # no stage left: only the end is covered
        while len(chain) <= stages:  # the stage len(chain) from the end, then the ones after it
            w = self.matrices(num_stages - len(chain), num_stages)
            chain.append(np.maximum(w, chain[-1][None, :]).min(axis=1))
        return chain[stages]

    def _matrix(self, in_flight: int, link_in: Optional[bool], link_out: Optional[bool]) -> np.ndarray:
        """`matrices` for a stage keeping `in_flight` microbatches, receiving its input over a link
        inside a node (True), across nodes (False) or not at all (None: the first stage), and its
        output's gradient likewise (None: the last stage)."""
        n = self.num_layers
        u = np.arange(n + 1)
        mem = self._span_static + in_flight * self._span_act
        bad = self._empty | (mem > self.memory_limit)
        w = self._span_time
        if link_in is None:
            bad |= (u != 0)[:, None]
        else:
            w = w + self._cut_s[link_in][:, None]
        if link_out is None:
            bad |= (u != n)[None, :]
        else:
            w = w + self._cut_s[link_out][None, :]
        return np.where(bad, np.inf, w)


def best_partition(costs: StageCosts, num_stages: int) -> Optional[list[tuple[int, int]]]:
    """The exact minimum-bottleneck partition into `num_stages` stages (ties: least total time),
    or None when none fits in memory (module docstring)."""
    n = costs.num_layers
    if num_stages > n:
        return None
    mats = [costs.matrices(i, num_stages) for i in range(num_stages)]
    if num_stages == 1:
        bottleneck = mats[0][0, n]
    else:  # the first stage, then the least bottleneck of the others from where it ends
        bottleneck = np.maximum(mats[0][0], costs.tail(num_stages - 1, num_stages)).min()
    if not math.isfinite(bottleneck):
        return None
    limit = bottleneck * (1 + 1e-12) + 1e-15
    total = np.full(n + 1, np.inf)
    total[0] = 0.0
    choices = []
    for w in mats:  # total[v]: least sum of stages so far, each <= the bottleneck
        cand = total[:, None] + np.where(w <= limit, w, np.inf)
        arg = cand.argmin(axis=0)
        choices.append(arg)
        total = cand[arg, np.arange(n + 1)]
    ranges = []
    v = n
    for arg in reversed(choices):
        u = int(arg[v])
        ranges.append((u, v))
        v = u
    return ranges[::-1]


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
    )


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
) -> TemplateSet:
    """Templates for every node count from 1 to min(max_nodes, layers // stages per node) that fit.

    The profile holds per-device numbers at `tensor_parallel` devices per stage. `links` costs the
    communication (None: compute only). `memory_source` says where device_memory_gb came from
    (`planning.device_memory_gb`, or a description of the profiled device); errors name it.
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
    for i, layer in enumerate(costs.profile.layers):
        # a layer alone on the LAST stage has the fewest microbatches in flight: its best case
        need = costs.memory(i, i + 1, max_stages - 1, max_stages)
        if need > costs.memory_limit:
            return (
                f"the model cannot fit even with one layer per device: layer {i} '{layer.name}' "
                f"alone needs {need / GIB:.2f} GiB (params+grads+optimizer "
                f"{layer.static_bytes / GIB:.2f} GiB, activations "
                f"{layer.activation_bytes / GIB:.2f} GiB per microbatch) but a device has "
                f"{budget}: {raise_it} or lower training.microbatch_size"
            )
    total = costs.memory(0, costs.num_layers, 0, 1)
    return (
        f"no split of the model into at most {max_stages} stages fits in memory (the whole model "
        f"needs {total / GIB:.2f} GiB for one microbatch; early stages keep more microbatches "
        f"in flight under 1F1B) with {budget}: {raise_it}, lower "
        f"training.microbatch_size, or use more devices per node"
    )
