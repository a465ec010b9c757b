"""Bamboo as the Oobleck artifact's simulator models it (`simulate.artifact` is the engine).

The story: docs/simulate.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from .artifact import GLOBAL_TIMEOUT, LOCAL_TIMEOUT, RUNNING, STAGES, STEP, ArtifactSystem, Node


@dataclass
class ArtifactBamboo(ArtifactSystem):
    restart_ms: int = 30_000
    """Restart after a fatal removal (the artifact's global rendezvous timeout)."""
    slowdown: float = 1.5
    """Step length factor while a lost stage is covered by its neighbour."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.fallback: tuple[int, int] | None = None  # (steps completed, time) of the first removal
        self.fallback_handled = False

    def run(self, trace) -> float:
        if all(self.throughput(n) <= 0 for n in range(STAGES, 31)):
            return 0.0
        return super().run(trace)

    def timeout(self, kind: int) -> int:
        return self.restart_ms if kind == GLOBAL_TIMEOUT else self.timeout_ms

    def on_timeout(self, t: int, kind: int) -> None:
        before = self.version
        super().on_timeout(t, kind)
        if self.version != before:  # a new configuration: no lost stage is covered any more
            self.fallback, self.fallback_handled = None, False

    def on_remove(self, t: int, name: str, node: Node) -> None:
        if node.state == RUNNING:
            if len(node.coords) > 1:
                self.start_rendezvous(t, GLOBAL_TIMEOUT)
                return
            p, s = node.coords[0]
            predecessor = (p, s - 1 if s > 0 else STAGES - 1)
            for other in self.nodes.values():
                if predecessor in other.coords:
                    if len(other.coords) > 1:
                        self.start_rendezvous(t, GLOBAL_TIMEOUT)
                        return
                    other.coords.append(node.coords[0])
                    break
        if self.status == RUNNING and self.fallback is None:
            self.fallback, self.fallback_handled = (self.steps, t), False
            self.step_ms = int(self.step_ms * self.slowdown)

    def on_step(self, t: int) -> None:
        if self.fallback is not None and not self.fallback_handled and self.fallback[0] == self.steps:
            self.push(t + int((t - self.fallback[1]) * (self.slowdown - 1.0)), STEP, self.version)
            self.fallback_handled = True
            return
        self.record_step(t)
        self.prev_end = t
        if self.should_reconfigure():
            self.start_rendezvous(t, LOCAL_TIMEOUT)
        else:
            self.push(t + self.step_ms, STEP, self.version)

    def should_reconfigure(self) -> bool:
        overloaded = sum(1 for x in self.nodes.values() if x.state == RUNNING and len(x.coords) > 1)
        if overloaded and self.waiting >= overloaded:
            return True
        active = self.pipelines * STAGES - overloaded
        if overloaded and 2 * overloaded / active > 0.05:
            return True
        return (active + self.waiting) // STAGES > self.pipelines
