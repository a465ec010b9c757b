"""The training loop behind `examples/train.py`.

`train(cfg)` runs in one process when started with plain `python` (the reference run), or as
one worker of a job when started under `torchrun --rdzv-backend=oobleck` (the handler put
`OOBLECK_RUN_ID` and the etcd settings in the environment). A worker waits for a plan that gives
it a stage, joins the generation's process groups on an etcd-backed store (keys under
`store/g<generation>/`, so the store survives any node), resumes from the newest checkpoint when
there is one (under any plan), trains, reports progress to etcd, and at the end the rank-0
worker writes the final checkpoint's manifest and closes the job so every worker and agent
exits 0. Workers of spare nodes wait until the job is closed.

Reacting to plan changes while training (failures, joins, drains) is the next step
(reconfiguration); here a worker keeps the plan it started with.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from .. import checkpoint as ckpt
from ..config import JobConfig
from ..planning import Plan
from . import state
from .data import build_dataset
from .metrics import Metrics
from .optim import lr_factor
from .trainer import Trainer

log = logging.getLogger("oobleck_elastic.train")


@dataclass
class Summary:
    steps: int
    """Steps run in this process (from the resume point)."""
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

    def lines(self) -> list[str]:
        out = [f"trained steps {self.final_step - self.steps}..{self.final_step} in {self.seconds:.1f}s"
               + (f" (resumed from step {self.resumed_from})" if self.resumed_from is not None else "")]
        if self.first_loss is not None:
            out.append(f"loss {self.first_loss:.4f} -> {self.last_loss:.4f}")
        if self.checkpoint:
            out.append(f"final checkpoint: {self.checkpoint}")
        if self.tensorboard:
            out.append(f"TensorBoard logs: {self.tensorboard}  (open with: tensorboard --logdir {self.tensorboard})")
        return out


def under_oobleck() -> bool:
    return "OOBLECK_RUN_ID" in os.environ and "OOBLECK_ETCD_ENDPOINT" in os.environ


def train(cfg: JobConfig, *, max_bytes: Optional[int] = None) -> Summary:
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(cfg.training.seed)
    dataset = build_dataset(cfg, log=log.info, max_bytes=max_bytes)
    if under_oobleck():
        return _train_worker(cfg, dataset)
    trainer = Trainer(cfg, dataset=dataset)
    return _loop(cfg, trainer, plan=None, writer=True, node="local", report=None)


def _wait_for_stage(ctx: Any) -> tuple[Optional[Plan], Optional[int]]:
    while True:
        plan = ctx.plan()
        if ctx.should_leave(plan):
            return None, None
        if plan is not None:
            mine = ctx.my_stage(plan)
            if mine is not None:
                return plan, mine[1].rank
        time.sleep(0.1)


def _train_worker(cfg: JobConfig, dataset: Any) -> Summary:
    from ..etcd.store import EtcdStore
    from ..rendezvous.worker import WorkerContext

    ctx = WorkerContext.from_env()
    plan, rank = _wait_for_stage(ctx)
    if plan is None or rank is None:
        log.info("node %s: no stage in this job; exiting", ctx.node_id)
        return Summary(0, 0, None, None, 0.0, None, None, None)
    store = EtcdStore(ctx.client, prefix=ctx.keys.store(plan.generation))
    trainer = Trainer(cfg, dataset=dataset, plan=plan, rank=rank, store=store, node=ctx.node_id)

    def report(step: int, loss: float) -> None:
        ctx.report_progress(generation=plan.generation, step=step, loss=loss)

    try:
        summary = _loop(cfg, trainer, plan=plan, writer=rank == 0, node=ctx.node_id,
                        report=report if rank == 0 else None)
        if rank == 0:
            ctx.close_job(f"finished {summary.final_step} steps")
        return summary
    finally:
        trainer.close()


def _loop(cfg: JobConfig, trainer: Trainer, *, plan: Optional[Plan], writer: bool, node: str,
          report: Any) -> Summary:
    t = cfg.training
    start, resumed = 0, None
    latest = ckpt.latest_checkpoint(cfg.checkpoint.dir) if cfg.checkpoint.resume else None
    if latest is not None:
        start = resumed = state.restore(trainer, latest)
        log.info("gen %d step %d node %s: resumed from %s", trainer.generation, start, node, latest)
    tb_dir = str(Path(cfg.logging.tensorboard_dir) / cfg.name)
    seq_len = trainer.dataset[0][0].shape[-1]
    metrics = Metrics(tb_dir, enabled=writer, samples_per_step=t.global_batch_size,
                      tokens_per_step=t.global_batch_size * seq_len, total_steps=t.steps,
                      log_interval=cfg.logging.log_interval, node=node)
    metrics.plan(plan, start)
    first = last = None
    final_dir = None
    t0 = time.monotonic()
    try:
        for step in range(start, t.steps):
            result = trainer.train_step(step)
            first = result.loss if first is None else first
            last = result.loss
            metrics.step(result, lr=t.optimizer.lr * lr_factor(step, t), plan=plan)
            if report is not None:
                report(step + 1, result.loss)
            every = cfg.checkpoint.interval_steps
            if every and (step + 1) % every == 0 and step + 1 < t.steps:
                state.save(trainer, cfg.checkpoint.dir, next_step=step + 1)
        if t.steps > start or latest is None:
            final_dir = state.save(trainer, cfg.checkpoint.dir, next_step=t.steps)
    finally:
        metrics.close()
    return Summary(steps=t.steps - start, final_step=t.steps, first_loss=first, last_loss=last,
                   seconds=time.monotonic() - t0, checkpoint=str(final_dir) if final_dir and writer else None,
                   tensorboard=tb_dir if writer else None, resumed_from=resumed)
