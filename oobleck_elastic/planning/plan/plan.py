"""The plan: templates instantiated on concrete nodes, a rank for every worker, and its JSON.

A `Plan` is what the leader publishes for one generation and every worker reads: pipelines
(stages with layer ranges and global ranks), spares, donors, estimates, and the host-memory
shadow copies (`ShadowPlacement`) when there are any. Ranks are dense: the i-th node of `nodes`
hosts ranks i*g .. i*g+g-1; donors' workers follow, in the entry only. `Plan.from_json` validates
everything it reads (control data is JSON, never pickle). This module imports nothing from the
builder (build.py). docs/planning.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..errors import PlanningError
from ..schedules.schedules import stage_placement
from ..templates.templates import GIB

PLAN_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class StagePlacement:
    index: int
    """Stage position in its pipeline."""
    start: int
    """First layer (inclusive)."""
    end: int
    """Last layer (exclusive)."""
    node: str
    """Node id that runs the stage."""
    local_rank: int
    """Device / worker on that node: the stage's first tensor-parallel lane (the others follow)."""
    rank: int
    """Global rank of that worker in this generation (lane j has rank + j)."""
    compute_s: float = 0.0
    """Estimated forward + backward time of one microbatch on this stage, communication excluded
    (the template's); what a worker's measured compute time is compared with to find stragglers
    (engine/resilience/straggler.py). 0 = unknown."""
    forward_s: float = 0.0
    """The forward's part of compute_s (the rest is the backward), from the same profile; what a
    paced worker pads its forwards to (engine/stage/paced.py). 0 = unknown."""
    chunks: tuple[tuple[int, int], ...] = ()
    """With more than one chunk per device (interleaved and V schedules): the layer ranges
    [start, end) of the virtual stages this device runs, in pipeline order (`start`/`end` are
    then the first one's). Empty: the one range start..end."""
    chunk_times: tuple[tuple[float, float], ...] = ()
    """With chunks: each chunk's (compute_s, forward_s), as the stage's are (a paced device pads
    each chunk's passes to them). Empty: none, or unknown."""
    activation_checkpoint: Optional[str] = None
    """`none` or `full`: whether this worker recomputes its layers' activations in the backward, as
    the planner chose (`training.activation_checkpoint`; per stage under `auto`). None: not
    recorded (older plans), the worker then runs the config's mode (`auto` there: none)."""
    device_class: Optional[str] = None
    """The device class of the node that runs this stage (`planning.classes`) in a mixed fleet's
    plan; None: every node alike."""

    def layer_ranges(self) -> tuple[tuple[int, int], ...]:
        """The layer ranges this device runs: its chunks', or (start, end)."""
        return self.chunks or ((self.start, self.end),)

    def layers(self) -> Sequence[int]:
        """Every layer this device holds, ascending."""
        if not self.chunks:
            return range(self.start, self.end)
        return tuple(i for u, v in self.chunks for i in range(u, v))

    def holds(self, layer: int) -> bool:
        return any(u <= layer < v for u, v in self.layer_ranges())

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "layers": [self.start, self.end],
            "node": self.node,
            "local_rank": self.local_rank,
            "rank": self.rank,
            "compute_s": self.compute_s,
            **({"forward_s": self.forward_s} if self.forward_s else {}),
            **({"chunks": [list(c) for c in self.chunks]} if self.chunks else {}),
            **({"chunk_times": [list(t) for t in self.chunk_times]} if self.chunk_times else {}),
            **({"activation_checkpoint": self.activation_checkpoint} if self.activation_checkpoint else {}),
            **({"device_class": self.device_class} if self.device_class else {}),
        }


@dataclass(frozen=True)
class PipelineSpec:
    index: int
    """Pipeline (data-parallel replica) index."""
    template_nodes: int
    """Size in nodes of the template it instantiates."""
    nodes: tuple[str, ...]
    """Node ids, in stage order."""
    microbatches: int
    """Microbatches this pipeline runs per step."""
    stages: tuple[StagePlacement, ...]
    """Stages in order."""
    est_time_s: float
    """Estimated iteration time with its microbatches."""
    schedule: str = "1f1b"
    """The pipeline schedule this pipeline runs (planning/schedules/schedules.py's names)."""
    num_chunks: int = 1
    """Virtual stages per device (`StagePlacement.chunks`); 1 = one contiguous stage each."""

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "template_nodes": self.template_nodes,
            "nodes": list(self.nodes),
            "microbatches": self.microbatches,
            "est_time_s": self.est_time_s,
            "schedule": self.schedule,
            "chunks": self.num_chunks,
            "stages": [s.to_json() for s in self.stages],
        }


@dataclass(frozen=True)
class Plan:
    generation: int
    """Bumped by every plan change."""
    nodes: tuple[str, ...]
    """Every member node, in rank order (spares last)."""
    spares: tuple[str, ...]
    """Members that run no stage in this generation."""
    gpus_per_node: int
    """Workers per node."""
    num_layers: int
    """Layers of the model."""
    microbatch_size: int
    """Samples per microbatch."""
    pipelines: tuple[PipelineSpec, ...]
    """The data-parallel replicas."""
    est_step_time_s: float
    """Estimated time of one step (slowest pipeline)."""
    f: int
    """Fault-tolerance target the plan was made for."""
    warnings: tuple[str, ...] = ()
    """Why the plan falls short of the target, if it does."""
    donors: tuple[str, ...] = ()
    """Drained nodes of the previous generation that join this generation's entry only, to hand
    their layers (and optimizer state) over, then leave: draining the last holder of a layer moves
    it instead of losing it. Their workers take the ranks after the stages' (`donor_rank`)."""
    returned: tuple[str, ...] = ()
    """The donors that were declared lost while alive and came back (docs/recovery.md, "A false
    death loses nothing"): the layers they send count as `returned` (in the JSON only when set)."""
    tensor_parallel: int = 1
    """Workers (tensor-parallel lanes) per stage, on one node: lane j of a stage is its worker with
    local rank `local_rank + j` and rank `rank + j`."""
    rebalanced: bool = False
    """This plan only re-splits the previous generation's microbatches among its pipelines at their
    measured speeds (a straggler, engine/resilience/straggler.py): same nodes, stages and ranks; workers move
    to it at a step boundary."""
    shadows: Optional[ShadowPlacement] = None
    """Host-memory shadow copies of every layer, on nodes that do not hold it on their devices
    (shadows.py, fault_tolerance.shadow_copies); None: none (in the JSON only when set)."""

    @property
    def world_size(self) -> int:
        """Workers that train in this generation (ranks 0..world_size-1)."""
        return sum(len(p.stages) for p in self.pipelines) * self.tensor_parallel

    def lane_of(self, stage: StagePlacement, local_rank: int) -> Optional[int]:
        """The tensor-parallel lane of worker `local_rank` in `stage`, or None if not one of its workers."""
        lane = local_rank - stage.local_rank
        return lane if 0 <= lane < self.tensor_parallel else None

    @property
    def entry_world_size(self) -> int:
        """Workers in this generation's entry: the stages' and the donors'."""
        return self.world_size + len(self.donors) * self.gpus_per_node

    def donor_rank(self, node: str, local_rank: int) -> Optional[int]:
        """The entry rank of a donor's worker, or None when `node` is no donor."""
        if node not in self.donors or not 0 <= local_rank < self.gpus_per_node:
            return None
        return self.world_size + self.donors.index(node) * self.gpus_per_node + local_rank

    def entry_ranks(self) -> dict[tuple[str, int], int]:
        """(node, local rank) -> rank in this generation's entry, for the stages and the donors."""
        ranks = {
            (s.node, s.local_rank + j): s.rank + j
            for p in self.pipelines
            for s in p.stages
            for j in range(self.tensor_parallel)
        }
        for d in self.donors:
            for lr in range(self.gpus_per_node):
                rank = self.donor_rank(d, lr)
                assert rank is not None
                ranks[(d, lr)] = rank
        return ranks

    @property
    def num_microbatches(self) -> int:
        return sum(p.microbatches for p in self.pipelines)

    @property
    def samples_per_s(self) -> float:
        return self.num_microbatches * self.microbatch_size / self.est_step_time_s if self.est_step_time_s else 0.0

    def stage_of(self, rank: int) -> tuple[PipelineSpec, StagePlacement]:
        """The pipeline and stage of the worker of `rank` (any of the stage's lanes)."""
        for p in self.pipelines:
            for s in p.stages:
                if s.rank <= rank < s.rank + self.tensor_parallel:
                    return p, s
        raise KeyError(f"rank {rank} has no stage in generation {self.generation}")

    def stage_at(self, node: str, local_rank: int) -> Optional[StagePlacement]:
        """The stage of worker (node, local rank), or None (a spare, or not in this plan)."""
        for p in self.pipelines:
            for s in p.stages:
                if s.node == node and self.lane_of(s, local_rank) is not None:
                    return s
        return None

    def layers_by_worker(self) -> dict[tuple[str, int], Sequence[int]]:
        """(node, local rank) -> the layers that worker holds in this plan (its lane's shards)."""
        return {
            (s.node, s.local_rank + j): s.layers()
            for p in self.pipelines
            for s in p.stages
            for j in range(self.tensor_parallel)
        }

    def holders(self, layer: int, lane: int = 0) -> list[int]:
        """Ranks holding lane `lane` of `layer` (one per pipeline)."""
        return [s.rank + lane for p in self.pipelines for s in p.stages if s.holds(layer)]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "generation": self.generation,
            "nodes": list(self.nodes),
            "spares": list(self.spares),
            "gpus_per_node": self.gpus_per_node,
            "num_layers": self.num_layers,
            "microbatch_size": self.microbatch_size,
            "f": self.f,
            "est_step_time_s": self.est_step_time_s,
            "warnings": list(self.warnings),
            "tensor_parallel": self.tensor_parallel,
            "donors": list(self.donors),
            "pipelines": [p.to_json() for p in self.pipelines],
            **({"rebalanced": True} if self.rebalanced else {}),
            **({"returned": list(self.returned)} if self.returned else {}),
            **({"shadows": self.shadows.to_json()} if self.shadows is not None else {}),
        }

    @classmethod
    def from_json(cls, data: Any) -> "Plan":
        """Parse and validate; raises PlanningError on anything malformed."""
        try:
            if data.get("schema_version") != PLAN_SCHEMA_VERSION:
                raise PlanningError(f"plan schema_version {data.get('schema_version')!r} is not {PLAN_SCHEMA_VERSION}")
            pipelines = tuple(
                PipelineSpec(
                    index=int(p["index"]),
                    template_nodes=int(p["template_nodes"]),
                    nodes=tuple(str(n) for n in p["nodes"]),
                    microbatches=int(p["microbatches"]),
                    est_time_s=float(p["est_time_s"]),
                    schedule=str(p.get("schedule", "1f1b")),
                    num_chunks=int(p.get("chunks", 1)),
                    stages=tuple(
                        StagePlacement(
                            index=int(s["index"]),
                            start=int(s["layers"][0]),
                            end=int(s["layers"][1]),
                            node=str(s["node"]),
                            local_rank=int(s["local_rank"]),
                            rank=int(s["rank"]),
                            compute_s=float(s.get("compute_s", 0.0)),
                            forward_s=float(s.get("forward_s", 0.0)),
                            chunks=tuple((int(u), int(v)) for u, v in _list(s.get("chunks", []), "chunks")),
                            chunk_times=tuple(
                                (float(c), float(f)) for c, f in _list(s.get("chunk_times", []), "chunk_times")
                            ),
                            activation_checkpoint=_recompute_mode(s.get("activation_checkpoint")),
                            device_class=_optional_text(s.get("device_class"), "device_class"),
                        )
                        for s in p["stages"]
                    ),
                )
                for p in data["pipelines"]
            )
            plan = cls(
                generation=int(data["generation"]),
                nodes=tuple(str(n) for n in data["nodes"]),
                spares=tuple(str(n) for n in data["spares"]),
                gpus_per_node=int(data["gpus_per_node"]),
                num_layers=int(data["num_layers"]),
                microbatch_size=int(data["microbatch_size"]),
                pipelines=pipelines,
                est_step_time_s=float(data["est_step_time_s"]),
                f=int(data["f"]),
                warnings=tuple(str(w) for w in data.get("warnings", ())),
                donors=tuple(str(n) for n in _list(data.get("donors", []), "donors")),
                returned=tuple(str(n) for n in _list(data.get("returned", []), "returned")),
                tensor_parallel=int(data.get("tensor_parallel", 1)),
                rebalanced=data.get("rebalanced", False) is True,
                shadows=ShadowPlacement.from_json(data["shadows"]) if data.get("shadows") is not None else None,
            )
        except PlanningError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError, IndexError) as err:
            raise PlanningError(f"malformed plan: {type(err).__name__}: {err}") from None
        plan.check()
        return plan

    def check(self) -> None:
        """Structural invariants: every pipeline covers all layers in order, ranks are dense."""
        tp = self.tensor_parallel
        if tp < 1 or self.gpus_per_node % tp:
            raise PlanningError(
                f"plan generation {self.generation}: tensor_parallel {tp} does not divide "
                f"gpus_per_node {self.gpus_per_node}"
            )
        ranks = sorted(s.rank + j for p in self.pipelines for s in p.stages for j in range(tp))
        if ranks != list(range(len(ranks))):
            raise PlanningError(f"plan generation {self.generation}: ranks are not 0..{len(ranks) - 1}")
        for p in self.pipelines:
            bounds = _pipeline_ranges(p)
            if bounds is None:
                raise PlanningError(
                    f"plan generation {self.generation}: pipeline {p.index} runs {p.num_chunks} chunk(s) per "
                    f"device but its stages list {[len(s.layer_ranges()) for s in p.stages]} ranges"
                )
            contiguous = (
                bool(bounds)
                and bounds[0][0] == 0
                and bounds[-1][1] == self.num_layers
                and all(u < v for u, v in bounds)
                and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            )
            if not contiguous:
                raise PlanningError(
                    f"plan generation {self.generation}: pipeline {p.index} does not "
                    f"cover layers 0..{self.num_layers} contiguously: {bounds}"
                )
            if p.microbatches < 1:
                raise PlanningError(f"plan generation {self.generation}: pipeline {p.index} has no microbatch")
        if len(set(self.donors)) != len(self.donors) or set(self.donors) & set(self.nodes):
            raise PlanningError(
                f"plan generation {self.generation}: donors {list(self.donors)} must be distinct nodes outside the plan"
            )
        if not set(self.returned) <= set(self.donors):
            raise PlanningError(
                f"plan generation {self.generation}: returned nodes {list(self.returned)} must be donors"
            )
        if self.shadows is not None:
            self.shadows.check(self)


def _pipeline_ranges(p: PipelineSpec) -> Optional[list[tuple[int, int]]]:
    """Every layer range of a pipeline in pipeline order (its virtual stages with chunks: loop
    placement puts stage c*D + d on device d; the V of zbv stages d and 2D - 1 - d), or None when
    the stages do not hold `num_chunks` ranges each."""
    if p.num_chunks == 1:
        return None if any(s.chunks for s in p.stages) else [(s.start, s.end) for s in p.stages]
    if any(len(s.chunks) != p.num_chunks for s in p.stages):
        return None
    order = stage_placement(p.schedule, len(p.stages), p.num_chunks)
    seen = [0] * len(p.stages)
    out = []
    for device in order:
        out.append(p.stages[device].chunks[seen[device]])
        seen[device] += 1
    return out


def _optional_text(value: Any, name: str) -> Optional[str]:
    """A stage's optional text field from JSON: absent (None) or a non-empty string."""
    if value is None or (isinstance(value, str) and value):
        return value
    raise PlanningError(f"malformed plan: a stage's {name} is {value!r}, not a name")


def _recompute_mode(value: Any) -> Optional[str]:
    """A stage's `activation_checkpoint` from JSON: none, full, or absent (None)."""
    if value is None or value in ("none", "full"):
        return value
    raise PlanningError(f"malformed plan: a stage's activation_checkpoint is {value!r}, not none or full")


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise PlanningError(f"malformed plan: {name} is {type(value).__name__}, not a list")
    return value


def device_holders(plan: "Plan") -> list[frozenset[str]]:
    """The nodes holding each layer (index = layer) on their devices: every chunk of a stage (with
    chunks `start`/`end` are only the first one's)."""
    holders: list[set[str]] = [set() for _ in range(plan.num_layers)]
    for p in plan.pipelines:
        for s in p.stages:
            for layer in s.layers():
                holders[layer].add(s.node)
    return [frozenset(h) for h in holders]


def fmt_gib(n: float) -> str:
    """Bytes in GiB; small figures (test models) in MiB or bytes."""
    if n == 0 or n >= GIB / 100:
        return f"{n / GIB:.4g} GiB"
    return f"{n / 2**20:.4g} MiB" if n >= 2**20 / 100 else f"{int(n)} bytes"


@dataclass(frozen=True)
class ShadowPlacement:
    """Which nodes keep each layer in host memory, and the budgets that placement respects."""

    copies: int
    """Shadow copies of every layer (fault_tolerance.shadow_copies)."""
    layers: tuple[tuple[str, ...], ...]
    """Layer -> the nodes keeping its shadow copies."""
    layer_bytes: tuple[int, ...]
    """Layer -> bytes of one shadow copy (`shadow_bytes`)."""
    budgets: tuple[tuple[str, int], ...]
    """(node, bytes of host memory shadows may use there), for every node of the plan."""

    def extra(self) -> dict[int, tuple[str, ...]]:
        """{layer: shadow nodes}: copies.py's `extra`."""
        return {layer: nodes for layer, nodes in enumerate(self.layers) if nodes}

    def budget(self) -> dict[str, int]:
        return dict(self.budgets)

    def load(self) -> dict[str, int]:
        """Node -> bytes of the shadows it keeps (0 for a node with none), every budgeted node."""
        out = {node: 0 for node, _ in self.budgets}
        for layer, nodes in enumerate(self.layers):
            for node in nodes:
                out[node] = out.get(node, 0) + self.layer_bytes[layer]
        return out

    def by_node(self) -> dict[str, list[int]]:
        """Node -> the layers it keeps shadows of (nodes with none left out)."""
        out: dict[str, list[int]] = {}
        for layer, nodes in enumerate(self.layers):
            for node in nodes:
                out.setdefault(node, []).append(layer)
        return out

    def check(self, plan: "Plan") -> None:
        """Raises PlanningError unless every layer of `plan` has `copies` distinct shadows on
        nodes of the plan running stages that do not hold it on their devices, within every node's
        budget."""
        head = f"plan generation {plan.generation}: shadow copies:"
        if self.copies < 0:
            raise PlanningError(f"{head} copies must be >= 0 (got {self.copies})")
        if len(self.layers) != plan.num_layers or len(self.layer_bytes) != plan.num_layers:
            raise PlanningError(
                f"{head} {len(self.layers)} layers placed and {len(self.layer_bytes)} sized, "
                f"but the plan has {plan.num_layers}"
            )
        members = set(plan.nodes)
        budget = self.budget()
        if set(budget) != members:
            raise PlanningError(f"{head} budgets are for {sorted(budget)}, not the plan's nodes {sorted(members)}")
        for layer, (nodes, held) in enumerate(zip(self.layers, device_holders(plan))):
            if len(nodes) != self.copies or len(set(nodes)) != len(nodes):
                raise PlanningError(f"{head} layer {layer} has {list(nodes)}, not {self.copies} distinct nodes")
            for node in nodes:
                if node not in members:
                    raise PlanningError(f"{head} layer {layer} on {node}, which is not a node of the plan")
                if node in held:
                    raise PlanningError(f"{head} layer {layer} on {node}, which holds it on its devices")
                if node in plan.spares:
                    raise PlanningError(f"{head} layer {layer} on {node}, a spare (no worker to keep it)")
        for node, used in self.load().items():
            if used > budget[node]:
                raise PlanningError(f"{head} {node} keeps {fmt_gib(used)}, over its budget of {fmt_gib(budget[node])}")

    def to_json(self) -> dict[str, Any]:
        return {
            "copies": self.copies,
            "layers": [list(nodes) for nodes in self.layers],
            "layer_bytes": list(self.layer_bytes),
            "budget_bytes": dict(self.budgets),
        }

    @classmethod
    def from_json(cls, data: Any) -> "ShadowPlacement":
        """Parse (types only; `check` against the plan validates the placement)."""
        if not isinstance(data, dict):
            raise PlanningError(f"malformed plan: shadows is {type(data).__name__}, not an object")
        try:
            layers, sizes, budgets = data["layers"], data["layer_bytes"], data["budget_bytes"]
            if not isinstance(layers, list) or not all(isinstance(x, list) for x in layers):
                raise TypeError("shadows.layers must be a list of lists of nodes")
            if not isinstance(sizes, list) or not isinstance(budgets, dict):
                raise TypeError("shadows.layer_bytes must be a list and shadows.budget_bytes an object")
            return cls(
                copies=_count(data["copies"], "copies"),
                layers=tuple(tuple(str(n) for n in nodes) for nodes in layers),
                layer_bytes=tuple(_count(b, "layer_bytes") for b in sizes),
                budgets=tuple((str(n), _count(b, "budget_bytes")) for n, b in budgets.items()),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise PlanningError(f"malformed plan: shadows: {type(err).__name__}: {err}") from None


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"shadows.{name}: {value!r} is not an integer >= 0")
    return value
