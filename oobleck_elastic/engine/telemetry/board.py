"""What a job's TensorBoard run holds and where it lies: its directory (`run_name`: one run per
job start, `<logging.tensorboard_dir>/<run id>/<UTC start>`), its tags (`TAGS`, `TEXTS`), its
step numbering (`tb_step`: the steps done, as the progress lines print), its custom-scalars page
(`LAYOUT`) and the figures of a reconfiguration (`JobFigures`) and of the shadow copies
(`ShadowFigures`). Invariant: a job's event files never spread over several runs, and every
figure is the same whichever worker holds rank 0. The tags are listed in docs/training.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from ...planning import Plan
from ...records.goodput import Category
from ..entry.reconfigure import Move
from ..step.shadows import ShadowStore

__all__ = [
    "TAGS",
    "TEXTS",
    "LAYOUT",
    "run_name",
    "tb_step",
    "JobFigures",
    "ShadowFigures",
    "job_bytes_moved",
    "seconds_until_all_entered",
    "layout_tags",
]

TAGS: dict[str, str] = {
    "Throughput/tokens_per_s": "tokens per second over the wall time since the previous step completed",
    "Throughput/samples_per_s": "samples per second, over the same wall time",
    "Throughput/tflops_per_device": "model TFLOP/s per device (engine/telemetry/mfu.py)",
    "Throughput/mfu": "model FLOPs utilisation (only where the device's peak is known)",
    "Throughput/step_time_s": "the step's own time on the writer",
    "Throughput/est_step_time_s": "the planner's estimate of a step for the plan",
    "Throughput/wall_s": "wall time since the previous step completed (a reconfiguration included)",
    "train/loss": "mean token loss of the global batch",
    "train/lr": "learning rate",
    "train/grad_norm": "global gradient norm before clipping",
    "cluster/nodes": "nodes of the plan",
    "cluster/pipelines": "pipelines (data-parallel replicas) of the plan",
    "cluster/generation": "the plan's generation",
    "memory/peak_rss_gb": "the largest peak resident memory of any worker",
    "memory/peak_device_gb": "the largest peak device memory of any worker (CUDA only)",
    **{f"goodput/{c.value}": f"seconds of the job's wall time charged to {c.value}" for c in Category},
    "goodput/fraction": "useful seconds over the seconds accounted",
    "reconfiguration/bytes_moved_job": "layer bytes moved between all workers by a reconfiguration",
    "reconfiguration/seconds_until_all_entered": (
        "from the first worker beginning to enter the generation to the last one entered"
    ),
    "guard/rejected": "1 at a step the step guard did not apply",
    "guard/skipped_steps": "batches skipped so far",
    "straggler/count": "nodes named stragglers",
    "straggler/slowdown/<node>": "a straggler's slowdown (0 once no longer named)",
    "integrity/repaired_copies": "corrupt layer copies replaced so far",
    "shadows/host_gb": "host memory of the shadow copies the writer keeps (as of their last update)",
    "shadows/host_gb_job_planned": "host memory of every node's shadow copies, as the plan sizes them",
    "shadows/lag_steps": "steps the writer's shadow copies were behind (their last finished update against the "
    "step committed) when the step's gradients arrived: 0 when keeping up, 1 when the keeper waited",
    "shadows/traffic_bytes": "bytes the writer sent plus received for the shadow copies in the step",
    "shadows/seconds": "the writer's time in the step on the shadow exchange (goodput's `shadows`)",
}
"""Every scalar tag the writer may write, with its meaning."""

TEXTS = ("plan", "reconfiguration", "guard", "integrity")
"""The text tags (TensorBoard's TEXT tab)."""

CATEGORY = "oobleck"
"""The custom-scalars category of `LAYOUT`."""

LAYOUT: dict[str, dict[str, tuple[str, list[str]]]] = {
    CATEGORY: {
        "throughput: tokens/s": ("Multiline", ["^Throughput/tokens_per_s$"]),
        "throughput: step time (s): own, planned, since the previous step": (
            "Multiline",
            ["^Throughput/step_time_s$", "^Throughput/est_step_time_s$", "^Throughput/wall_s$"],
        ),
        "nodes and pipelines": ("Multiline", ["^cluster/nodes$", "^cluster/pipelines$"]),
        "memory (GB, the largest worker's peak)": ("Multiline", ["^memory/peak_(rss|device)_gb$"]),
        "goodput: useful fraction": ("Multiline", ["^goodput/fraction$"]),
        "goodput: seconds by category": ("Multiline", [f"^goodput/{c.value}$" for c in Category]),
    }
}
"""The custom-scalars page (`SummaryWriter.add_custom_scalars`): chart title -> (kind, tag regexes)."""


def layout_tags(layout: dict[str, dict[str, tuple[str, list[str]]]] = LAYOUT) -> list[str]:
    """Every tag regex of a custom-scalars layout, in order."""
    return [tag for charts in layout.values() for _, tags in charts.values() for tag in tags]


def run_name(run_id: str, *, now: Optional[float] = None, taken: Callable[[str], bool] = lambda name: False) -> str:
    """A new run's directory under `logging.tensorboard_dir`: `<run id>/<UTC start>`, with `-2`,
    `-3`, ... appended while `taken(name)` (the directory exists). The job's first writer records
    it in etcd (records/board.py) and every later one reads it there, so a job's event files never
    spread over several runs and a job started again never writes into an older one."""
    if not run_id or "/" in run_id or run_id in (".", ".."):
        raise ValueError(f"run id {run_id!r} cannot name a TensorBoard directory: use a name without '/'")
    base = f"{run_id}/{time.strftime('%Y%m%d-%H%M%S', time.gmtime(time.time() if now is None else now))}"
    name, n = base, 1
    while taken(name):
        n += 1
        name = f"{base}-{n}"
    return name


def tb_step(step: int) -> int:
    """TensorBoard's step for 0-based step `step`: the number of steps done once it is, the number
    the progress line prints."""
    return step + 1


def job_bytes_moved(moves: Iterable[Move]) -> int:
    """Layer bytes moved between all workers by an entry (each move counted once, at its sender)."""
    return sum(m.bytes for m in moves)


def seconds_until_all_entered(first_began: Optional[float], last_entered: Optional[float]) -> Optional[float]:
    """From the first worker beginning to enter a generation to the last one entered (Unix times
    agreed in the commit vote, as a smallest and a largest value: no extra collective); None when
    either is unknown. The times come from several hosts: clocks that disagree shift it."""
    if first_began is None or last_entered is None:
        return None
    return max(0.0, last_entered - first_began)


@dataclass(frozen=True)
class JobFigures:
    """A reconfiguration's job-level figures, as rank 0 writes them."""

    bytes_moved: int
    """`reconfiguration/bytes_moved_job`: layer bytes moved between all workers."""
    seconds_until_all_entered: Optional[float]
    """`reconfiguration/seconds_until_all_entered` (None: not known, then not written)."""

    @classmethod
    def of(cls, moves: Iterable[Move], entry_window: tuple[Optional[float], Optional[float]]) -> "JobFigures":
        """From the entry's moves (the same on every worker) and the agreed entry window of the
        generation's first step (`StepResult.entry_window`)."""
        return cls(job_bytes_moved(moves), seconds_until_all_entered(*entry_window))


@dataclass(frozen=True)
class ShadowFigures:
    """One step's shadow-copy figures, as the writer writes them. `host_bytes` is measured after
    each update (it never waits for the one running in the background); the job's are the plan's
    sizes, not a measurement; `lag_steps` is measured from the keeper's finished updates
    (`ShadowStore.catch_up`): a positive figure is a keeper whose background update the step waited for."""

    host_bytes: int
    """`shadows/host_gb`: the writer's shadows (0 when it keeps none)."""
    job_planned_bytes: int
    """`shadows/host_gb_job_planned`: every node's shadows, as the plan sizes them."""
    lag_steps: int
    """`shadows/lag_steps`: the step committed minus the step whose update the writer's shadows had
    finished when this step's gradients arrived (`ShadowStore.lag_steps`; 0 when it keeps none)."""
    traffic_bytes: int
    """`shadows/traffic_bytes`: the writer's shadow traffic in the step."""
    seconds: float
    """`shadows/seconds`: the writer's time in the step on the shadow exchange."""

    @classmethod
    def of(
        cls, step: int, plan: Optional[Plan], store: Optional[ShadowStore], *, traffic_bytes: int, seconds: float
    ) -> Optional["ShadowFigures"]:
        """After 0-based `step` was applied: the figures, or None when the plan keeps no shadows."""
        if plan is None or plan.shadows is None or plan.shadows.copies == 0:
            return None
        kept = store is not None and bool(store.layers)
        return cls(
            host_bytes=store.host_bytes if store is not None and kept else 0,
            job_planned_bytes=sum(plan.shadows.load().values()),
            lag_steps=store.lag_steps if store is not None and kept else 0,
            traffic_bytes=traffic_bytes,
            seconds=seconds,
        )
