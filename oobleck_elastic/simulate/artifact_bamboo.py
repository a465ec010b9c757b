"""Bamboo as the Oobleck artifact's simulator models it (see `artifact.py` for the engine).

Every running node holds its pipeline stage and, redundantly, its predecessor's (stage s - 1 of
the same pipeline, stage 0's predecessor being the last stage). On a removal:

- a running node that already covers a lost neighbour (two stages), or whose predecessor's
  holder already covers one, is fatal: a restart (a rendezvous of `restart_ms`, 30 s);
- otherwise the predecessor's holder takes the lost stage over (it now holds two);
- while the job runs, the first removal since the last configuration makes every later step
  1.5x longer (integer ms), and the step in flight finishes late by half the time it still had
  to run (that late completion is the one that counts).

After each completed step the job reconfigures (a rendezvous of the per-model reconfiguration
time, no step in flight meanwhile) when a node holds two stages and either enough nodes wait to
take them over or the overloaded nodes are more than 2.5 % of the active ones (always, with 12
stages), or when the waiting nodes would make one more pipeline. A node removed while waiting
is still counted as waiting (the artifact never decrements the count).

Models whose table is 0 (the GPT-3 models: out of memory with the redundant layers) train
nothing; the artifact's zero-length steps repeat until its step limit and commit nothing.
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
