"""System models: how each training system reacts to nodes leaving and joining.

Every model is replayed over the same node events by `replay`. The story: docs/simulate.md.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..config import FaultToleranceConfig
from .shadows import SHADOW_STEP_OVERHEAD, host_bytes_per_node, loss_outcome, step_overhead
from .timeline import Timeline
from .trace import NodeEvent

Throughput = Callable[[int], float]


@dataclass
class SystemModel:
    """Common parameters; subclasses implement `react`."""

    name: str
    throughput: Throughput
    """Failure-free samples/s with n nodes (0: cannot run)."""
    batch: float
    """Samples per step."""
    min_nodes: int = 1
    """Fewer usable nodes than this: the job stops."""
    checkpoint_every: Optional[int] = None
    """Steps between checkpoints (None: none)."""
    checkpoint_s: float = 0.0
    """Stall of one checkpoint."""
    redundant_fraction: float = 0.0
    """Share of compute time spent on redundant work."""
    configured: list[str] = field(default_factory=list)
    """Nodes of the running configuration, in order."""

    def timeline(self) -> Timeline:
        return Timeline(
            batch=self.batch,
            checkpoint_every=self.checkpoint_every,
            checkpoint_s=self.checkpoint_s,
            redundant_fraction=self.redundant_fraction,
        )

    def rate(self, n: int) -> float:
        return self.throughput(n) if n >= self.min_nodes else 0.0

    def configure(self, tl: Timeline, up: list[str], *, cost: float, category: str) -> None:
        """Take every usable node into a new configuration after a stall of `cost`."""
        self.configured = list(up)
        tl.stall(cost, category)
        tl.set_rate(self.rate(len(up)))

    def react(self, tl: Timeline, removed: list[str], added: list[str], up: list[str]) -> None:
        raise NotImplementedError


@dataclass
class Oobleck(SystemModel):
    reconfiguration_s: float = 0.0

    def react(self, tl: Timeline, removed: list[str], added: list[str], up: list[str]) -> None:
        if removed or tl.rate <= 0:
            tl.lose_partial_step()
            self.configure(tl, up, cost=self.reconfiguration_s, category="reconfiguration")


@dataclass
class Varuna(SystemModel):
    restart_s: float = 0.0

    def react(self, tl: Timeline, removed: list[str], added: list[str], up: list[str]) -> None:
        if removed or tl.rate <= 0:
            tl.rollback()
            self.configure(tl, up, cost=self.restart_s, category="restart")


CheckpointRestart = Varuna  # the same mechanism; its own throughput, costs and interval


@dataclass
class Bamboo(SystemModel):
    reconfiguration_s: float = 0.0
    restart_s: float = 30.0
    _layout: list[str] = field(default_factory=list)  # node ring when the redundancy was last complete
    _exposed: set[str] = field(default_factory=set)  # nodes lost since then
    _reconfigured_at: float = 0.0

    def react(self, tl: Timeline, removed: list[str], added: list[str], up: list[str]) -> None:
        if tl.rate <= 0 and not removed:
            self._restart(tl, up)
            return
        if not removed:
            return
        if tl.t >= self._reconfigured_at:  # the last reconfiguration restored the redundancy
            self._layout, self._exposed = list(self.configured), set()
        ring = {x: i for i, x in enumerate(self._layout)}
        n = len(self._layout)
        down = self._exposed | set(removed)
        fatal = (
            any(
                x in ring and (self._layout[(ring[x] + 1) % n] in down or self._layout[ring[x] - 1] in down)
                for x in removed
            )
            if n > 1
            else bool(removed)
        )
        if fatal or tl.rate <= 0:
            tl.lose_partial_step()
            self._restart(tl, up)
            return
        self._exposed |= set(removed)
        slower = 0.5 * (tl.batch / tl.rate - tl.into_step)
        tl.finish_step_now(extra_s=slower)  # the predecessor's copy finishes the step, 1.5x slower
        self.configure(tl, up, cost=self.reconfiguration_s, category="reconfiguration")
        self._reconfigured_at = tl.busy_until

    def _restart(self, tl: Timeline, up: list[str]) -> None:
        self.configure(tl, up, cost=self.restart_s, category="restart")
        self._layout, self._exposed, self._reconfigured_at = list(up), set(), tl.busy_until


def machine_loss_detection_s(ft: Optional[FaultToleranceConfig] = None) -> float:
    """How long this project takes to declare a lost machine lost: the one detection model of the
    simulations (`--paper` and `--scale`), whose traces remove machines. A machine that fails
    (power, kernel, network) closes no socket and answers no ping, so its lease decides:
    `fault_tolerance.lease_ttl_s` + `settle_s` (5.5 s with the defaults). A killed process is found
    sooner (its liveness socket closes; the time is in bench/RESULTS.md), but that is not what the
    traces record."""
    ft = ft if ft is not None else FaultToleranceConfig()
    return ft.lease_ttl_s + ft.settle_s


@dataclass
class OobleckElastic(SystemModel):
    detection_s: float = field(default_factory=machine_loss_detection_s)
    """Failure to the next plan (`machine_loss_detection_s`)."""
    replan_s: float = 0.05
    """Planner time per event."""
    replica_bytes: float = 0.0
    """Bytes of one replica's params + optimizer state."""
    node_bandwidth_b_s: float = 12.5e9
    """Bytes/s one node receives layers at."""
    restart_s: float = 60.0
    """Restoring the checkpoint after a lost layer."""
    pipelines: Callable[[int], list[int]] = lambda n: [n]
    """Node counts of the pipelines of the plan for n nodes."""
    shadow_copies: int = 0
    """Host-memory shadow copies of every layer (`fault_tolerance.shadow_copies`)."""
    shadow_overhead: float = SHADOW_STEP_OVERHEAD
    """Failure-free step-time overhead of one shadow copy of every layer (a fraction)."""
    num_layers: int = 0
    """The model's layers, where shadows are placed layer by layer (0: unknown)."""

    def __post_init__(self) -> None:
        overhead = step_overhead(self.shadow_copies, self.shadow_overhead)
        if overhead > 0:  # the upkeep's share of every step
            self.redundant_fraction = overhead / (1 + overhead)

    def rate(self, n: int) -> float:
        return super().rate(n) / (1 + step_overhead(self.shadow_copies, self.shadow_overhead))

    def loss(self, running: list[str]) -> str:
        """`replica`, `shadow` or `restore` for losing `running` at once (`simulate.shadows`)."""
        if not self.layers_lost(running):
            return "replica"
        if self.shadow_copies <= 0:
            return "restore"
        sizes = self.pipelines(len(self.configured))
        return loss_outcome(self.configured, sizes, running, self.shadow_copies, self.num_layers)

    def transfer_s(self, pipeline_nodes: int, nodes_lost: int = 1) -> float:
        """Copying the share of a replica that `nodes_lost` nodes of a pipeline held."""
        if pipeline_nodes <= 0:
            return 0.0
        return self.replica_bytes * nodes_lost / pipeline_nodes / self.node_bandwidth_b_s

    def layers_lost(self, removed: list[str]) -> bool:
        """Whether `removed` held every copy of some layer: pipelines hold equal contiguous shares
        of the model on their nodes, in node order; a layer is lost when, in every pipeline, one
        of the removed nodes held it."""
        sizes = self.pipelines(len(self.configured))
        gone = set(removed)
        lost_spans: Optional[list[tuple[float, float]]] = None  # where every pipeline so far lost its copy
        cursor = 0
        for size in sizes:
            nodes = self.configured[cursor : cursor + size]
            cursor += size
            spans = [(i / size, (i + 1) / size) for i, x in enumerate(nodes) if x in gone]
            lost_spans = spans if lost_spans is None else _intersect(lost_spans, spans)
            if not lost_spans:
                return False
        return bool(lost_spans)

    def react(self, tl: Timeline, removed: list[str], added: list[str], up: list[str]) -> None:
        running = [x for x in removed if x in self.configured]
        if tl.rate <= 0 and len(up) >= self.min_nodes:  # (re)start
            self._configure(tl, up, cost=self.replan_s)
            return
        if running:
            outcome = self.loss(running) if len(up) >= self.min_nodes else "too few nodes"
            if outcome == "restore":
                tl.counts["restores"] = tl.counts.get("restores", 0) + 1
            elif outcome == "shadow":  # what a restore would have rolled back is kept
                tl.counts["shadow_recoveries"] = tl.counts.get("shadow_recoveries", 0) + 1
                tl.counts["steps_not_redone"] = tl.counts.get("steps_not_redone", 0) + tl.steps_since_checkpoint
            if outcome in ("restore", "too few nodes"):
                tl.rollback()
                self.configure(tl, up, cost=self.detection_s + self.restart_s, category="restart")
                return
            tl.lose_partial_step()
            sizes = self.pipelines(len(self.configured)) or [1]
            cost = self.detection_s + self.replan_s + self.transfer_s(min(sizes), len(running))
            self.configure(tl, up, cost=cost, category="reconfiguration")
        elif added and tl.rate > 0:  # admitted at the step boundary: the step in flight completes first
            sizes = self.pipelines(len(up)) or [1]
            tl.finish_step_now()
            self.configure(
                tl, up, cost=self.replan_s + self.transfer_s(min(sizes), len(added)), category="reconfiguration"
            )

    def _configure(self, tl: Timeline, up: list[str], *, cost: float) -> None:
        """A (re)start; the first one records the shadows' host memory per node (reported only)."""
        self.configure(tl, up, cost=cost, category="reconfiguration")
        if self.shadow_copies > 0 and "host_shadow_bytes_per_node" not in tl.counts:
            tl.counts["host_shadow_bytes_per_node"] = host_bytes_per_node(
                self.configured,
                self.pipelines(len(self.configured)),
                self.shadow_copies,
                self.replica_bytes,
                self.num_layers,
            )


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for u1, v1 in a:
        for u2, v2 in b:
            u, v = max(u1, u2), min(v1, v2)
            if v - u > 1e-12:
                out.append((u, v))
    return out


def replay(
    system: SystemModel, events: list[NodeEvent], *, provisioning_s: float = 0.0, end_s: Optional[float] = None
) -> Timeline:
    """Run `system` over `events` until `end_s` (default: the last event); returns its timeline."""
    changes: list[tuple[float, int, str, str]] = []  # (time, order, kind, node): removals first
    removed_at: dict[str, float] = {}
    for e in events:
        if e.kind == "remove":
            changes.append((e.time_s, 0, "remove", e.node))
            removed_at.setdefault(e.node, e.time_s)
    for e in events:
        if e.kind == "add":
            ready = e.time_s + provisioning_s
            if removed_at.get(e.node, float("inf")) > ready:
                changes.append((ready, 1, "add", e.node))
    changes.sort()
    end = end_s if end_s is not None else max(e.time_s for e in events)
    tl = system.timeline()
    up: list[str] = []
    members: set[str] = set()  # the nodes of `up`: membership in O(1) at 10,000 nodes
    i = 0
    while i < len(changes) and changes[i][0] <= end:
        t = changes[i][0]
        _advance(tl, system, up, t)  # up to the change, with the nodes up until then
        removed, added = [], []
        while i < len(changes) and changes[i][0] == t:
            _, _, kind, node = changes[i]
            if kind == "remove" and node in members:
                up.remove(node)
                members.discard(node)
                removed.append(node)
            elif kind == "add" and node not in members:
                bisect.insort(up, node, key=_node_key)
                members.add(node)
                added.append(node)
            i += 1
        if removed or added:
            system.react(tl, removed, added, up)
    _advance(tl, system, up, end)
    return tl


def _advance(tl: Timeline, system: SystemModel, up: list[str], until: float) -> None:
    """Advance the timeline and count node-time: the nodes of the running configuration that are
    still up train while the timeline trains; every other usable node, and all of them during
    stalls, checkpoints and stops, is idle."""
    start = tl.t
    trained_before = tl.breakdown["useful"] + tl.breakdown["redundant"]
    tl.advance(until)
    span = tl.t - start
    if span <= 0:
        return
    trained = tl.breakdown["useful"] + tl.breakdown["redundant"] - trained_before
    training = len(set(system.configured) & set(up))
    tl.node_s += len(up) * span
    tl.idle_node_s += len(up) * span - training * trained


def _node_key(name: str) -> tuple[str, int]:
    head = name.rstrip("0123456789")
    tail = name[len(head) :]
    return (head, int(tail) if tail else -1)
