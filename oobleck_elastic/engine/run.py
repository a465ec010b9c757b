"""The training loop behind `examples/train.py`.

`train(cfg)` runs as one worker of a job when started under `torchrun --rdzv-backend=oobleck`
(the handler put `OOBLECK_RUN_ID` and the etcd settings in the environment), or in one process
when started with plain `python` (the reference run). Both run the same loop, `_train`, over a
`ControlPlane` (engine/control.py): etcd for a worker, a fixed one-worker plan for one process.

A worker lives through generations without ever restarting:

- it waits for a plan that gives it a stage and enters that generation (trainer.enter_generation:
  process groups on an etcd-backed store under `store/g<generation>/`, agreement on the last
  committed step, roll-forward or replay, layers and optimizer state from surviving holders);
- it trains; at every step boundary the generation's rank 0 contributes the newest plan
  generation it sees in etcd, and a MAX all-reduce makes every worker leave for it at the same
  boundary (joins and drains lose no work);
- each step runs in a thread (engine/runner.py) while the worker watches the control plane: a
  newer plan that leaves a lost node out abandons the step at once (a hung peer is cut off by
  the control plane, not by a collective timing out);
- when a communication call fails (a peer died), it tears its process group down at once, which
  spreads the error to every peer within tens of milliseconds, and waits for the leader's next
  plan; the interrupted step is rolled forward or replayed by the commit rule;
- any other error ends the worker with its traceback (engine/errors.py);
- a layer with no surviving copy makes every worker restore the newest checkpoint, say so in
  the log and TensorBoard, and continue from its step;
- at the end the rank-0 worker writes the final checkpoint's manifest and closes the job, and
  every worker exits 0; a drained node's workers exit 0 as soon as the plan leaves them out,
  after handing their layers over in the next generation's entry when the plan names the node
  a donor (so draining the last holder of a layer moves it rather than losing it).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .. import checkpoint as ckpt
from ..config import JobConfig
from ..planning import Plan
from . import memory, state
from ..models import build_layer_model
from .control import ControlPlane, LocalControl
from .data import build_dataset
from .devices import configure_nccl, resolve_device
from .errors import JobFailed, StepAbandoned, is_communication_error
from .metrics import Metrics
from .optim import lr_factor
from .runner import StepRunner, exit_now_at_the_end
from .trainer import LayersLost, Reconfiguration, StepResult, Trainer

log = logging.getLogger("oobleck_elastic.train")


@dataclass
class Summary:
    steps: int
    """Steps run in this process."""
    final_step: int
    """Steps completed in total."""
    first_loss: Optional[float]
    """Loss of the first step run here."""
    last_loss: Optional[float]
    """Loss of the last step."""
    seconds: float
    """Wall time of the training loop."""
    checkpoint: Optional[str]
    """Final checkpoint directory (on the worker that wrote its manifest)."""
    tensorboard: Optional[str]
    """TensorBoard log directory (on the writer)."""
    resumed_from: Optional[int]
    """Step of the checkpoint training resumed from."""
    reconfigurations: tuple[str, ...] = ()
    """One line per generation change this worker went through."""

    def lines(self) -> list[str]:
        out = [f"trained steps {self.final_step - self.steps}..{self.final_step} in {self.seconds:.1f}s"
               + (f" (resumed from step {self.resumed_from})" if self.resumed_from is not None else "")]
        if self.first_loss is not None:
            out.append(f"loss {self.first_loss:.4f} -> {self.last_loss:.4f}")
        out += [f"reconfiguration: {r}" for r in self.reconfigurations]
        if self.checkpoint:
            out.append(f"final checkpoint: {self.checkpoint}")
        if self.tensorboard:
            out.append(f"TensorBoard logs: {self.tensorboard}  (open with: tensorboard --logdir {self.tensorboard})")
        return out


def under_oobleck() -> bool:
    return all(k in os.environ for k in ("OOBLECK_RUN_ID", "OOBLECK_ETCD_ENDPOINT", "TORCHELASTIC_RUN_ID"))


def train(cfg: JobConfig, *, max_bytes: Optional[int] = None) -> Summary:
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(cfg.training.seed)
    dataset = build_dataset(cfg, log=log.info, max_bytes=max_bytes)
    if under_oobleck():
        from ..rendezvous.worker import WorkerContext

        worker = WorkerContext.from_env()
        try:
            return _train(cfg, dataset, worker)
        finally:
            worker.close()
    ctx = LocalControl(cfg, build_layer_model(cfg.model, seed=cfg.training.seed, owned=[]).num_layers)
    return _train(cfg, dataset, ctx)


class _Run:
    """Metrics, checkpoints and the summary of one process, across generations."""

    def __init__(self, cfg: JobConfig, *, node: str, rss_at_start: int) -> None:
        self.cfg, self.node = cfg, node
        self.tb_dir = str(Path(cfg.logging.tensorboard_dir) / cfg.name)
        self.metrics: Optional[Metrics] = None
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self.count = 0
        self.resumed: Optional[int] = None
        self.final_dir: Optional[Path] = None
        self.changes: list[str] = []
        self.t0 = time.monotonic()
        self.last_step_end: Optional[float] = None  # monotonic time this worker's last step completed
        self.pending: Optional[tuple[Reconfiguration, float, str, Optional[float]]] = None
        self.nodes_before: tuple[str, ...] = ()  # nodes of the generation this process was in
        self.broke_at: Optional[float] = None  # monotonic time this worker saw its generation break
        self.restored = False  # the last entry restored the checkpoint (lost layers)
        self.rss_at_start = rss_at_start  # before this worker held any layer

    def broke(self) -> None:
        """This worker saw its generation fail (a communication error or an abandoned step)."""
        if self.broke_at is None:
            self.broke_at = time.monotonic()

    def intact_checkpoint(self, trainer: Trainer) -> Optional[Path]:
        """The newest checkpoint whose every file verifies, found before anything is restored, so
        a resume is all or nothing. Newer unusable ones are named in the log and set aside (kept,
        never resumed from nor rewritten in place). Damaged ones and no intact one: an error
        naming the bad file, never "no checkpoint"."""
        path, unusable = ckpt.newest_intact_checkpoint(self.cfg.checkpoint.dir)
        for u in unusable:
            log.warning("gen %d node %s: checkpoint %s cannot be used: %s", trainer.generation, self.node,
                        u.path.name, u.reason)
        damaged = [u for u in unusable if u.damaged]
        if damaged and path is None:
            raise ckpt.CheckpointError(f"no intact checkpoint under {self.cfg.checkpoint.dir}: {damaged[0].reason}")
        for u in unusable:
            ckpt.set_aside(u.path, "corrupt" if u.damaged else "incomplete")
        if unusable and path is not None:
            log.warning("gen %d node %s: using checkpoint %s instead", trainer.generation, self.node, path.name)
        return path

    def resume(self, trainer: Trainer) -> int:
        latest = self.intact_checkpoint(trainer) if self.cfg.checkpoint.resume else None
        if latest is None:
            return 0
        self.resumed = state.restore(trainer, latest)
        log.info("gen %d step %d node %s: resumed from %s", trainer.generation, self.resumed, self.node, latest)
        return self.resumed

    def restore_lost(self, trainer: Trainer, err: LayersLost) -> int:
        latest = self.intact_checkpoint(trainer)
        if latest is None:
            raise RuntimeError(f"{err} and no checkpoint in {self.cfg.checkpoint.dir}: cannot continue without "
                               "training on re-initialised layers; set checkpoint.interval_steps") from err
        step = state.restore(trainer, latest)
        self.restored = True
        text = (f"generation {trainer.generation}: layers {err.layers} had no surviving copy; restored checkpoint "
                f"{latest} and continue from step {step}")
        log.warning("gen %d step %d node %s: %s", trainer.generation, step, self.node, text)
        self.changes.append(text)
        if self.metrics is not None:
            self.metrics.text("reconfiguration", text, step)
        return step

    def entered(self, trainer: Trainer, info: Optional[Reconfiguration]) -> None:
        writer = trainer.rank == 0
        if writer and self.metrics is None:
            t = self.cfg.training
            seq_len = trainer.dataset[0][0].shape[-1]
            self.metrics = Metrics(self.tb_dir, enabled=True, samples_per_step=t.global_batch_size,
                                   tokens_per_step=t.global_batch_size * seq_len, total_steps=t.steps,
                                   log_interval=self.cfg.logging.log_interval, node=self.node)
        elif not writer and self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        step = info.resume_step if info else (self.resumed or 0)
        if self.metrics is not None:
            self.metrics.plan(trainer.plan, step)
        nodes = trainer.plan.nodes if trainer.plan is not None else ()
        self._log_memory(trainer, step)
        if info is not None and info.previous > 0:
            self.pending = (info, time.monotonic(), self._cause(nodes), self.broke_at)
        self.nodes_before, self.broke_at, self.restored = nodes, None, False

    def _log_memory(self, trainer: Trainer, step: int) -> None:
        """This worker's memory on entering a generation: its peak so far (at the first entry:
        before its first step), what its layers hold, and its resident memory at start."""
        owned = trainer.owned
        layers = f"layers [{owned[0]}, {owned[-1] + 1})" if owned else "no layers"
        log.info("gen %d step %d node %s rank %d: memory on entering: %s; holds %s, %.3f GB of parameters and "
                 "optimizer state; resident at start %.3f GB", trainer.generation, step, self.node, trainer.rank,
                 memory.describe(memory.peak_rss_bytes(), memory.peak_device_bytes(trainer.device)), layers,
                 trainer.held_bytes() / memory.GB, self.rss_at_start / memory.GB)

    def _cause(self, nodes: tuple[str, ...]) -> str:
        """Why the generation changed, as seen here, with the nodes involved."""
        joined = [n for n in nodes if n not in self.nodes_before]
        left = [n for n in self.nodes_before if n not in nodes]
        kind = ("restore" if self.restored else "failure" if self.broke_at is not None
                else "join" if joined and not left else "drain" if left and not joined else "re-plan")
        who = " ".join([f"+{n}" for n in joined] + [f"-{n}" for n in left])
        return f"{kind}{': ' + who if who else ''}"

    def stepped(self, trainer: Trainer, result: StepResult, *, report: Optional[Callable[..., None]]) -> None:
        self.first = result.loss if self.first is None else self.first
        self.last = result.loss
        self.count += 1
        t = self.cfg.training
        now = time.monotonic()
        # the wall time since the previous step completed here: at a reconfiguration it includes
        # the broken step, the reconfiguration and the replay, so samples/s there says what it cost
        wall = now - self.last_step_end if self.last_step_end is not None else result.seconds
        self.last_step_end = now
        if self.metrics is not None:
            self.metrics.step(result, lr=t.optimizer.lr * lr_factor(result.step, t), plan=trainer.plan, wall_s=wall)
        if self.pending is not None:
            info, at, cause, broke_at = self.pending
            self.pending = None
            p = trainer.plan
            assert p is not None
            since_failure = (f"; {time.monotonic() - broke_at:.3f}s after the failure was seen here"
                             if broke_at is not None else "")
            text = (f"generation {info.previous} -> {info.generation} ({cause}): {len(p.nodes)} node(s), "
                    f"{len(p.pipelines)} pipeline(s); resumed at step {info.resume_step}"
                    f"{' (rolled forward)' if info.rolled_forward else ''}; {info.bytes_moved} layer bytes moved "
                    f"here in {info.seconds:.3f}s; first step done {time.monotonic() - at + info.seconds:.3f}s "
                    f"after entering{since_failure}"
                    + (f"; moved {'; '.join(m.describe() for m in info.moves)}" if info.moves else ""))
            self.changes.append(text)
            if self.metrics is not None:
                self.metrics.reconfiguration(text, info, step=result.step)
        if report is not None:
            report(generation=trainer.generation, step=result.step + 1, loss=result.loss)
        every = self.cfg.checkpoint.interval_steps
        if every and (result.step + 1) % every == 0 and result.step + 1 < t.steps:
            state.save(trainer, self.cfg.checkpoint.dir, next_step=result.step + 1)

    def finish(self, trainer: Trainer) -> None:
        if self.count or self.resumed is None:
            self.final_dir = state.save(trainer, self.cfg.checkpoint.dir, next_step=self.cfg.training.steps)

    def summary(self) -> Summary:
        writer = self.metrics is not None
        return Summary(steps=self.count, final_step=self.cfg.training.steps, first_loss=self.first,
                       last_loss=self.last, seconds=time.monotonic() - self.t0,
                       checkpoint=str(self.final_dir) if self.final_dir and writer else None,
                       tensorboard=self.tb_dir if writer else None, resumed_from=self.resumed,
                       reconfigurations=tuple(self.changes))

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()


def _next_plan(ctx: ControlPlane, *, at_least: int, exact: bool) -> Optional[Plan]:
    """Wait for the plan to enter: generation `at_least` exactly (from the history, when every
    worker agreed on it), or the newest one >= at_least that gives this worker a stage, or names
    its node a donor. None when this worker must leave (job closed, node drained)."""
    while True:
        latest = ctx.plan()
        plan = ctx.plan_at(at_least) if exact else latest
        donor = plan is not None and plan.donor_rank(ctx.node_id, ctx.local_rank) is not None
        if donor and plan.generation >= at_least and ctx.should_leave(None) is None:
            return plan  # drained: hand the layers over in this generation's entry, then leave
        if ctx.should_leave(latest):
            return None
        if plan is not None and plan.generation >= at_least and ctx.my_stage(plan) is not None:
            return plan
        if exact and plan is not None:  # no stage in the agreed generation (spare): wait for a later one
            exact, at_least = False, plan.generation + 1
        time.sleep(0.05)


def _describe(err: BaseException) -> str:
    first = str(err).splitlines()[0][:160] if str(err) else ""
    return f"{type(err).__name__}: {first}"


def _record_fatal(ctx: ControlPlane, cfg: JobConfig, err: BaseException, *, step: int, generation: int) -> None:
    """Log and store an error that ends this worker; close the job as failed when the same error
    has now ended workers at this step in `max_repeated_errors` generations in a row."""
    limit = cfg.fault_tolerance.max_repeated_errors
    try:
        rec = ctx.record_error(err, step=step, generation=generation)
    except Exception as etcd_err:  # noqa: BLE001 - never hide the original error behind this one
        log.error("gen %d step %d node %s: could not record the error in etcd: %s", generation, step, ctx.node_id,
                  _describe(etcd_err))
        return
    log.error("gen %d step %d node %s: %s ends this worker (%d of %d in a row at this step; not a communication "
              "failure)", generation, step, ctx.node_id, rec.error, rec.count, limit)
    if rec.count >= limit:
        reason = (f"{rec.error} ended a worker at step {step} in {rec.count} generations in a row "
                  f"(fault_tolerance.max_repeated_errors={limit})")
        log.error("gen %d step %d node %s: closing the job as failed: %s", generation, step, ctx.node_id, reason)
        ctx.close_job(reason, failed=True)


def _train(cfg: JobConfig, dataset: Any, ctx: ControlPlane) -> Summary:
    """The one training loop of a worker (see the module docstring) or of the single process."""
    device = resolve_device(cfg.training.device, ctx.local_rank)
    if device.type == "cuda":
        nccl, replaced = configure_nccl()
        for message in replaced:
            log.warning("node %s: %s", ctx.node_id, message)
        log.info("node %s: worker %d on %s; NCCL settings %s", ctx.node_id, ctx.local_rank, device, nccl)
    rss_at_start = memory.current_rss_bytes()
    trainer = Trainer(cfg, dataset=dataset, node=ctx.node_id, local_rank=ctx.local_rank, device=device)
    ctx.share_profile(cfg, trainer.device)
    ctx.report_ready()
    steps = cfg.training.steps
    ft = cfg.fault_tolerance
    target, exact = 1, False
    step = 0
    plan: Optional[Plan] = None
    run = _Run(cfg, node=ctx.node_id, rss_at_start=rss_at_start)
    runner = StepRunner(trainer.device)
    try:
        while True:
            plan = _next_plan(ctx, at_least=target, exact=exact)
            if plan is None:
                failed = ctx.failure_of_job()
                if failed is not None:
                    raise JobFailed(f"the job was closed as failed: {failed}")
                log.info("node %s: leaving the job (%s)", ctx.node_id, ctx.should_leave(ctx.plan()))
                return run.summary()
            info: Optional[Reconfiguration] = None
            failure: Optional[str] = None
            try:
                try:
                    info = trainer.enter_generation(plan, ctx.store_for(plan.generation, cfg), load_plan=ctx.plan_at)
                    step = info.resume_step
                    if info.previous == 0 and step == 0:
                        step = run.resume(trainer)
                except LayersLost as err:
                    step = run.restore_lost(trainer, err)
            except Exception as err:
                if not is_communication_error(err):
                    raise
                failure = _describe(err)
            if info is not None and info.donor:
                exit_now_at_the_end("donor")
                log.info("node %s: leaving the job (node %s was drained; its layers were handed over to generation "
                         "%d)", ctx.node_id, ctx.node_id, plan.generation)
                return run.summary()
            if failure is not None and ctx.my_stage(plan) is None:  # a donor: the others re-plan without it
                trainer.abort()
                log.warning("gen %d node %s: handing layers over to generation %d failed (%s); leaving the job "
                            "(node drained)", trainer.generation, ctx.node_id, plan.generation, failure)
                return run.summary()
            if failure is not None:  # outside the except block: see Trainer.abort
                run.broke()
                trainer.abort()
                ctx.report_failure(plan.generation)
                log.warning("gen %d node %s: entering generation %d failed (%s); waiting for a newer plan",
                            trainer.generation, ctx.node_id, plan.generation, failure)
                target, exact = plan.generation + 1, False  # the roll call always ends in a newer plan
                continue
            ctx.entered(plan.generation)
            run.entered(trainer, info)
            result = None
            abandoned = False
            should_abandon = ctx.abandon_check(plan)
            try:
                while step < steps:
                    latest = ctx.plan() if trainer.rank == 0 else None
                    seen = latest.generation if latest else 0
                    result = runner.run(lambda s=step, g=seen: trainer.train_step(s, seen_generation=g),
                                        should_abandon=should_abandon, interval_s=ft.watch_interval_s)
                    run.stepped(trainer, result, report=ctx.report_progress if trainer.rank == 0 else None)
                    step += 1
                    if result.next_generation > trainer.generation:
                        break
            except Exception as err:
                if not is_communication_error(err):
                    raise
                failure, abandoned = _describe(err), isinstance(err, StepAbandoned)
            if failure is not None:
                run.broke()
                trainer.abort(abandoned=abandoned)
                if abandoned:  # the leader has acted already: no roll call needed
                    log.warning("gen %d step %d node %s: step abandoned (%s); entering the next generation",
                                trainer.generation, step, ctx.node_id, failure)
                else:
                    ctx.report_failure(trainer.generation)
                    log.warning("gen %d step %d node %s: communication failed (%s); waiting for the next plan",
                                trainer.generation, step, ctx.node_id, failure)
                target, exact = trainer.generation + 1, False
                continue
            if step >= steps:
                run.finish(trainer)
                if trainer.rank == 0:
                    ctx.close_job(f"finished {steps} steps")
                return run.summary()
            assert result is not None
            target, exact = result.next_generation, True
    except Exception as err:
        if not isinstance(err, JobFailed):
            _record_fatal(ctx, cfg, err, step=step, generation=plan.generation if plan is not None else 0)
        raise
    finally:
        runner.close()
        run.close()
        trainer.close()
