"""The training loop behind `examples/train.py`: `train(cfg, control)`.

One worker of a job over the control plane it is handed (`rendezvous/worker.py:WorkerContext`
under `torchrun --rdzv-backend=oobleck`), or with none the single-process reference
(`LocalControl`); both run this loop: wait for the next plan (`Target`), enter it
(`Worker.enter`), run its steps (`Worker.run_generation`), and so on. Invariant: a worker lives
through generations without ever restarting; a peer's failure sends it to the next plan, its own
bug ends it with its traceback, and at the end every worker exits 0. docs/recovery.md tells a
reconfiguration, docs/training.md a run.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..config import JobConfig
from ..models import num_layers
from ..logs import JobLog, attach_event_lines
from ..planning import Plan
from .control import ControlPlane, LocalControl
from ..data.dataset import build_dataset
from .resilience.errors import JobFailed, describe
from .telemetry.runlog import Summary
from .startup import KNOWN_ERRORS, check_start, end_job_at_start
from .worker import Boundary, Broken, Finished, HandedOver, Worker

__all__ = ["train", "Summary", "Target"]

log = JobLog(logging.getLogger("oobleck_elastic.train"))


def train(cfg: JobConfig, control: Optional[ControlPlane] = None, *, max_bytes: Optional[int] = None) -> Summary:
    """Train as one worker over `control`, or as the single-process reference when it is None."""
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(message)s")
    attach_event_lines(cfg.logging.events_dir)
    torch.manual_seed(cfg.training.seed)
    try:
        check_start(cfg)
        dataset = build_dataset(cfg, log=log.info, max_bytes=max_bytes)
        if control is None:
            local = control = LocalControl(cfg, num_layers(cfg.model))
            with local.stopped_by_ctrl_c():
                return _train(cfg, dataset, local)
        return _train(cfg, dataset, control)
    except KNOWN_ERRORS as err:
        if control is not None and control.is_job_worker:
            end_job_at_start(control, err)
        raise


@dataclass(frozen=True)
class Target:
    """The plan a worker waits for next."""

    generation: int
    """The generation wanted (or the lowest acceptable one)."""
    exact: bool
    """Exactly that generation (every worker agreed on it at a step boundary), or any newer one
    giving this worker a stage."""

    @classmethod
    def first(cls) -> "Target":
        return cls(1, False)

    @classmethod
    def exactly(cls, generation: int) -> "Target":
        return cls(generation, True)

    @classmethod
    def newer_than(cls, generation: int) -> "Target":
        return cls(generation + 1, False)


_NEWS_WAIT_S = 1.0
"""Longest sleep between looks at the plan (news wakes a worker sooner; this bounds a missed one)."""


def _next_plan(ctx: ControlPlane, target: Target) -> Optional[Plan]:
    """Wait for the plan to enter (`target`): one that gives this worker a stage, or names its
    node a donor. None when this worker must leave (job closed, node drained). Between looks it
    sleeps until what it reads changes (`ControlPlane.wait_for_news`): a worker waiting for the
    first plan, for its node's admission into one, or as a spare costs nothing."""
    while True:
        latest = ctx.plan()
        plan = ctx.plan_at(target.generation) if target.exact else latest
        donor = plan is not None and plan.donor_rank(ctx.node_id, ctx.local_rank) is not None
        if plan is not None and donor and plan.generation >= target.generation and ctx.should_leave(None) is None:
            return plan  # drained: hand the layers over in this generation's entry, then leave
        # a donor named by the latest plan stays for its entry's outcome (a failed hand-over is
        # named again), unless the job closed or the node was fenced
        named = latest is not None and latest.donor_rank(ctx.node_id, ctx.local_rank) is not None
        if ctx.should_leave(None if named else latest):
            return None
        if plan is not None and plan.generation >= target.generation and ctx.my_stage(plan) is not None:
            return plan
        if target.exact and plan is not None:  # no stage in the agreed generation (spare): wait for a later one
            target = Target.newer_than(plan.generation)
        ctx.wait_for_news(_NEWS_WAIT_S)


_EXIT_WATCH_S = 30.0  # a job's worker still there this long after training dumps its stacks


def _record_fatal(ctx: ControlPlane, cfg: JobConfig, err: BaseException, *, step: int, generation: int) -> None:
    """Log and store an error that ends this worker; close the job as failed when the same error
    has now ended workers at this step in `max_repeated_errors` generations in a row."""
    limit = cfg.fault_tolerance.max_repeated_errors
    try:
        rec = ctx.record_error(err, step=step, generation=generation)
    except Exception as etcd_err:  # noqa: BLE001 - never hide the original error behind this one
        log.at(gen=generation, step=step, node=ctx.node_id).error(
            "could not record the error in etcd: %s", describe(etcd_err)
        )
        return
    log.at(gen=generation, step=step, node=ctx.node_id).error(
        "%s ends this worker (%d of %d in a row at this step; not a communication failure)",
        rec.error,
        rec.count,
        limit,
        event="fatal_error",
    )
    if rec.count >= limit:
        reason = (
            f"{rec.error} ended a worker at step {step} in {rec.count} generations in a row "
            f"(fault_tolerance.max_repeated_errors={limit})"
        )
        log.at(gen=generation, step=step, node=ctx.node_id).error(
            "closing the job as failed: %s", reason, event="job_failed"
        )
        ctx.close_job(reason, failed=True)


def _freeze_startup_objects() -> None:
    """Exempt what exists before the first generation from the cycle collector (`gc.freeze`).

    Tearing a generation down collects its cycles at once (`Trainer.abort`: a gloo group closes
    its sockets only when its last reference goes), and a full collection walks every tracked
    object: the imports, the dataset and, with compiled layers, the compiler's graphs and caches,
    a large share of a recovery's time (bench/RESULTS.md). They live as long as the worker, so
    they are frozen once, before the first generation: a collection then walks only what the
    generations built since, which stays collectable (nothing of a generation is frozen)."""
    gc.collect()
    gc.freeze()


def _train(cfg: JobConfig, dataset: Any, ctx: ControlPlane) -> Summary:
    """The one training loop of a worker (see the module docstring) or of the single process."""
    worker = Worker(cfg, dataset, ctx)
    ctx.share_profile(cfg, worker.trainer.device)
    # compiled layers are compiled before this worker counts (engine/stage/compiled.py); with a microbatch
    # size chosen by the planner (`auto`), right after the first entry, before the first step
    if isinstance(cfg.training.microbatch_size, int):
        worker.trainer.warm_up(cfg.training.microbatch_size)
    if ctx.is_job_worker:  # not a caller's process (tests, the reference run)
        _freeze_startup_objects()
    ctx.report_ready()
    target, plan = Target.first(), None
    try:
        while True:
            plan = _next_plan(ctx, target)
            if plan is None:
                return worker.leave()
            entered = worker.enter(plan)
            if isinstance(entered, HandedOver):
                return worker.summary()
            if isinstance(entered, Broken):  # the roll call always ends in a newer plan
                target = Target.newer_than(plan.generation)
                continue
            worker.trainer.warm_up(plan.microbatch_size)  # `auto`: once, before the first step
            outcome = worker.run_generation(plan)
            if isinstance(outcome, Finished):
                return worker.finish(outcome.stopped)
            target = (
                Target.exactly(outcome.generation)
                if isinstance(outcome, Boundary)
                else Target.newer_than(worker.trainer.generation)
            )
    except Exception as err:
        if not isinstance(err, JobFailed):
            _record_fatal(ctx, cfg, err, step=worker.step, generation=plan.generation if plan is not None else 0)
        raise
    finally:
        if ctx.is_job_worker:  # say where it hangs if it cannot exit
            faulthandler.dump_traceback_later(_EXIT_WATCH_S)
        worker.close()
