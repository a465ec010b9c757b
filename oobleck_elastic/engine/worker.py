"""One worker's part of each generation (`Worker`): enter it, run its steps, answer what they report.

It holds what lives across generations (its `Trainer`, step runner, run log, step guard,
checkpoint policy, straggler watch, heartbeat, goodput clock) and answers the loop of
engine/run.py with outcomes: `enter` gives `Entered`, `HandedOver` (a drained node's worker) or
`Broken`; `run_generation` runs each step in the step thread (engine/runner.py) while it watches
the control plane, and gives `Finished`, `Boundary` (every worker agreed to move on at a step
boundary) or `Broken`; `finish` and `leave` end the run with its `Summary`. Invariant: a worker
never exits because of someone else's failure. docs/recovery.md.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

from ..config import JobConfig
from ..logs import JobLog
from ..planning import Plan
from ..records.errors import next_error_record
from ..records.goodput import Category
from .checkpointing import CheckpointPolicy, NothingToRestore, retake_reason
from .control import ControlPlane
from .entry.devices import configure_cuda, configure_nccl, resolve_device
from .resilience.errors import JobFailed, StepAbandoned, describe, is_communication_error
from .resilience.guard import GuardDecision, StepGuard, TooManySkipped, Verdict
from .resilience.heartbeat import Heartbeat
from .resilience.straggler import StragglerWatch
from .runner import StepRunner, require_hard_exit
from .telemetry import memory
from .telemetry.goodput import GoodputClock
from .telemetry.runlog import RunLog, Summary
from .trainer import LayersLost, Reconfiguration, StepResult, Trainer

__all__ = ["Worker", "Entered", "HandedOver", "Broken", "Boundary", "Finished"]

log = JobLog(logging.getLogger("oobleck_elastic.train"))


@dataclass(frozen=True)
class Entered:
    """The worker entered the generation and goes on at `step`."""

    info: Optional[Reconfiguration]
    """The entry's account (None when a checkpoint was restored because layers were lost)."""
    step: int


@dataclass(frozen=True)
class HandedOver:
    """A drained node's worker handed its layers over and leaves the job."""


@dataclass(frozen=True)
class Broken:
    """The generation broke here (a communication failure, or a step the control plane abandoned)."""

    failure: str


@dataclass(frozen=True)
class Boundary:
    """Every worker agreed, at a step boundary, to move on to `generation`."""

    generation: int


@dataclass(frozen=True)
class Finished:
    """The last step is done, or every worker agreed to stop the job at this boundary (`stopped`:
    why it was asked to stop, `ControlPlane.stop_requested`)."""

    stopped: Optional[str] = None


class Worker:
    """One worker's state across generations: its trainer, step runner, run log and checkpoints."""

    def __init__(self, cfg: JobConfig, dataset: Any, ctx: ControlPlane) -> None:
        self.cfg, self.ctx = cfg, ctx
        device = resolve_device(cfg.training.device, ctx.local_rank)
        if device.type == "cuda":
            nccl, replaced = configure_nccl()
            for message in replaced:
                log.at(node=ctx.node_id).warning("%s", message)
            log.at(node=ctx.node_id).info("worker %d on %s; NCCL settings %s", ctx.local_rank, device, nccl)
            late = configure_cuda(device)
            if late is not None:
                log.at(node=ctx.node_id).warning("%s", late)
        rss_at_start = memory.current_rss_bytes()
        self.trainer = Trainer(cfg, dataset=dataset, node=ctx.node_id, local_rank=ctx.local_rank, device=device)
        self.log = RunLog(
            cfg, node=ctx.node_id, rss_at_start=rss_at_start, run_id=ctx.run_id, claim_run=ctx.tensorboard_run
        )
        self.guard = StepGuard(cfg.fault_tolerance.max_skipped_steps)
        self.checkpoints = CheckpointPolicy(cfg, node=ctx.node_id, guard=self.guard)
        self.runner = StepRunner(self.trainer.device)
        self.stragglers = StragglerWatch(cfg.fault_tolerance.straggler_factor, cfg.fault_tolerance.straggler_steps)
        self.heartbeat = Heartbeat(ctx.local_rank)  # to this node's agent (rendezvous/hang.py)
        self.goodput = GoodputClock(ctx.node_id)  # the job's goodput ledger, while this worker holds rank 0
        self.step = 0
        self.entry_step = 0
        """The step this worker entered its generation at (a failure before it moved on breaks a
        generation that made no progress here)."""
        self.retake: Optional[str] = None
        """Why this generation saves a checkpoint before its first step (`retake_reason`), if it does."""

    def enter(self, plan: Plan) -> Union[Entered, HandedOver, Broken]:
        """Enter `plan`'s generation: connect, settle the interrupted step, move layers; at the
        job's first start, resume from a checkpoint; when layers have no surviving copy, restore."""
        trainer, ctx = self.trainer, self.ctx
        info: Optional[Reconfiguration] = None
        trainer.faults.before_entry(
            node=ctx.node_id, generation=plan.generation
        )  # injected: engine/resilience/faults.py
        typical = self.heartbeat.typical_step_s  # the auto timeouts follow it (config/timing.py)
        self._follow_timeout(plan.generation, typical, running=False)
        try:
            try:
                store = ctx.store_for(plan.generation, self.cfg, typical_step_s=typical)
                info = trainer.enter_generation(plan, store, load_plan=ctx.plan_at)
                step = info.resume_step
                if info.previous == 0 and step == 0:
                    step = self.checkpoints.resume(trainer)
            except LayersLost as err:
                try:
                    step, text = self.checkpoints.restore_lost(trainer, err)
                except NothingToRestore as lost:
                    log.at(gen=plan.generation, node=ctx.node_id).error("%s", lost, event="job_failed")
                    ctx.close_job(str(lost), failed=True)  # every worker stops; no agent restarts it
                    raise JobFailed(str(lost)) from None
                self.log.restored_checkpoint(text, step)
        except Exception as err:
            if not is_communication_error(err):
                raise
            self._record_failure(err, plan.generation)
            return self._broken_entry(plan, describe(err))
        if info is not None and info.donor:
            require_hard_exit("donor")
            log.at(node=ctx.node_id).info(
                "leaving the job (node %s %s; its layers were handed over to generation %d)",
                ctx.node_id,
                "came back after it was declared lost" if ctx.node_id in plan.returned else "was drained",
                plan.generation,
                event="handed_over",
            )
            return HandedOver()
        ctx.entered(plan.generation)
        self.step = self.entry_step = step
        self.retake = (
            retake_reason(
                plan,
                previous=info.previous,
                step=step,
                steps=self.cfg.training.steps,
                extra=plan.shadows.extra() if plan.shadows is not None else None,
            )
            if info is not None
            else None  # a checkpoint was just restored: it is the state
        )
        self.log.entered(trainer, info, step)
        self.goodput.entered(plan.generation, step, rank0=trainer.rank == 0, origin=ctx.goodput_origin)
        return Entered(info, step)

    def _broken_entry(self, plan: Plan, failure: str) -> Union[HandedOver, Broken]:
        """The entry failed (outside its except block: see Trainer.abort)."""
        trainer, ctx = self.trainer, self.ctx
        if ctx.my_stage(plan) is None:  # a donor: it still holds its layers, and waits for the next plan
            _abort(trainer)
            log.at(gen=trainer.generation, node=ctx.node_id).warning(
                "handing layers over to generation %d failed (%s); waiting for the next plan: it hands them "
                "over in that one's entry if it names this node a donor, and leaves otherwise",
                plan.generation,
                failure,
                event="handover_failed",
            )
            return Broken(failure)
        self.log.broke()
        _abort(trainer)
        ctx.report_failure(plan.generation)
        log.at(gen=trainer.generation, node=ctx.node_id).warning(
            "entering generation %d failed (%s); waiting for a newer plan",
            plan.generation,
            failure,
            event="entry_failed",
            fields={"target": plan.generation},
        )
        return Broken(failure)

    def run_generation(self, plan: Plan) -> Union[Finished, Boundary, Broken]:
        """Steps of the generation entered, until the last one, a boundary every worker agreed to
        leave at, or a failure."""
        trainer, ctx, steps = self.trainer, self.ctx, self.cfg.training.steps
        check, watch_s = ctx.abandon_check(plan), self.cfg.fault_tolerance.watch_interval_s

        def should_abandon() -> Optional[str]:
            self.heartbeat.tick()  # what the step thread reported (rendezvous/hang.py)
            return check()

        failure, abandoned, failed_at = None, False, 0.0
        try:
            if self.retake is not None:  # a re-plan left some layer short of f+1 copies
                reason, self.retake = self.retake, None
                with self.goodput.checkpointing():
                    self.checkpoints.retake(trainer, reason, self.step)
            while self.step < steps:
                latest = ctx.plan() if trainer.rank == 0 else None
                newest = latest.generation if latest else 0  # the generation rank 0 votes for
                rejections = self.guard.attempts.get(self.step, 0)
                stop = ctx.stop_requested()  # from the mirror: the commit makes every worker agree
                self.heartbeat.begin(self.step)
                self.goodput.began_step()
                completed = False
                try:
                    result = self.runner.run(
                        functools.partial(  # the epoch now: the step thread may take it up after an abandonment
                            trainer.train_step,
                            self.step,
                            seen_generation=newest,
                            rejections=rejections,
                            stop=stop is not None,
                            epoch=trainer.applier.epoch,
                        ),
                        should_abandon=should_abandon,
                        interval_s=watch_s,
                    )
                    completed = True
                finally:
                    self.heartbeat.end(self.step, completed=completed)
                self._follow_timeout(plan.generation, self.heartbeat.typical_step_s, running=True)
                if result.rejected:
                    self._rejected(result)
                else:
                    self.guard.decide(self.step, Verdict(True))
                    self.goodput.ended_step(self.step, Category.USEFUL, result.shadow_s)
                    report = self.goodput.reporter(ctx.report_progress, self.log.metrics) if trainer.rank == 0 else None
                    self.log.stepped(trainer, result, report=report)
                    if result.repaired or result.unrepairable:
                        self._integrity(result)
                    self._watch_stragglers(plan, result)
                    self.step += 1
                    with self.goodput.checkpointing():
                        self.checkpoints.after_step(trainer, self.step)
                if result.stop:  # before a boundary: the job ends here, whatever a new plan would change
                    return Finished(stopped=ctx.stop_requested() or "a request to stop")
                if result.next_generation > trainer.generation:
                    return Boundary(result.next_generation)
        except Exception as err:
            if not is_communication_error(err):
                raise
            failure, abandoned = describe(err), isinstance(err, StepAbandoned)
            failed_at = time.time()
            if self.step == self.entry_step and not abandoned:  # no progress here: what broke it counts
                self._record_failure(err, trainer.generation)
        if failure is None:
            return Finished()
        self.log.broke()  # outside the except block: see Trainer.abort
        _abort(trainer, abandoned=abandoned)
        # when the failure was seen here, and how long the teardown took (bench/recovery.py's timeline)
        timing = {"seen": round(failed_at, 3), "abort_s": round(time.time() - failed_at, 3)}
        if abandoned:  # the leader has acted already: no roll call needed
            log.at(gen=trainer.generation, step=self.step, node=ctx.node_id).warning(
                "step abandoned (%s); entering the next generation", failure, event="step_abandoned", fields=timing
            )
        else:
            ctx.report_failure(trainer.generation)
            log.at(gen=trainer.generation, step=self.step, node=ctx.node_id).warning(
                "communication failed (%s); waiting for the next plan", failure, event="comm_failed", fields=timing
            )
        return Broken(failure)

    def _record_failure(self, err: BaseException, generation: int) -> None:
        """Record `err`, which broke `generation` here before this worker committed a step in it,
        for the restart bound (`ControlPlane.record_failure`). Called in the except block, before
        the teardown: the worker that failed first writes first, and the exception and its frames
        do not outlive the block (see Trainer.abort)."""
        ctx = self.ctx
        record = next_error_record(
            None, err, step=self.step, generation=generation, node=ctx.node_id, local_rank=ctx.local_rank
        )
        try:
            ctx.record_failure(record)
        except Exception as etcd_err:  # noqa: BLE001 - the generation's failure is handled all the same
            log.at(gen=generation, step=self.step, node=ctx.node_id).warning(
                "could not record what broke the generation: %s", describe(etcd_err)
            )

    def _follow_timeout(self, generation: int, typical: float, *, running: bool) -> None:
        """The auto communication timeout derived again from the typical step (`Trainer.derive_timeout`):
        at the entry, and between steps whenever that step was first measured or changed a lot."""
        old, basis = self.trainer.timeout.total_seconds(), self.trainer.timeout_basis_s
        new = self.trainer.derive_timeout(typical, running=running)
        if new is None:
            return
        if not running:
            why = "entering the generation"
        else:
            why = f"the typical step went from {basis:.3f} s" if basis > 0 else "the first steps were measured"
        log.at(gen=generation, step=self.step, node=self.ctx.node_id).info(
            "communication timeout %.0f s -> %.0f s: %s (typical step %.3f s; fault_tolerance.comm_timeout_s sets it)",
            old,
            new,
            why,
            typical,
        )

    def _rejected(self, result: StepResult) -> None:
        """The step guard did not apply `result.step` (engine/resilience/guard.py): replay it, or skip its
        batch, or stop the job when too many were skipped in a row."""
        trainer, step = self.trainer, result.step
        self.guard.attempts[step] = max(self.guard.attempts.get(step, 0), result.rejections)
        try:
            decision = self.guard.decide(step, Verdict(False, result.rejected))
        except TooManySkipped as err:
            log.at(gen=trainer.generation, step=step, node=self.ctx.node_id).error("%s", err, event="too_many_skipped")
            if trainer.rank == 0:
                self.ctx.close_job(str(err), failed=True)
            raise JobFailed(str(err)) from None
        skipped = decision is GuardDecision.SKIP
        what = "skipping its batch" if skipped else "replaying it"
        log.at(gen=trainer.generation, step=step, node=self.ctx.node_id).warning(
            "step %d not applied: %s; %s",
            step + 1,
            result.rejected,
            what,
            event="skipped" if skipped else "replayed",
            fields={"seconds": result.seconds},  # the run's own time (tests cross-check the goodput ledger)
        )
        self.goodput.ended_step(step, Category.SKIPPED if skipped else Category.REPLAYED, result.shadow_s)
        self.log.rejected(result, skipped=skipped)
        if trainer.rank == 0:
            self.ctx.record_skip(generation=trainer.generation, step=step, detail=f"{result.rejected}; {what}")
        if skipped:
            trainer.skip(step)
            self.step += 1
            with self.goodput.checkpointing():
                self.checkpoints.after_step(trainer, self.step)

    def _watch_stragglers(self, plan: Plan, result: StepResult) -> None:
        """Every worker follows the same verdict (engine/resilience/straggler.py); rank 0 says it and tells
        the leader."""
        verdict = self.stragglers.observe(plan, result.compute_s)
        if not verdict.report or self.trainer.rank != 0:
            return
        named = ", ".join(f"{node} ({slow:.1f}x)" for node, slow in sorted(verdict.named.items()))
        done = result.step + 1  # the step's number, as the progress line and TensorBoard count it
        detail = (
            (
                f"step {done}: straggler(s) {named}; pipelines' seconds per microbatch "
                + " ".join(f"{s:.4f}" for s in verdict.pipeline_s)
            )
            if verdict.named
            else f"step {done}: no straggler any more"
        )
        log.at(gen=plan.generation, step=done, node=self.ctx.node_id).warning(
            "%s", detail, event="straggler", fields={"stragglers": verdict.named}
        )
        self.log.stragglers(verdict.named, result.step)
        if verdict.changed:
            self.ctx.record_event(kind="straggler", generation=plan.generation, detail=detail)
        self.ctx.report_stragglers(
            generation=plan.generation, step=result.step, nodes=verdict.named, pipeline_s=verdict.pipeline_s
        )

    def _integrity(self, result: StepResult) -> None:
        """The replica fingerprints after `result.step` found corrupt copies (engine/resilience/fingerprint.py):
        say which were replaced, or stop the job when a layer's copies have no majority."""
        trainer, ctx = self.trainer, self.ctx
        if result.unrepairable:
            log.at(gen=trainer.generation, step=result.step, node=ctx.node_id).error(
                "%s", result.unrepairable, event="unrepairable"
            )
            if trainer.rank == 0:
                ctx.close_job(result.unrepairable, failed=True)
            raise JobFailed(result.unrepairable)
        for c in result.repaired:
            bad = ", ".join(f"rank {r}" for r in c.bad)
            lane = f" lane {c.lane}" if trainer.plan is not None and trainer.plan.tensor_parallel > 1 else ""
            detail = (
                f"step {result.step + 1}: layer {c.layer}{lane}"
                f": the copy of {bad} differed from its {len(c.holders)} holders' majority; replaced by "
                f"rank {c.source}'s (silent data corruption)"
            )
            self.log.repaired(detail, result.step, generation=trainer.generation)
            if trainer.rank == 0:
                ctx.record_event(kind="repair", generation=trainer.generation, detail=detail)

    def finish(self, stopped: Optional[str] = None) -> Summary:
        """After the last step, or at the boundary where every worker agreed to stop (`stopped`: why
        the job was asked to): the final checkpoint; the worker holding rank 0 closes the job, as
        failed when that checkpoint did not fit on disk (every worker skipped it alike)."""
        with self.goodput.checkpointing():
            unsaved = self.checkpoints.finish(self.trainer, trained=self.log.count > 0, step=self.step)
        at = log.at(gen=self.trainer.generation, step=self.step, node=self.ctx.node_id)
        if unsaved is not None:
            if self.trainer.rank == 0:
                at.error("%s", unsaved, event="job_failed")
                self.ctx.close_job(unsaved, failed=True)
            raise JobFailed(unsaved)
        if self.trainer.rank == 0:
            self.goodput.finished(
                self.ctx.report_progress, self.log.metrics, generation=self.trainer.generation, step=self.step
            )
            if stopped is None:
                self.ctx.close_job(f"finished {self.cfg.training.steps} steps")
            else:
                saved = self.checkpoints.final_dir
                reason = f"stopped at step {self.step} of {self.cfg.training.steps} on request ({stopped})" + (
                    f"; its checkpoint: {saved}; the same command resumes it" if saved is not None else ""
                )
                at.warning("%s", reason, event="stopped")
                self.ctx.close_job(reason, stopped=True)
        return self.summary(stopped=(self.step, stopped) if stopped is not None else None)

    def leave(self) -> Summary:
        """The plan has no place for this worker any more: the job closed or the node was drained."""
        failed = self.ctx.failure_of_job()
        if failed is not None:
            raise JobFailed(f"the job was closed as failed: {failed}")
        log.at(node=self.ctx.node_id).info("leaving the job (%s)", self.ctx.should_leave(self.ctx.plan()), event="left")
        return self.summary()

    def summary(self, *, stopped: Optional[tuple[int, str]] = None) -> Summary:
        return self.log.summary(
            checkpoint=self.checkpoints.final_dir, resumed=self.checkpoints.resumed, stopped=stopped
        )

    def close(self) -> None:
        self.heartbeat.close()
        self.runner.close()
        self.log.close()
        self.trainer.close()


def _abort(trainer: Trainer, *, abandoned: bool = False) -> None:
    """Tear a broken generation down (Trainer.abort). Its gloo groups may keep threads blocked on
    the dead peer, which the interpreter's shutdown would wait for: this process ends at once after
    training instead (engine/runner.py, `exit_now_if_abandoned`)."""
    trainer.abort(abandoned=abandoned)
    require_hard_exit("a generation broke in this process")
