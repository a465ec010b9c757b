"""Metrics: one TensorBoard writer per job (`Metrics`) and progress lines that say generation,
step and node.

Only the worker holding rank 0 of the current generation (or the single process) writes, so a
job has one event stream (board.py: directory, steps, tags, page). Per step: throughput, MFU,
loss, learning rate, gradient norm, cluster size, peak memory, the step guard's rejections and
the shadow figures; per generation the plan; per reconfiguration its figures; with every
progress report the goodput ledger. docs/training.md lists every tag.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Mapping, Optional

from ...logs import JobLog
from ...planning import Plan
from . import board
from .memory import GB
from .memory import describe as describe_memory
from .mfu import Throughput
from ..step.result import StepResult

log = JobLog(logging.getLogger("oobleck_elastic.train"))


def describe_plan(plan: Optional[Plan]) -> str:
    if plan is None:
        return "single process: every layer in one stage"
    lines = [
        f"generation {plan.generation}: {len(plan.nodes)} node(s), {len(plan.pipelines)} pipeline(s), "
        f"{plan.world_size} worker(s), tensor parallel {plan.tensor_parallel}, "
        f"est. step {plan.est_step_time_s:.4g} s"
    ]
    for p in plan.pipelines:
        stages = ", ".join(
            "+".join(f"[{u},{v})" for u, v in s.layer_ranges()) + f"@{s.node}:{s.local_rank}" for s in p.stages
        )
        runs = p.schedule if p.num_chunks == 1 else f"{p.schedule} with {p.num_chunks} chunks"
        lines.append(f"pipeline {p.index}: {p.microbatches} microbatches, {runs}; {stages}")
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


class Metrics:
    def __init__(
        self,
        log_dir: str | Path,
        *,
        enabled: bool,
        samples_per_step: int,
        tokens_per_step: int,
        total_steps: int,
        log_interval: int = 1,
        node: str = "local",
        flops_per_token: Optional[float] = 0.0,
        peak_tflops: Optional[float] = None,
        paced: float = 0.0,
    ) -> None:
        self.enabled, self.samples, self.tokens = enabled, samples_per_step, tokens_per_step
        self.flops_per_token, self.peak_tflops = flops_per_token, peak_tflops
        self.paced = paced
        """`training.paced_devices`: the plan's estimate is for devices `paced` times slower."""
        self._hinted = False  # an unknown MFU is said on the first progress line only
        self._generation: Optional[int] = None  # of the last progress line: a generation's first step has one
        self.total, self.interval, self.node = total_steps, max(1, log_interval), node
        self.writer = None
        self.log_dir = Path(log_dir)
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.log_dir))
            self.writer.add_custom_scalars(board.LAYOUT)  # once per writer: each event file has it
        self._t0 = time.monotonic()
        self.skipped = 0
        self.slow_nodes: set[str] = set()  # nodes ever named stragglers (engine/resilience/straggler.py)

    def plan(self, plan: Optional[Plan], step: int) -> None:
        """The plan of the generation entered after `step` steps (the `entered` line's step)."""
        if self.writer is not None:
            self.writer.add_text("plan", describe_plan(plan).replace("\n", "  \n"), step)

    def step(self, result: StepResult, *, lr: float, plan: Optional[Plan], wall_s: Optional[float] = None) -> None:
        """Scalars of one step, at `board.tb_step(result.step)`. `wall_s`: the wall time since the
        previous step completed (samples/s and tokens/s are over it, so a step that followed a
        reconfiguration counts what it cost); `Throughput/step_time_s` is the step's own time."""
        if not self.enabled:
            return
        s = board.tb_step(result.step)
        wall = wall_s if wall_s is not None and wall_s > 0 else result.seconds
        sps = self.samples / wall if wall > 0 else 0.0
        w = self.writer
        assert w is not None
        perf = Throughput.of(
            tokens=self.tokens,
            seconds=wall,
            flops_per_token=self.flops_per_token,
            devices=plan.world_size if plan else 1,
            peak_tflops=self.peak_tflops,
        )
        w.add_scalar("Throughput/tokens_per_s", perf.tokens_per_s, s)
        w.add_scalar("Throughput/samples_per_s", sps, s)
        if perf.tflops_per_device is not None:
            w.add_scalar("Throughput/tflops_per_device", perf.tflops_per_device, s)
        if perf.mfu is not None:
            w.add_scalar("Throughput/mfu", perf.mfu, s)
        w.add_scalar("Throughput/step_time_s", result.seconds, s)
        est_s = plan.est_step_time_s * (self.paced if self.paced > 0 else 1.0) if plan is not None else None
        if est_s is not None:
            w.add_scalar("Throughput/est_step_time_s", est_s, s)
        w.add_scalar("Throughput/wall_s", wall, s)
        w.add_scalar("train/loss", result.loss, s)
        w.add_scalar("train/lr", lr, s)
        w.add_scalar("train/grad_norm", result.grad_norm, s)
        w.add_scalar("cluster/nodes", len(plan.nodes) if plan else 1, s)
        w.add_scalar("cluster/pipelines", len(plan.pipelines) if plan else 1, s)
        w.add_scalar("cluster/generation", plan.generation if plan else 0, s)
        w.add_scalar("memory/peak_rss_gb", result.peak_rss_bytes / GB, s)
        if result.peak_device_bytes is not None:
            w.add_scalar("memory/peak_device_gb", result.peak_device_bytes / GB, s)
        gen = plan.generation if plan else 0
        if s % self.interval == 0 or s == self.total or gen != self._generation:
            self._generation = gen
            est = f", plan est. {est_s:.3f} s" if est_s is not None else ""
            log.at(gen=gen, step=s, total=self.total, node=self.node).info(
                "loss %.4f, %.3f s/step (%.3f s since the last%s), %.1f samples/s, %s; %s",
                result.loss,
                result.seconds,
                wall,
                est,
                sps,
                perf.describe(hint=not self._hinted),
                describe_memory(result.peak_rss_bytes, result.peak_device_bytes),
                event="step",
                fields={"loss": result.loss, "samples_s": sps, "seconds": result.seconds},
            )
            self._hinted = True

    def rejected(self, step: int, text: str, *, skipped: bool) -> None:
        """The step guard did not apply 0-based `step` (engine/resilience/guard.py): `guard/rejected` = 1
        at its number, `guard/skipped_steps` counts skipped batches, and the reason as text."""
        if self.writer is None:
            return
        self.skipped += int(skipped)
        at = board.tb_step(step)
        self.writer.add_scalar("guard/rejected", 1, at)
        self.writer.add_scalar("guard/skipped_steps", self.skipped, at)
        self.writer.add_text("guard", text, at)

    def stragglers(self, named: dict[str, float], step: int) -> None:
        """After 0-based `step`: `straggler/count` of nodes named stragglers, `straggler/slowdown/<node>`
        for each one, and 0 for a node no longer named (engine/resilience/straggler.py)."""
        if self.writer is None:
            return
        at = board.tb_step(step)
        self.writer.add_scalar("straggler/count", len(named), at)
        for node in sorted(set(named) | self.slow_nodes):
            self.writer.add_scalar(f"straggler/slowdown/{node}", named.get(node, 0.0), at)
        self.slow_nodes |= set(named)

    def repaired(self, text: str, step: int, *, total: int) -> None:
        """Corrupt layer copies replaced after 0-based `step` (engine/resilience/fingerprint.py):
        `integrity/repaired_copies` counts them."""
        if self.writer is None:
            return
        self.writer.add_scalar("integrity/repaired_copies", total, board.tb_step(step))
        self.writer.add_text("integrity", text, board.tb_step(step))

    def goodput(self, seconds: Mapping[str, float], fraction: float, *, step: int, final: bool = False) -> None:
        """The job's goodput ledger after `step` steps (engine/telemetry/goodput.py): `goodput/<category>`
        in seconds and `goodput/fraction`, the useful share of the time accounted. At the last step
        only the `final` ledger is written (it includes the final checkpoint), one point per step."""
        if self.writer is None or (step == self.total and not final):
            return
        for category, value in seconds.items():
            self.writer.add_scalar(f"goodput/{category}", value, step)
        self.writer.add_scalar("goodput/fraction", fraction, step)

    def shadows(self, figures: "board.ShadowFigures", step: int) -> None:
        """The shadow copies after 0-based `step` (board.py): `shadows/host_gb`,
        `shadows/host_gb_job_planned`, `shadows/lag_steps`, `shadows/traffic_bytes`, `shadows/seconds`."""
        if self.writer is None:
            return
        at = board.tb_step(step)
        self.writer.add_scalar("shadows/host_gb", figures.host_bytes / GB, at)
        self.writer.add_scalar("shadows/host_gb_job_planned", figures.job_planned_bytes / GB, at)
        self.writer.add_scalar("shadows/lag_steps", figures.lag_steps, at)
        self.writer.add_scalar("shadows/traffic_bytes", figures.traffic_bytes, at)
        self.writer.add_scalar("shadows/seconds", figures.seconds, at)

    def text(self, tag: str, text: str, step: int) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

    def reconfiguration(self, text: str, info: object, *, step: int, figures: "board.JobFigures") -> None:
        """A generation change seen at 0-based `step`, its first: the text, and the job-level
        figures (board.py) at the step's number."""
        if self.writer is None:
            return
        at = board.tb_step(step)
        self.writer.add_text("reconfiguration", text, at)
        self.writer.add_scalar("reconfiguration/bytes_moved_job", figures.bytes_moved, at)
        if figures.seconds_until_all_entered is not None:
            self.writer.add_scalar("reconfiguration/seconds_until_all_entered", figures.seconds_until_all_entered, at)
        log.at(gen=getattr(info, "generation", 0), step=at, node=self.node).info("%s", text)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
