"""The data plane's one view of the control plane (`ControlPlane`), and its single-process
implementation (`LocalControl`).

The worker loop (engine/run.py, engine/worker.py) needs only what `ControlPlane` lists: plans,
whether to leave, a store for a generation's process groups, when to abandon a step, where to
report. `rendezvous/worker.py:WorkerContext` serves a torchrun job on etcd; `LocalControl` one
process with no etcd: a one-worker plan on an in-memory store. Invariant: the single-process
reference runs the same loop, entry and step (commit included) as any worker, on a world of one;
`is_job_worker` is the only thing that tells them apart. docs/design.md.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from ..config import JobConfig
from ..config.timing import comm_timeout
from ..planning import MicrobatchChoice, PipelineSpec, Plan, StagePlacement, fixed_microbatch_size
from ..records.job import ProgressRecord
from ..records.errors import ErrorRecord, next_error_record
from ..records.goodput import Origin

log = logging.getLogger(__name__)


class ControlPlane(Protocol):
    node_id: str
    """This worker's node."""
    local_rank: int
    """This worker's device index on its node."""

    @property
    def is_job_worker(self) -> bool:
        """This process is a job's worker (started by torchrun), not a caller's (a test, the reference
        run): it may freeze what it built before training and must say where it hangs at exit."""
        ...

    def plan(self) -> Optional[Plan]:
        """The current generation's plan (None before the first)."""

    def plan_at(self, generation: int) -> Optional[Plan]:
        """The plan of a past or current generation."""

    def my_stage(self, plan: Plan) -> Optional[tuple[PipelineSpec, StagePlacement]]:
        """This worker's pipeline and stage in `plan`, or None (a spare)."""

    def should_leave(self, plan: Optional[Plan]) -> Optional[str]:
        """Why this worker must stop now (job closed, node drained or fenced), or None."""

    def wait_for_news(self, timeout: float) -> None:
        """Sleep until what `plan`, `plan_at` and `should_leave` read may have changed since the
        last call (a watched key changed), or `timeout` seconds at most."""

    def stop_requested(self) -> Optional[str]:
        """Why the job was asked to stop at its next step boundary (after a checkpoint), or None."""

    def failure_of_job(self) -> Optional[str]:
        """The reason the job was closed as failed, or None."""

    def store_for(self, generation: int, cfg: JobConfig, *, typical_step_s: float = 0.0) -> dist.Store:
        """The c10d store of `generation`'s process groups (`typical_step_s`: this worker's typical
        step, from which the auto timeouts derive, config/timing.py)."""

    def abandon_check(self, plan: Plan) -> Callable[[], Optional[str]]:
        """`should_abandon` for steps of `plan` (see engine/runner.py)."""

    def share_profile(self, cfg: JobConfig, device: torch.device) -> None:
        """Measure and publish the planner's profile on this device, if nobody has."""

    def report_ready(self) -> None:
        """This worker can join a generation."""

    def report_failure(self, generation: int, *, kind: str = "failure") -> None:
        """Check in at the roll call: `generation` broke here."""

    def record_failure(self, record: ErrorRecord) -> None:
        """What broke `record.generation` here before this worker committed a step in it (the
        generation's first such record is kept, for the restart bound)."""

    def entered(self, generation: int) -> None:
        """This worker entered `generation` (a `stall` check-in made while joining is withdrawn)."""

    def report_progress(self, *, generation: int, step: int, **extra: Any) -> None:
        """Completed `step` steps (the worker holding rank 0 reports)."""

    def record_error(self, err: BaseException, *, step: int, generation: int) -> ErrorRecord:
        """Store the error that ends this worker; the record says how often it repeated."""

    def close_job(self, reason: str, *, failed: bool = False, stopped: bool = False, known_error: bool = False) -> None:
        """Every worker leaves (with an error when `failed`; `stopped`: asked to, before the last step;
        `known_error`: failed by a known error before the first step, `ClosedRecord.known_error`)."""

    def record_skip(self, *, generation: int, step: int, detail: str) -> None:
        """The step guard did not apply `step` (engine/resilience/guard.py): an event for operators."""

    def report_stragglers(
        self, *, generation: int, step: int, nodes: dict[str, float], pipeline_s: Sequence[float]
    ) -> None:
        """The nodes named stragglers after `step` and each pipeline's measured seconds per
        microbatch (engine/resilience/straggler.py), for the leader to re-split the batch (rank 0 reports)."""

    def record_event(self, *, kind: str, generation: int, detail: str) -> None:
        """An event for operators about this job (`oobleck events`): `kind` is an EventKind value
        (`repair`: a corrupt layer copy was replaced; `straggler`: a slow node was named or cleared)."""

    def progress(self) -> Optional[ProgressRecord]:
        """The job's last reported progress (None: no step reported yet)."""

    def goodput_origin(self) -> Origin:
        """What a worker entering a generation as rank 0 continues the job's goodput ledger from
        (engine/telemetry/goodput.py): the last one reported with progress, or the job's start and first plan."""

    @property
    def run_id(self) -> str:
        """The job's run id (torchrun's `--rdzv-id`; `name` for the single process)."""

    def tensorboard_run(self, proposed: str) -> str:
        """The job's TensorBoard run under `logging.tensorboard_dir` (engine/telemetry/board.py):
        `proposed` by its first writer, the same for every later one."""


def one_worker_plan(
    cfg: JobConfig, num_layers: int, *, node: str = "local", microbatch_size: Optional[int] = None
) -> Plan:
    """Generation 1 of a one-worker job: one pipeline, one stage holding every layer, microbatches
    of training.microbatch_size (`microbatch_size` when the config says auto)."""
    t = cfg.training
    size = fixed_microbatch_size(cfg) or microbatch_size
    if size is None:
        raise ValueError(
            "training.microbatch_size=auto: give one_worker_plan the microbatch size chosen (local_microbatch_size)"
        )
    stage = StagePlacement(index=0, start=0, end=num_layers, node=node, local_rank=0, rank=0)
    pipe = PipelineSpec(
        index=0,
        template_nodes=1,
        nodes=(node,),
        microbatches=t.global_batch_size // size,
        stages=(stage,),
        est_time_s=0.0,
    )
    return Plan(
        generation=1,
        nodes=(node,),
        spares=(),
        gpus_per_node=1,
        num_layers=num_layers,
        microbatch_size=size,
        pipelines=(pipe,),
        est_step_time_s=0.0,
        f=0,
    )


def local_microbatch_size(cfg: JobConfig) -> MicrobatchChoice:
    """training.microbatch_size=auto in a single process: the profile (planning.profile_path at
    tensor_parallel 1, else the cached or freshly measured one of this process's device) and the
    planner's choice for one stage holding every layer on that device
    (`planning.single_worker_microbatch_size`)."""
    from ..planning import load_profiles, single_worker_microbatch_size
    from ..planning.profile.cache import load_or_profile
    from .entry.devices import resolve_device

    if cfg.planning.profile_path:
        one = dataclasses.replace(cfg, planning=dataclasses.replace(cfg.planning, tensor_parallel=1))
        profile = load_profiles(one)[1]
    else:
        profile = load_or_profile(cfg, device=resolve_device(cfg.training.device, 0), log=log.info)
    choice = single_worker_microbatch_size(cfg, profile)
    log.info(
        "training.microbatch_size=auto: %d (%s)",
        choice.size,
        ", ".join(
            f"{o.size}: {o.samples_per_s:.4g} samples/s" if o.fits else f"{o.size}: does not fit"
            for o in choice.options
        ),
    )
    return choice


class LocalControl:
    """`ControlPlane` of a single process (see the module docstring). With
    training.microbatch_size=auto the one-worker plan's size is `local_microbatch_size`'s."""

    def __init__(self, cfg: JobConfig, num_layers: int) -> None:
        self.node_id, self.local_rank, self._run_id = "local", 0, cfg.name
        started = time.time()
        size = local_microbatch_size(cfg).size if fixed_microbatch_size(cfg) is None else None
        self._plan = one_worker_plan(cfg, num_layers, node=self.node_id, microbatch_size=size)
        self._origin = Origin(reported=None, start=started, first_plan=time.time())  # engine/telemetry/goodput.py
        self._closed: Optional[tuple[str, bool]] = None
        self._last_error: Optional[ErrorRecord] = None
        self.stop: Optional[str] = None
        """Set to a reason to stop the run at its next step boundary (`ControlPlane.stop_requested`)."""

    @property
    def is_job_worker(self) -> bool:
        return False

    def plan(self) -> Optional[Plan]:
        return self._plan

    def plan_at(self, generation: int) -> Optional[Plan]:
        return self._plan if generation == self._plan.generation else None

    def my_stage(self, plan: Plan) -> Optional[tuple[PipelineSpec, StagePlacement]]:
        return plan.stage_of(0)

    def should_leave(self, plan: Optional[Plan]) -> Optional[str]:
        return "the job is closed" if self._closed is not None else None

    def wait_for_news(self, timeout: float) -> None:
        time.sleep(timeout)  # nothing changes under a single process but itself

    def stop_requested(self) -> Optional[str]:
        return self.stop

    @contextmanager
    def stopped_by_ctrl_c(self) -> Iterator[None]:
        """While the block runs (in the main thread): a first Ctrl-C asks the run to stop at its next
        step boundary, with a checkpoint (`stop`); a second one interrupts at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_sigint(_signum: int, _frame: object) -> None:
            if self.stop is not None:
                raise KeyboardInterrupt
            self.stop = "Ctrl-C"
            log.warning("Ctrl-C: stopping at the next step boundary, with a checkpoint; Ctrl-C again stops at once")

        previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def failure_of_job(self) -> Optional[str]:
        return self._closed[0] if self._closed is not None and self._closed[1] else None

    def store_for(self, generation: int, cfg: JobConfig, *, typical_step_s: float = 0.0) -> dist.Store:
        store = dist.HashStore()
        store.set_timeout(timedelta(seconds=comm_timeout(cfg.fault_tolerance, typical_step_s)))
        return store

    def abandon_check(self, plan: Plan) -> Callable[[], Optional[str]]:
        return lambda: None

    def share_profile(self, cfg: JobConfig, device: torch.device) -> None:
        pass  # nobody plans: the plan is fixed

    def report_ready(self) -> None:
        pass

    def report_failure(self, generation: int, *, kind: str = "failure") -> None:
        pass

    def record_failure(self, record: ErrorRecord) -> None:
        pass

    def entered(self, generation: int) -> None:
        pass

    def report_progress(self, *, generation: int, step: int, **extra: Any) -> None:
        pass

    def record_skip(self, *, generation: int, step: int, detail: str) -> None:
        pass

    def record_event(self, *, kind: str, generation: int, detail: str) -> None:
        pass

    def report_stragglers(
        self, *, generation: int, step: int, nodes: dict[str, float], pipeline_s: Sequence[float]
    ) -> None:
        pass

    def progress(self) -> Optional[ProgressRecord]:
        return None

    def goodput_origin(self) -> Origin:
        return self._origin

    @property
    def run_id(self) -> str:
        return self._run_id

    def tensorboard_run(self, proposed: str) -> str:
        return proposed  # one process: its writer is the job's only one

    def record_error(self, err: BaseException, *, step: int, generation: int) -> ErrorRecord:
        self._last_error = next_error_record(
            self._last_error, err, step=step, generation=generation, node=self.node_id, local_rank=0, now=time.time()
        )
        return self._last_error

    def close_job(self, reason: str, *, failed: bool = False, stopped: bool = False, known_error: bool = False) -> None:
        self._closed = (reason, failed)
