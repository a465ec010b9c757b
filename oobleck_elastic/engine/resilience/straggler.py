"""Stragglers: a node persistently slower than the others is named, and the batch re-split around it.

Each worker times its own compute in a step (`ComputeClock`: its stage's chunks, not the waits
for its neighbours), and the seconds ride on the commit (engine/step/commit.py), so every worker
learns every worker's time with no new collective. `slowdowns` and `StragglerWatch` compare each
with its stage's typical time (its peers', or the plan's at the generation's ratio), pure and the
same on every worker; rank 0 reports the named nodes, and the leader re-splits the microbatches
at the measured speeds (planning/plan/rebalance.py). Invariant: a re-split keeps the global batch and
its sample order, so the weights still equal one process's. docs/training.md.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch

from ...planning import Plan

__all__ = ["ComputeClock", "StragglerWatch", "Verdict", "slowdowns"]

T = TypeVar("T")

_SIGNIFICANT = 0.5  # a straggler's time per microbatch is at least this share of the largest expected stage's


class ComputeClock:
    """Sums the time of the compute calls it wraps (`timed`) until `take()`. On CUDA it records
    events around each call and reads them at `take()`, after the step's one host read. On the CPU
    with one intra-op thread (torch.get_num_threads(); torchrun sets OMP_NUM_THREADS=1 for several
    workers per node) it counts the calling thread's CPU time, not the wall time: a worker that
    waits for a core has done no less work, while a slower core shows. With more threads it
    reports nothing (`measures`), and no straggler is named. With a
    `slowdown` factor > 1 (fault injection, engine/resilience/faults.py) every call is stretched to that
    many times its duration, as on a slower device."""

    def __init__(self, device: torch.device, slowdown: Callable[[], float] = lambda: 1.0) -> None:
        self.device, self.slowdown = device, slowdown
        self.measures = device.type == "cuda" or torch.get_num_threads() == 1
        """Whether its times can be compared between workers: on the CPU only with one intra-op
        thread (with more, the pool's threads spin and share the cores unevenly: a worker's time
        then says more about its neighbours than about its device)."""
        self._seconds = 0.0
        self._events: list[tuple[Any, Any]] = []

    def timed(self, fn: Callable[..., T]) -> Callable[..., T]:
        """`fn`, timed into this clock."""

        def run(*args: Any, **kwargs: Any) -> T:
            cuda = self.device.type == "cuda"
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            now = time.thread_time if self.measures else time.perf_counter  # (CPU: the CUDA path reads events)
            t0 = now()
            out = fn(*args, **kwargs)
            factor = self.slowdown()
            if cuda:
                end.record()
                self._events.append((start, end))
                if factor > 1:
                    end.synchronize()
                    time.sleep(start.elapsed_time(end) / 1000 * (factor - 1))
            else:
                elapsed = now() - t0
                if factor > 1:
                    time.sleep(elapsed * (factor - 1))
                self._seconds += elapsed * max(factor, 1.0)
            return out

        return run

    def take(self) -> float:
        """Seconds of compute since the last `take()` (0 when it does not `measure`)."""
        seconds, self._seconds = (self._seconds if self.measures else 0.0), 0.0
        for start, end in self._events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1000
        self._events.clear()
        return seconds


def _workers(plan: Plan) -> list[tuple[int, str, int, float, tuple[tuple[int, int], ...]]]:
    """(rank, node, microbatches of its pipeline, expected seconds per microbatch, its stage's
    layer ranges: one, or its chunks') of every worker."""
    out = []
    for p in plan.pipelines:
        for s in p.stages:
            expected = s.compute_s if s.compute_s > 0 else float(len(s.layers()))  # unknown: layers as the unit
            out += [
                (s.rank + j, s.node, p.microbatches, expected, s.layer_ranges()) for j in range(plan.tensor_parallel)
            ]
    return out


def _lower_median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def slowdowns(plan: Plan, busy: Sequence[float]) -> dict[int, tuple[float, float, float]]:
    """rank -> (slowdown, its seconds per microbatch, the typical seconds per microbatch of its
    stage) for compute times `busy` (seconds in one step, by rank). The typical time of a stage is
    its peers' (the workers of other pipelines running the same layers: the lower median of
    theirs), or, for a stage no other pipeline cuts the same way, its expected time at the
    generation's typical ratio of measured to expected time."""
    workers = [w for w in _workers(plan) if w[0] < len(busy)]
    per_mb = {r: busy[r] / mb for r, _, mb, _, _ in workers}
    ratios = [per_mb[r] / expected for r, _, _, expected, _ in workers]
    if not ratios or _lower_median(ratios) <= 0:
        return {}
    peers: dict[tuple[tuple[int, int], ...], list[float]] = {}
    for r, _, _, _, layers in workers:
        peers.setdefault(layers, []).append(per_mb[r])
    out = {}
    for r, _, _, expected, layers in workers:
        typical = _lower_median(peers[layers]) if len(peers[layers]) > 1 else expected * _lower_median(ratios)
        out[r] = (per_mb[r] / typical if typical > 0 else 1.0, per_mb[r], typical)
    return out


def _lower_quartile(values: Sequence[float]) -> float:
    """The value that at least three quarters of `values` reach."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def _step_slowdowns(plan: Plan, window: Sequence[Sequence[float]]) -> dict[int, float]:
    """rank -> the lower quartile, over the steps of `window` (by rank, then step), of its slowdown
    in each step (`slowdowns` of that step's times): how slow it was in three steps of four."""
    steps = min((len(w) for w in window), default=0)
    per_step = [slowdowns(plan, [w[k] for w in window]) for k in range(steps)]
    ranks = {r for found in per_step for r in found}
    return {r: _lower_quartile([found[r][0] for found in per_step if r in found]) for r in ranks}


@dataclass(frozen=True)
class Verdict:
    """What `StragglerWatch.observe` found after a step."""

    named: dict[str, float] = field(default_factory=dict)
    """Nodes persistently slow now -> their slowdown (over the window)."""
    changed: bool = False
    """The named nodes differ from those after the previous step."""
    report: bool = False
    """Tell the leader (a change, or the first full window of a generation while nodes are named)."""
    pipeline_s: tuple[float, ...] = ()
    """Each pipeline's measured bottleneck, seconds per microbatch (the window's fastest)."""


class StragglerWatch:
    """Names nodes persistently slower than the rest of their generation. Over the last `steps`
    steps of a generation (its first left out), a worker's slowdown is the smaller of two measures,
    each robust to one kind of a shared machine's noise: its fastest time against its stage's
    fastest (contention only adds time, so a healthy worker shows its speed in some step), and the
    slowdown it reaches step by step in three steps of four (a stretch in which the whole machine
    is loaded slows every worker alike). A node is named when one of its workers is at least
    `factor` times its stage's typical time and takes at least half the largest stage's typical
    time (a tiny stage a few milliseconds off is no straggler); one step at full speed clears it.
    Why these windows: bench/RESULTS.md."""

    def __init__(self, factor: float, steps: int) -> None:
        self.factor, self.steps = factor, steps
        self._generation: Optional[int] = None
        self._window: dict[int, deque[float]] = {}  # rank -> its compute seconds of the last steps
        self._reported: Optional[int] = None  # the generation last reported to the leader
        self.named: dict[str, float] = {}

    def observe(self, plan: Plan, busy: Sequence[float]) -> Verdict:
        """One applied step's compute times (seconds, by rank) in generation `plan.generation`. The
        first step of a generation is left out (allocator warm-up, first use of the new split)."""
        if self.factor <= 0:
            return Verdict()
        if plan.generation != self._generation:  # another split: start over
            self._generation, self._window = plan.generation, {}
            return Verdict(named=dict(self.named))
        if min(busy[: plan.world_size], default=0.0) <= 0:  # some worker cannot measure (ComputeClock)
            return Verdict(named=dict(self.named))
        for rank in range(min(len(busy), plan.world_size)):
            self._window.setdefault(rank, deque(maxlen=self.steps)).append(busy[rank])
        if not self._window or any(len(w) < self.steps for w in self._window.values()):
            return Verdict(named=dict(self.named))
        # the fastest of the window: contention (a busy host, a shared core) only ever adds time, so
        # a healthy worker shows its speed in some step of the window, and a slow one in none
        fastest = [min(self._window[r]) if r in self._window else 0.0 for r in range(plan.world_size)]
        found = slowdowns(plan, fastest)
        # and how slow it was step by step in three steps of four: a loaded machine slows all alike
        stepwise = _step_slowdowns(plan, [list(self._window.get(r, ())) for r in range(plan.world_size)])
        found = {r: (min(slow, stepwise.get(r, slow)), per_mb, typical) for r, (slow, per_mb, typical) in found.items()}
        # a worker matters only if it takes a fair share of the largest stage's typical time
        largest = max((typical for _, _, typical in found.values()), default=0.0)
        named: dict[str, float] = {}
        for rank, node, *_ in _workers(plan):
            slow, per_mb, _ = found.get(rank, (1.0, 0.0, 0.0))
            if slow >= self.factor and per_mb >= _SIGNIFICANT * largest:
                named[node] = max(named.get(node, 0.0), round(slow, 2))
        changed = set(named) != set(self.named)
        report = changed or (bool(named) and self._reported != plan.generation)
        if report:
            self._reported = plan.generation
        self.named = named
        pipes = tuple(
            max(found.get(s.rank + j, (0.0, 0.0, 0.0))[1] for s in p.stages for j in range(plan.tensor_parallel))
            for p in plan.pipelines
        )
        return Verdict(named=dict(named), changed=changed, report=report, pipeline_s=pipes)
