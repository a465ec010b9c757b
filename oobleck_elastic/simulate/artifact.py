"""The Oobleck artifact's simulator, mechanism by mechanism, with each of its slips a named correction.

`oobleck simulate --paper --artifact` replays the paper's traces through this model. The
story: docs/simulate.md.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional, Sequence

from .trace import NodeEvent

ADD, REMOVE, READY, GLOBAL_TIMEOUT, LOCAL_TIMEOUT, STEP, CHECKPOINT = 1, 2, 4, 5, 6, 7, 8
CREATING, WAITING, RUNNING = "creating", "ready", "running"
STOPPED, RENDEZVOUS = "stopped", "rendezvous"
STAGES = 12


@dataclass(frozen=True)
class Corrections:
    """Departures from the artifact's simulator; each True applies one (all False: the artifact)."""

    stale_timeout: bool = False
    """A rendezvous timeout left over from an earlier rendezvous is ignored (the artifact lets it
    complete the new rendezvous early, and, once that one is done, stop the running job)."""
    stop_at_failure: bool = False
    """A failure stops the running configuration (the artifact keeps completing its steps during
    the restart or reconfiguration, until the new configuration starts)."""
    restart_time: bool = False
    """Varuna's restart takes its listed restart time (the artifact subtracts the checkpoint time)."""
    checkpoint_failure: bool = False
    """A checkpoint fails only when a removal comes before its stall ends, and a failed checkpoint
    only goes unrecorded (the artifact scans its event heap in storage order, schedules the
    completion a second checkpoint time late, and zeroes the last 10 steps)."""
    spot_rollback: bool = False
    """Varuna rolls back to its checkpoint on every trace (the artifact's script turns the rollback
    off on the spot traces for BERT-large, GPT-2 and GPT-3-medium)."""
    no_forced_checkpoint: bool = False
    """Varuna checkpoints every 10 steps only (the artifact also checkpoints after the first step
    completed after each removal)."""
    run_span: bool = False
    """The average is over the whole trace, t = 0 to its last event (the artifact's: from the first
    configuration to the last completed step)."""

    @classmethod
    def names(cls) -> list[str]:
        return [f.name.replace("_", "-") for f in fields(cls)]

    @classmethod
    def parse(cls, text: str) -> "Corrections":
        """`all`, `none`, or comma-separated names (e.g. `stale-timeout,run-span`)."""
        text = text.strip()
        if text in ("", "none"):
            return cls()
        if text == "all":
            return cls(**{f.name: True for f in fields(cls)})
        chosen = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [x for x in chosen if x not in cls.names()]
        if unknown:
            raise ValueError(f"unknown correction(s) {unknown}: choose from all, none, {', '.join(cls.names())}")
        return cls(**{x.replace("-", "_"): True for x in chosen})

    def label(self) -> str:
        on = [n for n, f in zip(self.names(), fields(self)) if getattr(self, f.name)]
        return ",".join(on) if on else "artifact"


ALL = Corrections.parse("all")


@dataclass(eq=False)
class _Event:
    t: int
    kind: int
    data: Any = None

    def __lt__(self, other: "_Event") -> bool:  # the heap orders by (time, kind) only
        return (self.t, self.kind) < (other.t, other.kind)


class StepLog:
    """Completed steps as the artifact logs them: two parallel lists, segment bounds (hours) and
    the segment's samples/s (the second entry of each pair counts). Zeroing operates on the rate
    list; zeroing more entries than it holds pads it with zeros, after which the artifact's lists
    are out of step, and so are these."""

    def __init__(self) -> None:
        self.xs: list[float] = []
        self.ys: list[float] = []

    def add(self, start_ms: int, end_ms: int, samples: float) -> None:
        rate = samples / ((end_ms - start_ms) / 1000) if end_ms > start_ms else 0.0
        self.xs += [start_ms / 3.6e6, end_ms / 3.6e6]
        self.ys += [rate, rate]

    def zero_from(self, hours: float) -> None:
        """Zero the segment that starts at `hours` and everything after (if none starts there,
        whatever follows the last paired entry)."""
        pairs = min(len(self.xs), len(self.ys))
        idx = next((i for i in range(pairs) if self.xs[i] == hours), pairs - 1)
        self.ys[idx + 1 :] = [0.0] * len(self.ys[idx + 1 :])

    def zero_all(self) -> None:
        self.ys[:] = [0.0] * len(self.ys)

    def zero_last(self, steps: int) -> None:
        self.ys[-2 * steps :] = [0.0] * (2 * steps)

    def samples_h(self) -> float:
        """Samples/s x hours over the segments (the pairs as the artifact reads them)."""
        total, first = 0.0, None
        for x, y in zip(self.xs, self.ys):
            if first is None:
                first = x
            else:
                total += (x - first) * y
                first = None
        return total


@dataclass
class Node:
    start: int
    state: str = CREATING
    coords: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class ArtifactSystem:
    """One system of the artifact's simulator on one trace; `run()` returns average samples/s."""

    batch: float
    """Samples per step."""
    throughput: Callable[[int], float]
    """Samples/s with n ready or running nodes (the table; entry 15 below 15, entry 30 above)."""
    timeout_ms: int
    """Rendezvous timeout after a removal (Oobleck: reconfiguration)."""
    corrections: Corrections = Corrections()
    """Departures from the artifact applied."""
    zero_step_ms: int = 10**12
    """Step length when the table says 0 samples/s (the artifact: it never completes)."""

    def __post_init__(self) -> None:
        self.events: list[_Event] = []
        self.nodes: dict[str, Node] = {}
        self.status = STOPPED
        self.rendezvous: list[str] = []
        self.generation = 0  # rendezvous started (stale-timeout correction)
        self.version = 0  # configurations completed
        self.pipelines = 0
        self.waiting = 0
        self.step_ms = 0
        self.steps = 0
        self.log = StepLog()
        self.start_ms: Optional[int] = None
        self.prev_end = 0

    # --- events
    def push(self, t: int, kind: int, data: Any = None) -> None:
        heapq.heappush(self.events, _Event(int(t), kind, data))

    def run(self, trace: Sequence[NodeEvent]) -> float:
        for e in trace:
            self.push(round(e.time_s * 1000), ADD if e.kind == "add" else REMOVE, e.node)
        heapq.heapify(self.events)
        end = self.events[-1].t  # the heap's last slot: the trace's last event for sorted traces
        while self.events:
            ev = heapq.heappop(self.events)
            if ev.t >= end:
                break
            self.handle(ev)
        return self.average(end)

    def handle(self, ev: _Event) -> None:
        if ev.kind == ADD:
            self.nodes[ev.data] = Node(ev.t)
            self.push(ev.t + 45_000, READY, ev.data)
        elif ev.kind == REMOVE:
            node = self.nodes.pop(ev.data)
            self.on_remove(ev.t, ev.data, node)
        elif ev.kind == READY:
            self.on_ready(ev.t, ev.data)
        elif ev.kind in (GLOBAL_TIMEOUT, LOCAL_TIMEOUT):
            if self.corrections.stale_timeout and ev.data != self.generation:
                return
            self.on_timeout(ev.t, ev.kind)
        elif ev.kind == STEP:
            if ev.data == self.version:
                self.on_step(ev.t)

    def average(self, end: int) -> float:
        if self.start_ms is None or not self.log.xs:
            return 0.0
        if self.corrections.run_span:
            return self.log.samples_h() / (end / 3.6e6) if end > 0 else 0.0
        span = self.log.xs[-1] - self.start_ms / 3.6e6
        return self.log.samples_h() / span if span > 0 else 0.0

    # --- the rendezvous engine
    def up(self) -> list[str]:
        return [n for n, x in self.nodes.items() if x.state != CREATING]

    def start_rendezvous(self, t: int, kind: int) -> None:
        if self.corrections.stop_at_failure and self.status == RUNNING:
            self.version += 1  # the running configuration's steps stop counting now
        self.status = RENDEZVOUS
        self.rendezvous = self.up()
        self.generation += 1
        self.push(t + self.timeout(kind), kind, self.generation)

    def timeout(self, kind: int) -> int:
        return self.timeout_ms

    def on_ready(self, t: int, name: str) -> None:
        node = self.nodes.get(name)
        if node is None:
            return
        node.state = WAITING
        if self.status == STOPPED:
            self.start_rendezvous(t, GLOBAL_TIMEOUT)
        elif self.status == RENDEZVOUS:
            self.rendezvous.append(name)
        else:
            self.waiting += 1

    def on_timeout(self, t: int, kind: int) -> None:
        if any(n not in self.nodes for n in self.rendezvous):
            self.rendezvous = self.up()
            self.generation += 1
            self.push(t + self.timeout(kind), kind, self.generation)
            return
        self.assign()
        self.version += 1
        self.rendezvous = []
        if self.pipelines:
            self.status = RUNNING
            self.configure(len(self.up()))
            self.push(t + self.step_ms, STEP, self.version)
            if self.start_ms is None:
                self.start_ms = self.prev_end = t
        else:
            self.status = STOPPED

    def assign(self) -> None:
        """Pipelines of 12 stages over the rendezvous' nodes in order; the rest wait."""
        self.pipelines = len(self.rendezvous) // STAGES if len(self.rendezvous) >= STAGES else 0
        slots = [(p, s) for p in range(self.pipelines) for s in range(STAGES)]
        self.waiting = 0
        for name in self.rendezvous:
            node = self.nodes[name]
            if slots:
                node.coords, node.state = [slots.pop(0)], RUNNING
            else:
                node.coords, node.state = [], WAITING
                self.waiting += 1

    def configure(self, n: int) -> None:
        tput = self.throughput(n)
        self.step_ms = int(self.batch / tput * 1000) if tput > 0 else self.zero_step_ms

    def record_step(self, t: int) -> None:
        self.steps += 1
        self.log.add(self.prev_end, t, self.batch)

    def on_step(self, t: int) -> None:
        self.record_step(t)
        self.prev_end = t
        self.push(t + self.step_ms, STEP, self.version)

    def on_remove(self, t: int, name: str, node: Node) -> None:
        self.start_rendezvous(t, GLOBAL_TIMEOUT)


@dataclass
class ArtifactOobleck(ArtifactSystem):
    """Any removal: a reconfiguration of `timeout_ms` (the rendezvous engine as is)."""

    def on_remove(self, t: int, name: str, node: Node) -> None:
        heapq.heapify(self.events)  # the artifact re-heapifies here (it can reorder equal keys)
        super().on_remove(t, name, node)


@dataclass
class ArtifactVaruna(ArtifactSystem):
    """Any removal: rollback to the last checkpoint and a restart; checkpoints every 10 steps."""

    checkpoint_ms: int = 0
    """Stall of one checkpoint."""
    checkpoint_every: int = 10
    """Steps between checkpoints (counted over the run)."""
    rollback: bool = True
    """Roll back on a removal (the artifact's script: off on the spot traces for the small models)."""
    restart_by_nodes: Optional[Callable[[int], int]] = None
    """Restart time (ms) by the node count of the configuration (None: `timeout_ms` always)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.restart_ms = self.timeout_ms
        self.forced = False
        self.last_checkpoint: Optional[float] = None  # hours, as the log's segment starts
        self.previous_checkpoint: Optional[float] = None
        self.checkpoint_at = -1  # checkpoint-failure correction: when the pending checkpoint ends

    def timeout(self, kind: int) -> int:
        return self.restart_ms if self.corrections.restart_time else self.restart_ms - self.checkpoint_ms

    def configure(self, n: int) -> None:
        super().configure(n)
        if self.restart_by_nodes is not None:
            self.restart_ms = self.restart_by_nodes(n)

    def on_remove(self, t: int, name: str, node: Node) -> None:
        self.forced = not self.corrections.no_forced_checkpoint
        if self.checkpoint_at > t:  # a removal during the checkpoint's stall: it is lost
            self.checkpoint_at, self.last_checkpoint = -1, self.previous_checkpoint
        if self.rollback:
            if self.last_checkpoint is None:
                self.log.zero_all()
            else:
                self.log.zero_from(self.last_checkpoint)
        self.start_rendezvous(t, GLOBAL_TIMEOUT)

    def on_step(self, t: int) -> None:
        self.record_step(t)
        if self.steps % self.checkpoint_every == 0 or self.forced:
            self.forced = False
            t += self.checkpoint_ms
            if self.corrections.checkpoint_failure:
                self.previous_checkpoint, self.last_checkpoint = self.last_checkpoint, t / 3.6e6
                self.checkpoint_at = t
            else:
                self.push(t + self.checkpoint_ms, CHECKPOINT)
                heapq.heapify(self.events)
                if self.rollback and self.heap_says_checkpoint_fails():
                    self.steps = max(0, self.steps - self.checkpoint_every)
                    self.log.zero_last(self.checkpoint_every)
                else:
                    self.last_checkpoint = t / 3.6e6
        self.prev_end = t
        self.push(t + self.step_ms, STEP, self.version)

    def heap_says_checkpoint_fails(self) -> bool:
        """The artifact's test: a pending removal before the checkpoint's completion in the
        heap's storage order (not time order)."""
        for ev in self.events:
            if ev.kind == REMOVE:
                return True
            if ev.kind == CHECKPOINT:
                return False
        return False
