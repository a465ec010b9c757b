"""Which schedule each pipeline of a plan runs, and the line the instantiation plans it with.

`candidates` reads `planning.schedule` and `planning.chunks_per_device` (with `engine_only`,
only what the engine runs: `ENGINE_RUNS`). `PipelineSchedules.lines` gives each template a line
T(b) = total + (b - 1) x slope from one simulation near its share of the batch (only the sizes
n0 .. max(2 n0 - 1, n0 + 7) are simulated); once each pipeline has its b microbatches,
`PipelineSchedules.cost` picks, exactly, the fastest candidate whose every device fits in memory.
Pipelines of one plan may so run different schedules. Under `training.activation_checkpoint:
auto` each candidate recomputes on the devices that do not fit without. docs/schedules.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Union

from ...config.planning import MAX_CHUNKS, schedule_chunks_problem
from ..errors import PlanningError
from ..profile.profile import ModelProfile
from ..templates.templates import Template, TemplateSet
from .cost import ScheduleCost, chunk_ranges, template_cost
from .schedules import SCHEDULES, ScheduleError

__all__ = [
    "ENGINE_RUNS",
    "engine_runs_text",
    "MAX_CHUNKS",
    "PipelineSchedules",
    "candidates",
    "closed_form",
]

ENGINE_RUNS: frozenset[tuple[str, int]] = frozenset(
    {("1f1b", 1), ("gpipe", 1), ("zbv", 2)}
    | {("interleaved-1f1b", v) for v in range(2, MAX_CHUNKS + 1)}
    | {("zero-bubble", v) for v in range(1, MAX_CHUNKS + 1)}
)
"""(schedule, chunks per device) the engine runs (engine/stage/build.py)."""

SIMULATED_SIZES = 8
"""At least this many template sizes (from n0 up) are planned with simulated lines."""

WEIGHT_SHARE = 0.5
"""The weight gradient's share of a layer's backward time (Qi et al.'s transformer: I = W); the
profile measures the backward whole."""


def _chunk_counts(counts: Sequence[int]) -> str:
    """`1`, or `2..8` for a run of chunk counts."""
    low, high = min(counts), max(counts)
    return str(low) if low == high else f"{low}..{high}"


def engine_runs_text() -> str:
    """What the engine runs, in words: "1f1b, gpipe, interleaved-1f1b with 2..8 chunks, zero-bubble"."""
    out = []
    for name in sorted({s for s, _ in ENGINE_RUNS}):
        counts = [c for s, c in ENGINE_RUNS if s == name]
        out.append(name if counts == [1] else f"{name} with {_chunk_counts(counts)} chunks")
    return ", ".join(out)


def closed_form(schedule: str) -> bool:
    """Whether `schedule` is planned with templates.py's closed form (no simulation)."""
    return schedule in ("1f1b", "gpipe")


def candidates(schedule: str, chunks: Union[int, str], *, engine_only: bool = False) -> list[tuple[str, int]]:
    """(schedule, chunks per device) pairs `planning.schedule` / `planning.chunks_per_device`
    allow, in order of preference (ties go to the first); with `engine_only`, those the engine
    runs. Raises PlanningError for a name or a chunk count that cannot be, or (`engine_only`)
    a setting the engine cannot run, saying what to change."""
    if schedule != "auto" and schedule not in SCHEDULES:
        raise PlanningError(f"planning.schedule is '{schedule}': use one of {', '.join(SCHEDULES)} or auto")
    why = schedule_chunks_problem(schedule, chunks)
    if why:
        raise PlanningError(why)
    many = list(range(1, MAX_CHUNKS + 1)) if chunks == "auto" else [int(chunks)]
    if schedule == "auto":
        out = [("1f1b", 1)]
        out += [("interleaved-1f1b", v) for v in many if v > 1]
        out += [("zero-bubble", v) for v in many]
        out += [("zbv", 2)] if 2 in many else []
    elif schedule in ("1f1b", "gpipe"):
        out = [(schedule, 1)]
    elif schedule == "zbv":
        out = [("zbv", 2)]
    else:
        out = [(schedule, v) for v in many]
    if engine_only:
        runs = [c for c in out if c in ENGINE_RUNS]
        if not runs:  # a chunk count the engine does not run with this schedule
            counts = _chunk_counts([c for s, c in ENGINE_RUNS if s == schedule])
            raise PlanningError(
                f"planning.schedule={schedule} with planning.chunks_per_device={chunks} is planned (oobleck plan "
                f"shows it) but the engine runs {schedule} with {counts} chunk(s) per device only: set "
                f"planning.chunks_per_device to {counts} or auto"
            )
        out = runs
    return out


class PipelineSchedules:
    """The schedule of every pipeline of a template set: per (template nodes, microbatches,
    replicas), the fastest candidate that fits, cached (module docstring)."""

    def __init__(
        self,
        profile: ModelProfile,
        templates: TemplateSet,
        memory_limit_bytes: float,
        options: Sequence[tuple[str, int]],
        *,
        weight_share: float = WEIGHT_SHARE,
    ) -> None:
        self.profile = profile
        self.templates = templates
        self.memory_limit_bytes = memory_limit_bytes
        self.options = list(options)
        self.weight_share = weight_share
        self._ranges: dict[tuple[int, int], Optional[list[tuple[int, int]]]] = {}
        self._costs: dict[tuple[int, str, int, int, int], Union[ScheduleCost, str]] = {}
        self._simulated: dict[tuple[int, str, int, int], Union[ScheduleCost, str]] = {}  # any replicas

    def _stage_ranges(self, template: Template, chunks: int) -> Optional[list[tuple[int, int]]]:
        key = (template.num_nodes, chunks)
        if key not in self._ranges:
            if chunks == 1:
                self._ranges[key] = template.layer_ranges()
            elif chunks * template.num_stages > self.profile.num_layers:
                self._ranges[key] = None
            else:
                self._ranges[key] = chunk_ranges(self.profile, chunks * template.num_stages)
        return self._ranges[key]

    def simulate(
        self, nodes: int, name: str, chunks: int, microbatches: int, replicas: int
    ) -> Union[ScheduleCost, str]:
        """One candidate on the template of `nodes` nodes: its cost, or why it cannot run (cannot
        be built, or over the memory limit)."""
        key = (nodes, name, chunks, microbatches, replicas)
        done = self._simulated.get(key[:4])
        if key not in self._costs and done is not None:  # simulated for another replica count
            self._costs[key] = (
                done if isinstance(done, str) else done.for_replicas(replicas, self.templates[nodes].links)
            )
        if key not in self._costs:
            template = self.templates[nodes]
            ranges = self._stage_ranges(template, chunks)
            result: Union[ScheduleCost, str]
            if ranges is None:
                result = (
                    f"{self.profile.num_layers} layers cannot make {chunks} chunks on each of {template.num_stages} "
                    "devices"
                )
            else:
                result = self._fitting(template, name, chunks, microbatches, replicas, ranges)
            self._costs[key] = self._simulated[key[:4]] = result
        return self._costs[key]

    def _fitting(
        self,
        template: Template,
        name: str,
        chunks: int,
        microbatches: int,
        replicas: int,
        ranges: list[tuple[int, int]],
    ) -> Union[ScheduleCost, str]:
        """The candidate's cost, or why it cannot run. Under `auto` recomputation, the devices over
        the limit without it recompute every stage they run, and it is simulated again: the peak
        of a device's activations follows the schedule's order, not its timing, so the others
        stay within the limit."""
        auto = self.templates.activation_checkpoint == "auto"
        recompute: list[bool] = []
        while True:
            try:
                result = template_cost(
                    self.profile,
                    template,
                    name,
                    microbatches,
                    chunks=chunks,
                    replicas=replicas,
                    weight_share=self.weight_share,
                    ranges=ranges,
                    recompute=recompute,
                )
            except ScheduleError as err:
                return str(err)
            over = {d for d, m in enumerate(result.memory_bytes) if m > self.memory_limit_bytes}
            if not over:
                return result
            if not auto or recompute:
                how = " with its activations recomputed" if auto or self.profile.base_mode == "full" else ""
                return (
                    f"needs {result.peak_memory_bytes / 2**30:.2f} GiB on a device{how}, over the limit of "
                    f"{self.memory_limit_bytes / 2**30:.2f} GiB"
                )
            recompute = [d in over for d in result.placement]

    def table(self, nodes: int, microbatches: int, replicas: int) -> list[tuple[str, int, Union[ScheduleCost, str]]]:
        """Every candidate on one template: (schedule, chunks, cost or why not)."""
        return [(n, c, self.simulate(nodes, n, c, microbatches, replicas)) for n, c in self.options]

    def cost(self, nodes: int, microbatches: int, replicas: int) -> ScheduleCost:
        """The fastest candidate that fits (ties: the first); PlanningError saying why each failed."""
        best: Optional[ScheduleCost] = None
        for _, _, got in self.table(nodes, microbatches, replicas):
            if isinstance(got, ScheduleCost) and (best is None or got.step_s < best.step_s * (1 - 1e-9)):
                best = got
        if best is None:
            why = "; ".join(f"{n}/{c}: {got}" for n, c, got in self.table(nodes, microbatches, replicas))
            raise PlanningError(
                f"no schedule of planning.schedule can run {microbatches} microbatches on the {nodes}-node "
                f"template ({why}): change planning.schedule or planning.chunks_per_device"
            )
        return best

    def simulated_sizes(self) -> list[int]:
        """The template sizes planned with simulated lines: n0 .. max(2 n0 - 1, n0 + 7) (module
        docstring)."""
        n0 = self.templates.n0
        return [n for n in self.templates.sizes() if n <= max(2 * n0 - 1, n0 + SIMULATED_SIZES - 1)]

    def lines(self, num_nodes: int, num_microbatches: int, replicas: int) -> TemplateSet:
        """The template set the instantiation plans with: the simulated sizes (`simulated_sizes`),
        each template's (total_time_s, bottleneck_s) the line of its fastest candidate around its
        share of the batch (module docstring). A template no candidate can run there (at the share
        and at k D microbatches: over the memory limit, since the templates were built for 1F1B's
        activations, or microbatches that do not divide into rounds) is left out, as are templates
        larger than the job; PlanningError when none is left."""
        out = {}
        refused: dict[int, str] = {}
        for n in self.simulated_sizes():
            if n > num_nodes:
                break
            t = self.templates[n]
            share = max(1, math.ceil(num_microbatches * n / max(num_nodes, 1)))
            d = t.num_stages
            k = max(1, math.ceil(share / d))
            best: Optional[tuple[float, float, float]] = None  # (T at share, first, slope)
            for name, chunks in self.options:
                got = self.simulate(n, name, chunks, k * d, replicas)
                at_share = self.simulate(n, name, chunks, share, replicas) if share != k * d else got
                if not isinstance(at_share, ScheduleCost):  # memory and rounds depend on the microbatches
                    got = at_share
                if not isinstance(got, ScheduleCost):
                    refused.setdefault(n, f"{name}/{chunks}: {got}")
                    continue
                # every device runs each of its stages once per microbatch: its load per microbatch,
                # compute and receives, is the steady state's pace; the slowest device's sets it
                sim = got.simulation
                slope = max((b + c) / got.microbatches for b, c in zip(sim.busy_s, sim.comm_s))
                first = got.makespan_s - (k * d - 1) * slope  # the line's T(1), all-reduce excluded
                at = first + (share - 1) * slope
                if best is None or at < best[0] * (1 - 1e-9):
                    best = (at, first, slope)
            if best is not None:
                out[n] = dataclasses.replace(t, total_time_s=best[1], bottleneck_s=best[2])
        if not out:
            n0 = self.templates.n0
            raise PlanningError(
                f"no template of at most {num_nodes} node(s) runs a schedule of planning.schedule (the {n0}-node "
                f"one: {refused.get(n0, 'more nodes than the job has')}): change planning.schedule or "
                "planning.chunks_per_device, or give the devices more memory"
            )
        return dataclasses.replace(self.templates, templates=out)
