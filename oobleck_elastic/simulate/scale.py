"""Beyond the paper: this project's planner at 1,000-10,000 nodes under scaled failure rates.

The story: docs/simulate.md.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .paper import shadow_fields, shadow_name
from .shadows import SHADOW_STEP_OVERHEAD
from .systems import CheckpointRestart, OobleckElastic, machine_loss_detection_s, replay
from .timeline import Timeline
from .trace import synthetic_trace

ROOT = Path(__file__).resolve().parents[2]
GPUS_PER_NODE = 8


def node_mtbf_h(cluster_mttf_h: float, gpus: int) -> float:
    """Per-node MTBF from a cluster's MTTF at `gpus` devices (failures independent per device)."""
    return cluster_mttf_h * gpus / GPUS_PER_NODE


@dataclass
class ScaleSettings:
    nodes: int = 1024
    """Nodes at the start."""
    hours: float = 24.0
    """Length of the run."""
    node_mtbf_h: float = node_mtbf_h(1.8, 16384)
    """Mean time between failures of one node: 1.8 h MTTF at 16,384 GPUs -> 3,686 h per 8-GPU node."""
    join_delay_s: float = 600.0
    """A failed node's replacement joins this long after the failure."""
    restart_s: float = 300.0
    """A whole-job restart at this scale (processes, NCCL init, loading the checkpoint): an assumption."""
    checkpoint_fixed_s: float = 10.0
    """Fixed part of a checkpoint stall."""
    checkpoint_gb_s_per_node: float = 2.0
    """Each node writes its shard of the checkpoint at this many GB/s."""
    node_bandwidth_gb_s: float = 100.0
    """Bytes/s one node receives layers at (8 x 12.5 GB/s)."""
    seed: int = 0
    """Seed of the synthetic failures."""
    tensor_parallel: int = 8
    """Devices per stage."""
    global_batch: int = 1536
    """Sequences per step (GPT-3's 1,536 of 2,048 tokens). At 10,000 nodes use 8,192 (16M
    tokens): 1,536 microbatches cannot keep the ~1,600 pipelines that many nodes hold busy."""
    failure: str = "node"
    """What a failure is, for its detection time: `node` (the machine is gone: its lease decides)
    or `process` (its agent process died: the liveness sockets see it at once)."""
    schedule: str = "1f1b"
    """`planning.schedule` of the planner: `1f1b` (`planning.templates`' closed form) or `auto` (every
    pipeline's schedule chosen by simulation, among all the planner knows, as `oobleck plan`
    shows them; `planning.schedules.choice`), or one schedule's name."""
    shadow_copies: list[int] = field(default_factory=list)
    """Also run `oobleck_elastic` with each of these counts of host-memory shadow copies
    (`oobleck_elastic:s=N`, `simulate.shadows`). The engine keeps shadows only at tensor
    parallel 1; at the study's tp 8 these rows say what they would buy if it kept them there."""
    shadow_overhead: float = SHADOW_STEP_OVERHEAD
    """Failure-free step-time overhead of one shadow copy of every layer."""
    measured_costs: bool = True
    """Charge the measured detection, re-planning and transfer (docs/simulate.md); False charges
    the assumptions the study made before (0.6 s, 0.05 s, the lost nodes' share of a replica)."""


LIVENESS_KILL_TO_PLAN_S = 0.11
"""Kill -> plan published through the liveness sockets: the upper end of what `bench/recovery.py`
measured (bench/RESULTS.md, "Figures moved from code comments")."""


@dataclass(frozen=True)
class Cost:
    """One cost of a failure: what the study assumed, what it charges now and where that comes from."""

    name: str
    """detection, replan or transfer."""
    assumed_s: float
    """What the study charged before it measured (for transfer: one node lost at the start)."""
    measured_s: float
    """What it measures (charged unless `ScaleSettings.measured_costs` is off)."""
    how: str
    """How it was measured."""

    def line(self) -> str:
        return f"{self.name}: assumed {self.assumed_s:.3g} s, measured {self.measured_s:.3g} s ({self.how})"

    def to_json(self) -> dict[str, Any]:
        return {"assumed_s": self.assumed_s, "measured_s": round(self.measured_s, 4), "how": self.how}


@dataclass
class ScaleResult:
    settings: ScaleSettings
    failures: int
    timelines: dict[str, Timeline] = field(default_factory=dict)
    checkpoint_every: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    costs: dict[str, Cost] = field(default_factory=dict)
    """oobleck_elastic's costs of a failure, assumed beside measured."""
    chosen: dict[str, int] = field(default_factory=dict)
    """The plan at the start: its pipelines per schedule ("zero-bubble/3": 46)."""
    start_samples_per_s: float = 0.0
    """That plan's estimated samples/s, before any failure."""

    def cost_lines(self) -> list[str]:
        charged = "measured" if self.settings.measured_costs else "assumed"
        return [f"oobleck_elastic charges the {charged} costs:"] + [f"  {c.line()}" for c in self.costs.values()]

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for name, tl in self.timelines.items():
            total = sum(tl.breakdown.values())
            out.append(
                {
                    "study": "scale",
                    "nodes": self.settings.nodes,
                    "hours": self.settings.hours,
                    "node_mtbf_h": round(self.settings.node_mtbf_h, 1),
                    "failures": self.failures,
                    "schedule": self.settings.schedule,
                    "schedules_at_start": self.chosen,
                    "plan_samples_per_s_at_start": self.start_samples_per_s,
                    "system": name,
                    "samples_per_s": tl.average_samples_per_s(),
                    "useful_fraction": tl.breakdown["useful"] / total if total else 0.0,
                    "checkpoint_every_steps": self.checkpoint_every.get(name),
                    "idle_gpu_fraction": round(tl.idle_fraction, 4),
                    "breakdown_s": {k: round(v, 1) for k, v in tl.breakdown.items()},
                }
                | ({"costs": {k: c.to_json() for k, c in self.costs.items()}} if name == "oobleck_elastic" else {})
                | (shadow_fields(tl) if name.startswith("oobleck_elastic") else {})
            )
        return out


class Planner:
    """Plans of the GPT-3-175B-like model per node count, cached; with a simulated schedule, one
    `PipelineSchedules` serves every node count (its simulations cached: the same plans as a
    fresh one per call, in a fraction of the time)."""

    def __init__(self, tensor_parallel: int = 8, global_batch: int = 1536, schedule: str = "1f1b") -> None:
        from ..config import load_config
        from ..planning import templates_for
        from ..planning.job import pipeline_schedules
        from ..planning.plan.placement import shard_bytes_of
        from ..planning.profile.analytic import gpt3_175b_profile

        self.cfg = load_config(
            ROOT / "configs" / "gpt3-175b.yaml",
            [
                f"planning.tensor_parallel={tensor_parallel}",
                f"training.global_batch_size={global_batch}",
                f"planning.schedule={schedule}",
            ],
        )
        profile = gpt3_175b_profile(tensor_parallel=tensor_parallel)
        self.templates = templates_for(self.cfg, profile)
        self.schedules = pipeline_schedules(self.cfg, self.templates)
        self.shard_bytes = shard_bytes_of(profile.layers)
        """Bytes a transfer moves per layer shard (one lane's parameters and optimizer state)."""
        self.replica_bytes = float(sum(layer.static_bytes for layer in gpt3_175b_profile().layers))
        self.batch = float(self.cfg.training.global_batch_size)
        self._plans: dict[int, Any] = {}

    def plan(self, n: int) -> Optional[Any]:
        from ..planning import PlanningError, plan_job

        if n not in self._plans:
            try:
                self._plans[n] = plan_job(self.cfg, nodes=n, templates=self.templates, schedules=self.schedules).plan
            except PlanningError:
                self._plans[n] = None
        return self._plans[n]

    def throughput(self, n: int) -> float:
        p = self.plan(n)
        return p.samples_per_s if p is not None else 0.0

    def pipelines(self, n: int) -> list[int]:
        p = self.plan(n)
        return [q.template_nodes for q in p.pipelines] if p is not None else []

    @property
    def n0(self) -> int:
        return self.templates.n0

    def replans(self, n: int) -> list[tuple[str, float, int]]:
        """Re-plans at `n` nodes as the leader makes them (plan_job with the previous plan and the
        cached templates): (what happened, seconds, bytes the busiest node receives), for a node
        lost a third of the way in, the last node lost, and a node joining n - 1. The timed call
        plans as the leader does, from scratch (its schedules simulated anew)."""
        from ..planning import plan_job
        from ..planning.plan.placement import bytes_received

        nodes = [f"node{i}" for i in range(n)]
        cases = [
            ("node lost", nodes, nodes[: n // 3] + nodes[n // 3 + 1 :]),
            ("last node lost", nodes, nodes[:-1]),
            ("node joined", nodes[:-1], nodes),
        ]
        out = []
        for what, before, after in cases:
            previous = plan_job(
                self.cfg, nodes=before, templates=self.templates, generation=1, schedules=self.schedules
            ).plan
            t0 = time.perf_counter()
            plan = plan_job(self.cfg, nodes=after, templates=self.templates, generation=2, previous=previous).plan
            took = time.perf_counter() - t0
            out.append((what, took, max(bytes_received(previous, plan, self.shard_bytes).values(), default=0)))
        return out


def measure_costs(settings: ScaleSettings, planner: Planner) -> dict[str, Cost]:
    """Detection, re-planning and transfer of one failure at `settings.nodes` (docs/simulate.md)."""
    ft = planner.cfg.fault_tolerance
    if settings.failure == "node":
        detection = Cost(
            "detection",
            0.6,
            machine_loss_detection_s(ft),
            f"a failed machine's lease expires: lease_ttl_s {ft.lease_ttl_s:g} s + settle_s {ft.settle_s:g} s of "
            "the config; bench/control_plane.py measured 4.7-5.9 s kill -> next plan at 64-1,000 nodes with TTL 5 s",
        )
    elif settings.failure == "process":
        detection = Cost(
            "detection",
            0.6,
            LIVENESS_KILL_TO_PLAN_S,
            "a killed agent's liveness socket closes: kill -> plan 0.10-0.11 s, bench/recovery.py on 4 nodes",
        )
    else:
        raise ValueError(f"failure must be 'node' or 'process' (got {settings.failure!r})")
    cases = planner.replans(settings.nodes)
    slowest = max(cases, key=lambda c: c[1])
    what = ", ".join(f"{w} {t:.3f} s" for w, t, _ in cases)
    replan = Cost(
        "replan",
        0.05,
        slowest[1],
        f"plan_job with the previous plan at {settings.nodes:,} nodes, tp={settings.tensor_parallel}, in this run: "
        f"{what}; the slowest charged",
    )
    bandwidth = settings.node_bandwidth_gb_s * 1e9
    busiest = max(cases, key=lambda c: c[2])
    sizes = planner.pipelines(settings.nodes) or [1]
    transfer = Cost(
        "transfer",
        planner.replica_bytes / min(sizes) / bandwidth,
        busiest[2] / bandwidth,
        f"the busiest receiver of those re-plans: {busiest[2] / 1e9:.1f} GB ({busiest[0]}) at "
        f"{settings.node_bandwidth_gb_s:g} GB/s per node; assumed: one node's share of a replica",
    )
    return {c.name: c for c in (detection, replan, transfer)}


@dataclass
class MeasuredOobleckElastic(OobleckElastic):
    """`OobleckElastic` charging a measured transfer per re-plan instead of a share of a replica."""

    measured_transfer_s: float = 0.0
    """The busiest node's receive time of a measured re-plan (`measure_costs`)."""

    def transfer_s(self, pipeline_nodes: int, nodes_lost: int = 1) -> float:
        return self.measured_transfer_s


def run_scale(settings: ScaleSettings, planner: Optional[Planner] = None) -> ScaleResult:
    t0 = time.perf_counter()
    planner = planner or Planner(settings.tensor_parallel, settings.global_batch, settings.schedule)
    if planner.cfg.planning.schedule != settings.schedule:
        raise ValueError(
            f"the planner plans with schedule {planner.cfg.planning.schedule}, the settings say {settings.schedule}"
        )
    events = synthetic_trace(
        settings.nodes,
        mtbf_h=settings.node_mtbf_h,
        duration_h=settings.hours,
        join_delay_s=settings.join_delay_s,
        seed=settings.seed,
    )
    failures = sum(e.kind == "remove" for e in events)
    end = settings.hours * 3600.0
    ckpt_s = settings.checkpoint_fixed_s + planner.replica_bytes / (
        settings.nodes * settings.checkpoint_gb_s_per_node * 1e9
    )
    step_s = planner.batch / max(planner.throughput(settings.nodes), 1e-9)
    cluster_mtbf_s = settings.node_mtbf_h * 3600.0 / settings.nodes
    young = math.sqrt(2 * ckpt_s * cluster_mtbf_s)
    result = ScaleResult(settings=settings, failures=failures, costs=measure_costs(settings, planner))
    start = planner.plan(settings.nodes)
    if start is not None:
        for p in start.pipelines:
            key = f"{p.schedule}/{p.num_chunks}"
            result.chosen[key] = result.chosen.get(key, 0) + 1
        result.start_samples_per_s = start.samples_per_s
    charged = {k: (c.measured_s if settings.measured_costs else c.assumed_s) for k, c in result.costs.items()}

    def ours(every: int, copies: int = 0) -> OobleckElastic:
        common: dict[str, Any] = dict(
            shadow_copies=copies,
            shadow_overhead=settings.shadow_overhead,
            num_layers=len(planner.shard_bytes),
            min_nodes=planner.n0,
            replica_bytes=planner.replica_bytes,
            node_bandwidth_b_s=settings.node_bandwidth_gb_s * 1e9,
            restart_s=settings.restart_s,
            checkpoint_every=every,
            checkpoint_s=ckpt_s,
            pipelines=planner.pipelines,
            detection_s=charged["detection"],
            replan_s=charged["replan"],
        )
        if not settings.measured_costs:
            return OobleckElastic(shadow_name(copies), planner.throughput, planner.batch, **common)
        return MeasuredOobleckElastic(
            shadow_name(copies),
            planner.throughput,
            planner.batch,
            measured_transfer_s=charged["transfer"],
            **common,
        )

    def restart(every: int) -> CheckpointRestart:
        return CheckpointRestart(
            "checkpoint_restart",
            planner.throughput,
            planner.batch,
            min_nodes=planner.n0,
            restart_s=settings.restart_s,
            checkpoint_every=every,
            checkpoint_s=ckpt_s,
        )

    def with_copies(copies: int) -> Any:
        return lambda every: ours(every, copies)

    runs: list[tuple[str, Any]] = [("oobleck_elastic", ours)]
    runs += [(shadow_name(c), with_copies(c)) for c in dict.fromkeys(settings.shadow_copies) if c > 0]
    for name, make in runs + [("checkpoint_restart", restart)]:
        best: Optional[tuple[float, int, Timeline]] = None
        for factor in (0.25, 0.5, 1.0, 2.0, 4.0, 16.0):  # each system at its best checkpoint interval
            every = max(1, round(factor * young / step_s))
            tl = replay(make(every), events, end_s=end)
            if best is None or tl.average_samples_per_s() > best[0]:
                best = (tl.average_samples_per_s(), every, tl)
        assert best is not None
        result.timelines[name], result.checkpoint_every[name] = best[2], best[1]
    result.wall_s = time.perf_counter() - t0
    return result
