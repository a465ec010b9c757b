"""Beyond the paper: this project's planner at 1,000-10,000 nodes under scaled failure rates.

The GPT-3-175B-like analytic profile (`configs/gpt3-175b.yaml`, 8 devices per node, tensor
parallel 8) is planned for every node count the run passes through (templates once, a plan per
count, cached), giving `oobleck_elastic` its throughput, pipelines and layer-transfer sizes.
torchrun checkpoint-restart runs a static plan of the same planner for the node count and
restarts on every failure. Both checkpoint at their best interval: the best of 0.25x-16x
Young's sqrt(2 x checkpoint cost x cluster MTBF), by simulation. Failures: Poisson per node with a
per-node MTBF scaled from a published cluster MTTF (`node_mtbf_h`), failed nodes replaced after
`join_delay_s`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .systems import CheckpointRestart, OobleckElastic, replay
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


@dataclass
class ScaleResult:
    settings: ScaleSettings
    failures: int
    timelines: dict[str, Timeline] = field(default_factory=dict)
    checkpoint_every: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

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
                    "system": name,
                    "samples_per_s": tl.average_samples_per_s(),
                    "useful_fraction": tl.breakdown["useful"] / total if total else 0.0,
                    "checkpoint_every_steps": self.checkpoint_every.get(name),
                    "idle_gpu_fraction": round(tl.idle_fraction, 4),
                    "breakdown_s": {k: round(v, 1) for k, v in tl.breakdown.items()},
                }
            )
        return out


class Planner:
    """Plans of the GPT-3-175B-like model per node count, cached."""

    def __init__(self, tensor_parallel: int = 8, global_batch: int = 1536) -> None:
        from ..config import load_config
        from ..planning import templates_for
        from ..planning.analytic import gpt3_175b_profile

        self.cfg = load_config(
            ROOT / "configs" / "gpt3-175b.yaml",
            [f"planning.tensor_parallel={tensor_parallel}", f"training.global_batch_size={global_batch}"],
        )
        profile = gpt3_175b_profile(tensor_parallel=tensor_parallel)
        self.templates = templates_for(self.cfg, profile)
        self.replica_bytes = float(sum(layer.static_bytes for layer in gpt3_175b_profile().layers))
        self.batch = float(self.cfg.training.global_batch_size)
        self._plans: dict[int, Any] = {}

    def plan(self, n: int) -> Optional[Any]:
        from ..planning import PlanningError, plan_job

        if n not in self._plans:
            try:
                self._plans[n] = plan_job(self.cfg, nodes=n, templates=self.templates).plan
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


def run_scale(settings: ScaleSettings, planner: Optional[Planner] = None) -> ScaleResult:
    t0 = time.perf_counter()
    planner = planner or Planner(settings.tensor_parallel, settings.global_batch)
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
    result = ScaleResult(settings=settings, failures=failures)

    def ours(every: int) -> OobleckElastic:
        return OobleckElastic(
            "oobleck_elastic",
            planner.throughput,
            planner.batch,
            min_nodes=planner.n0,
            replica_bytes=planner.replica_bytes,
            node_bandwidth_b_s=settings.node_bandwidth_gb_s * 1e9,
            restart_s=settings.restart_s,
            checkpoint_every=every,
            checkpoint_s=ckpt_s,
            pipelines=planner.pipelines,
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

    for name, make in (("oobleck_elastic", ours), ("checkpoint_restart", restart)):
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
