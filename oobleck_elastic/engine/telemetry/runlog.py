"""What a worker tells about its run: progress, reconfigurations, memory, and the final summary.

`RunLog` follows one worker across generations. The worker holding rank 0 of the current
generation writes TensorBoard (engine/telemetry/metrics.py); every worker logs its own entries. A
generation change is described once its first step is done, so the line can say how long the
whole change took as this worker saw it: from the failure it noticed (a broken collective or an
abandoned step) to the first step of the new generation, with its cause (failure, join, drain,
restore or re-plan, and the nodes that came and went) and the layers that moved, node to node.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from ...config import JobConfig
from ...logs import JobLog
from . import board, memory
from .metrics import Metrics
from ..stage.compiled import graphs_compiled
from .mfu import device_peak_tflops, flops_per_token
from ..step.optim import lr_factor
from ..entry.enter import Reconfiguration
from ..step.result import StepResult

if TYPE_CHECKING:  # the trainer is handed in; the loop at the engine's root builds on telemetry
    from ..trainer import Trainer

log = JobLog(logging.getLogger("oobleck_elastic.train"))


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
    """The job's TensorBoard run directory, `<tensorboard_dir>/<run id>/<start>` (on the writer)."""
    resumed_from: Optional[int]
    """Step of the checkpoint training resumed from."""
    reconfigurations: tuple[str, ...] = ()
    """One line per generation change this worker went through."""
    peak_rss_bytes: int = 0
    """This process's peak resident memory."""
    not_applied: tuple[str, ...] = ()
    """One line per step the step guard did not apply (replayed or skipped, engine/resilience/guard.py)."""
    repairs: tuple[str, ...] = ()
    """One line per corrupt layer copy replaced from its holders' majority (engine/resilience/fingerprint.py)."""
    stopped: Optional[str] = None
    """Why the job stopped before `training.steps` (it was asked to); None when it ran them all."""

    def lines(self) -> list[str]:
        out = [
            f"trained steps {self.final_step - self.steps}..{self.final_step} in {self.seconds:.1f}s"
            + (f" (resumed from step {self.resumed_from})" if self.resumed_from is not None else "")
        ]
        if self.first_loss is not None:
            out.append(f"loss {self.first_loss:.4f} -> {self.last_loss:.4f}")
        if self.stopped is not None:
            out.append(f"stopped before training.steps: {self.stopped}")
        out += [f"reconfiguration: {r}" for r in self.reconfigurations]
        out += [f"not applied: {r}" for r in self.not_applied]
        out += [f"repaired: {r}" for r in self.repairs]
        if self.peak_rss_bytes:
            out.append(f"peak resident memory of this worker: {self.peak_rss_bytes / memory.GB:.3f} GB")
        if self.checkpoint:
            out.append(f"final checkpoint: {self.checkpoint}")
        if self.tensorboard:
            out.append(
                f"TensorBoard logs: {self.tensorboard}  "
                f"(open with: tensorboard --logdir {Path(self.tensorboard).parent.parent}; one run per start)"
            )
        return out


class RunLog:
    """Metrics, reconfiguration lines and the summary of one worker (module docstring)."""

    def __init__(
        self,
        cfg: JobConfig,
        *,
        node: str,
        rss_at_start: int,
        run_id: Optional[str] = None,
        claim_run: Callable[[str], str] = lambda proposed: proposed,
    ) -> None:
        self.cfg, self.node = cfg, node
        self.run_id = run_id or cfg.name  # the job's --rdzv-id; `name` for the single process
        self.claim_run = claim_run  # the control plane's `tensorboard_run` (board.py)
        self.tb_run: Optional[str] = None  # the job's TensorBoard run, once this worker has written
        self.metrics: Optional[Metrics] = None
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self.count = 0
        self.changes: list[str] = []
        self.t0 = time.monotonic()
        self.last_step_end: Optional[float] = None  # monotonic time this worker's last step completed
        self.pending: Optional[tuple[Reconfiguration, float, str, Optional[float]]] = None
        self.nodes_before: tuple[str, ...] = ()  # nodes of the generation this process was in
        self.broke_at: Optional[float] = None  # monotonic time this worker saw its generation break
        self.restored = False  # the last entry restored the checkpoint (lost layers)
        self.rss_at_start = rss_at_start  # before this worker held any layer
        self.not_applied: list[str] = []  # steps the step guard rejected, with what followed
        self.repairs: list[str] = []  # corrupt layer copies replaced (engine/resilience/fingerprint.py)

    def broke(self) -> None:
        """This worker saw its generation fail (a communication error or an abandoned step)."""
        if self.broke_at is None:
            self.broke_at = time.monotonic()

    def restored_checkpoint(self, text: str, step: int) -> None:
        """The entry found layers with no surviving copy and every worker restored a checkpoint."""
        self.restored = True
        self.changes.append(text)
        if self.metrics is not None:
            self.metrics.text("reconfiguration", text, step)

    def entered(self, trainer: Trainer, info: Optional[Reconfiguration], step: int) -> None:
        """This worker entered `trainer.generation` and goes on at `step`."""
        writer = trainer.rank == 0
        if writer and self.metrics is None:
            t = self.cfg.training
            seq_len = trainer.dataset[0][0].shape[-1]
            self.metrics = Metrics(
                self._tb_dir(trainer.generation, step),
                enabled=True,
                samples_per_step=t.global_batch_size,
                tokens_per_step=t.global_batch_size * seq_len,
                total_steps=t.steps,
                log_interval=self.cfg.logging.log_interval,
                node=self.node,
                flops_per_token=flops_per_token(self.cfg, seq_len),
                peak_tflops=device_peak_tflops(trainer.device, t.precision, t.peak_tflops),
                paced=t.paced_devices,
            )
        elif not writer and self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.metrics is not None:
            self.metrics.plan(trainer.plan, step)
        nodes = trainer.plan.nodes if trainer.plan is not None else ()
        self._log_memory(trainer, step)
        if trainer.compile:  # a survivor of a reconfiguration must show no new graph here
            log.at(gen=trainer.generation, step=step, node=self.node, rank=trainer.rank).info(
                "compiled graphs so far: %d", graphs_compiled()
            )
        if info is not None and info.previous > 0:
            cause = "rebalance" if trainer.plan is not None and trainer.plan.rebalanced else self._cause(nodes)
            self.pending = (info, time.monotonic(), cause, self.broke_at)
        self.nodes_before, self.broke_at, self.restored = nodes, None, False

    @property
    def tb_dir(self) -> Optional[str]:
        """The job's TensorBoard run directory, once this worker has written to it."""
        return str(Path(self.cfg.logging.tensorboard_dir) / self.tb_run) if self.tb_run is not None else None

    def _tb_dir(self, generation: int, step: int) -> str:
        """The job's run directory (board.py): proposed by this worker when it is the job's first
        writer, else the one the first writer chose (etcd); this worker's proposal when etcd fails."""
        if self.tb_run is None:
            root = Path(self.cfg.logging.tensorboard_dir)
            proposed = board.run_name(self.run_id, taken=lambda name: (root / name).exists())
            try:
                self.tb_run = self.claim_run(proposed)
            except Exception as err:  # noqa: BLE001 - TensorBoard is informative; training goes on
                log.at(gen=generation, step=step, node=self.node).warning(
                    "could not agree on the job's TensorBoard run (%s); writing to %s", err, proposed
                )
                self.tb_run = proposed
        tb_dir = self.tb_dir
        assert tb_dir is not None
        return tb_dir

    def _log_memory(self, trainer: Trainer, step: int) -> None:
        """This worker's memory on entering a generation: its peak so far (at the first entry:
        before its first step), what its layers hold, and its resident memory at start."""
        owned = trainer.owned
        layers = f"layers [{owned[0]}, {owned[-1] + 1})" if owned else "no layers"
        log.at(gen=trainer.generation, step=step, node=self.node, rank=trainer.rank).info(
            "memory on entering: %s; holds %s, %.3f GB of parameters and optimizer state; resident at start %.3f GB",
            memory.describe(memory.peak_rss_bytes(), memory.peak_device_bytes(trainer.device)),
            layers,
            trainer.state.held_bytes() / memory.GB,
            self.rss_at_start / memory.GB,
        )

    def _cause(self, nodes: tuple[str, ...]) -> str:
        """Why the generation changed, as seen here, with the nodes involved."""
        joined = [n for n in nodes if n not in self.nodes_before]
        left = [n for n in self.nodes_before if n not in nodes]
        kind = (
            "restore"
            if self.restored
            else "failure"
            if self.broke_at is not None
            else "join"
            if joined and not left
            else "drain"
            if left and not joined
            else "re-plan"
        )
        who = " ".join([f"+{n}" for n in joined] + [f"-{n}" for n in left])
        return f"{kind}{': ' + who if who else ''}"

    def stepped(self, trainer: Trainer, result: StepResult, *, report: Optional[Callable[..., None]]) -> None:
        """Step `result.step` is done: metrics, progress, and the pending reconfiguration line."""
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
            link = trainer.shadow_link
            shadows = board.ShadowFigures.of(
                result.step,
                trainer.plan,
                trainer.state.shadows,
                traffic_bytes=link.bytes_per_step if link is not None else 0,
                seconds=result.shadow_s,
            )
            if shadows is not None:
                self.metrics.shadows(shadows, result.step)
        if self.pending is not None:
            self._describe_reconfiguration(trainer, result)
        if report is not None:
            report(generation=trainer.generation, step=result.step + 1, loss=result.loss)

    def rejected(self, result: StepResult, *, skipped: bool) -> None:
        """The step guard did not apply `result.step`: it is replayed, or its batch skipped."""
        text = f"step {result.step + 1}: {result.rejected}; {'batch skipped' if skipped else 'replayed'}"
        self.not_applied.append(text)
        if self.metrics is not None:
            self.metrics.rejected(result.step, text, skipped=skipped)

    def stragglers(self, named: dict[str, float], step: int) -> None:
        """The nodes named stragglers now (engine/resilience/straggler.py), for TensorBoard."""
        if self.metrics is not None:
            self.metrics.stragglers(named, step)

    def repaired(self, text: str, step: int, *, generation: int) -> None:
        """A corrupt copy of a layer was replaced from its holders' majority (engine/resilience/fingerprint.py)."""
        self.repairs.append(text)
        log.at(gen=generation, step=step + 1, node=self.node).warning("%s", text, event="repaired")
        if self.metrics is not None:
            self.metrics.repaired(text, step, total=len(self.repairs))

    def _describe_reconfiguration(self, trainer: Trainer, result: StepResult) -> None:
        assert self.pending is not None and trainer.plan is not None
        info, at, cause, broke_at = self.pending
        self.pending = None
        p = trainer.plan
        since_failure = (
            f"; {time.monotonic() - broke_at:.3f}s after the failure was seen here" if broke_at is not None else ""
        )
        text = (
            f"generation {info.previous} -> {info.generation} ({cause}): {len(p.nodes)} node(s), "
            f"{len(p.pipelines)} pipeline(s); resumed at step {info.resume_step}"
            f"{' (rolled forward)' if info.rolled_forward else ''}; {info.bytes_moved} layer bytes moved "
            f"here in {info.seconds:.3f}s; first step done {time.monotonic() - at + info.seconds:.3f}s "
            f"after entering{since_failure}"
            + (f"; moved {'; '.join(m.describe() for m in info.moves)}" if info.moves else "")
            + (f"; layers {list(info.from_shadows)} from their shadow copies" if info.from_shadows else "")
            + (f"; {info.sources.describe()}" if info.sources is not None else "")
        )
        self.changes.append(text)
        if self.metrics is not None:
            figures = board.JobFigures.of(info.moves, result.entry_window)
            self.metrics.reconfiguration(text, info, step=result.step, figures=figures)

    def summary(
        self,
        *,
        checkpoint: Optional[Path],
        resumed: Optional[int],
        stopped: Optional[tuple[int, str]] = None,
    ) -> Summary:
        """`stopped`: (the step, why) when the job was asked to stop before `training.steps`."""
        writer = self.metrics is not None
        return Summary(
            steps=self.count,
            final_step=self.cfg.training.steps if stopped is None else stopped[0],
            stopped=stopped[1] if stopped is not None else None,
            first_loss=self.first,
            last_loss=self.last,
            seconds=time.monotonic() - self.t0,
            checkpoint=str(checkpoint) if checkpoint and writer else None,
            tensorboard=self.tb_dir if writer else None,
            resumed_from=resumed,
            reconfigurations=tuple(self.changes),
            peak_rss_bytes=memory.peak_rss_bytes(),
            not_applied=tuple(self.not_applied),
            repairs=tuple(self.repairs),
        )

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
