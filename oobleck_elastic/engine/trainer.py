"""The trainer: one worker's part of a plan, through every generation it enters.

A `Trainer` starts holding no layer; `enter_generation` (engine/entry/enter.py) installs exactly
its stage's layers as a new `WorkerState` and builds the stage (engine/stage/build.py). A step
(`train_step`) runs the stage's schedule on its share of the global batch, sums the gradients
(engine/step/grad_sync.py), commits (engine/step/commit.py, where the commit protocol is told),
and applies or drops the step as the step guard says (engine/step/apply.py). The single-process
reference is a trainer that entered the one-worker plan (engine/reference.py). Invariant: the
same weights as one process after any number of steps and reconfigurations (docs/design.md,
docs/training.md).
"""

from __future__ import annotations

import gc
import logging
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..config import JobConfig
from ..config.timing import comm_timeout, due_comm_timeout
from ..data.sampler import BatchPrefetcher, pipeline_slices
from ..logs import JobLog
from ..models import LayerModel, build_layer_model
from ..planning import Plan
from .checkpoint_state import CheckpointState
from .entry.devices import group_errors, release_groups
from .entry.enter import GenerationEntry, LayersLost, Reconfiguration
from .entry.groups import GenerationGroups, set_timeout
from .resilience import nccl_rules
from .resilience.faults import FaultInjector
from .step.collectives import Collective, control_group, step_collectives
from .resilience.fingerprint import Corrupt, Unrepairable, check_replicas, layer_tensors
from .resilience.guard import judge
from .resilience.progress import STEP_PROGRESS
from .resilience.straggler import ComputeClock
from .runner import abandoned_threads
from .stage.build import build_stage
from .stage.compiled import compile_enabled, use_cache_dir, warm_up
from .stage.paced import Pacer, pin_threads
from .step.apply import StepApplier
from .step.commit import CommitVote, commit, own_slot, refuse_errored
from .step.forward_backward import forward_backward
from .step.grad_sync import GradSync, synchronise
from .step.optim import token_sum_loss
from .step.result import StepResult
from .step.shadows import ShadowLink
from .step.state import WorkerState
from .telemetry import memory
from .telemetry.samples import SampleLedger

__all__ = ["Trainer", "StepResult", "LayersLost", "Reconfiguration", "WorkerState"]

log = JobLog(logging.getLogger(__name__))


class Trainer:
    """One worker's part of a plan (module docstring)."""

    def __init__(
        self,
        cfg: JobConfig,
        *,
        dataset: Any,
        plan: Optional[Plan] = None,
        rank: int = 0,
        store: Optional[dist.Store] = None,
        timeout: Optional[timedelta] = None,
        device: str | torch.device = "cpu",
        node: str = "local",
        local_rank: int = 0,
    ) -> None:
        """A worker holding no layer yet; with `plan` (and the `store` of its process groups) it
        enters that plan as global rank `rank` at once."""
        from ..data.sampler import GlobalBatchSampler

        self.cfg, self.dataset, self.node = cfg, dataset, node
        self.device = torch.device(device)
        nccl_rules.install()  # OOBLECK_NCCL_RULES=1: check NCCL's rules on any backend (docs/nccl.md)
        t = cfg.training
        self.sampler = GlobalBatchSampler(len(dataset), t.global_batch_size, t.seed)
        seq_len = dataset[0][0].shape[-1]
        self.dtype = torch.bfloat16 if t.precision == "bf16" else None
        self.timeout = timeout or timedelta(seconds=comm_timeout(cfg.fault_tolerance))
        self._derive_timeout = timeout is None
        """The timeout follows the measured steps (`derive_timeout`, config/timing.py)."""
        self.timeout_basis_s = 0.0
        """The typical step the derived timeout rests on (0: none measured)."""
        self.progress = STEP_PROGRESS
        """What the step thread tells the main thread (engine/resilience/progress.py)."""
        self.progress.p2p_timeout = self.timeout if self.device.type == "cpu" else None
        self.progress.track_posted = self.device.type == "cuda"  # NCCL's waits return before the work ends
        self.lane = 0  # this worker's tensor-parallel lane in its stage
        self.state = WorkerState(layer_model=build_layer_model(cfg.model, seed=t.seed, owned=[], device=device))
        """What this worker holds across generations (layers, optimizer, steps): only its stage's."""
        self.checkpoint_state = CheckpointState(cfg, lambda: self.state)
        """`state` as checkpoints read and write it (`state_dict`, `load_state_dict`: engine/checkpoint_state.py)."""
        self.loss_fn = token_sum_loss(
            t.global_batch_size * seq_len, lean_bf16=t.precision == "bf16", vocab_size=self.state.layer_model.vocab_size
        )
        self.groups: Optional[GenerationGroups] = None
        self.grad_sync: Optional[GradSync] = None
        self.shadow_link: Optional[ShadowLink] = None
        """This worker's per-step traffic to the shadow copies (engine/step/shadows.py)."""
        self.shadow_s = 0.0
        """Seconds the last step spent on the shadow exchange (`StepResult.shadow_s`)."""
        self.schedule: Any = None
        self.holds_first_last = (True, True)
        """Whether this worker's stages include the pipeline's first and its last (zbv: both on device 0)."""
        self.stage_module: Optional[nn.Module] = None
        self.step_group: Optional[dist.ProcessGroup] = None
        """The generation's control group of its stages (engine/step/collectives.py): a step's, a
        retake's and a checkpoint's collectives, and nothing else (None: no generation entered)."""
        self.applier = StepApplier(cfg)
        """A step's writes to `state`, only while it is current (engine/step/apply.py: a step may run in
        another thread that the control plane can abandon)."""
        self.faults = FaultInjector.from_env()
        self._step = 0  # the step running now (for injected slowdowns)
        self.entry_window = (0.0, 0.0)  # Unix times this worker began and finished entering its generation
        pin_threads(t.paced_devices, self.device)  # before the clock reads the thread count (engine/stage/paced.py)
        self.pacer: Optional[Pacer] = None  # pads a pipeline stage's passes (training.paced_devices)
        self.clock = ComputeClock(self.device, slowdown=lambda: self.faults.slowdown(node=self.node, step=self._step))
        """Times this worker's compute in a step (engine/resilience/straggler.py)."""
        if not self.clock.measures and cfg.fault_tolerance.straggler_factor > 0:
            log.at(node=node).info(
                "this worker's compute time is not compared with the others' (no straggler is named): on "
                "the CPU that needs one intra-op thread per worker (OMP_NUM_THREADS=1; torch has %d)",
                torch.get_num_threads(),
            )
        self.batches = BatchPrefetcher(dataset, self.my_samples, pin_memory=self.device.type == "cuda")
        """Collates (and pins, on CUDA) the next step's batch while a step runs."""
        self.samples = SampleLedger(cfg, self.sampler, node)
        """This worker's sample ledger records (engine/telemetry/samples.py)."""
        self.compile = compile_enabled(cfg, self.device)
        """Layers run compiled (engine/stage/compiled.py)."""
        self.warmed = False
        """Every kind of layer has been compiled (`warm_up`)."""
        if self.compile:
            use_cache_dir(cfg)
        identity = (node, local_rank)
        if plan is not None:  # enter it now (tests and benchmarks); a job's loop enters plans itself
            placed = plan.stage_of(rank)[1]
            identity = (placed.node, placed.local_rank + rank - placed.rank)
        self.entry = GenerationEntry(
            cfg,
            device=self.device,
            identity=identity,
            timeout=self.timeout,
            join_timeout=timedelta(seconds=cfg.fault_tolerance.join_timeout_s),
        )
        if plan is not None:
            self.enter_generation(plan, store)

    # ------------------------------------------------------------------ the state, read-only
    @property
    def plan(self) -> Optional[Plan]:
        return self.state.plan

    @property
    def generation(self) -> int:
        return self.state.generation

    @property
    def rank(self) -> int:
        return self.state.rank

    @property
    def owned(self) -> list[int]:
        return self.state.owned

    @property
    def layer_model(self) -> LayerModel:
        return self.state.layer_model

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        return self.state.optimizer

    @property
    def params(self) -> list[nn.Parameter]:
        return self.state.params

    @property
    def committed_step(self) -> int:
        return self.state.committed_step

    def warm_up(self, microbatch_size: int) -> float:
        """Compile every kind of layer for `microbatch_size` (engine/stage/compiled.py), once; the seconds
        it took (0 when compilation is off or it was done already)."""
        if not self.compile or self.warmed:
            return 0.0
        self.warmed = True
        return warm_up(
            self.cfg,
            device=self.device,
            microbatch_size=microbatch_size,
            seq_len=self.dataset[0][0].shape[-1],
            autocast=self.dtype,
            node=self.node,
        )

    def derive_timeout(self, typical_step_s: float, *, running: bool = False) -> Optional[float]:
        """The collectives' timeout from this worker's typical step (config/timing.py), unless one
        was given: before entering a generation, or between the steps of the running one when it
        is due (`running`, `due_comm_timeout`), applied then to every group of the generation at
        once; the new seconds when they changed, else None."""
        if not self._derive_timeout:
            return None
        ft, basis = self.cfg.fault_tolerance, self.timeout_basis_s
        due = due_comm_timeout(ft, basis, typical_step_s) if running else comm_timeout(ft, typical_step_s)
        if due is None:
            return None
        self.timeout_basis_s = typical_step_s
        if due == self.timeout.total_seconds():
            return None
        self.timeout = self.entry.timeout = timedelta(seconds=due)
        self.progress.p2p_timeout = self.timeout if self.device.type == "cpu" else None
        if running and self.groups is not None:
            shadow = self.shadow_link.group if self.shadow_link is not None else None
            set_timeout(self.timeout, [*self.groups.mine(), self.step_group, shadow])
        return due

    # ------------------------------------------------------------------ entering a generation
    def enter_generation(
        self, plan: Plan, store: Optional[dist.Store], *, load_plan: Callable[[int], Optional[Plan]] = lambda g: None
    ) -> Reconfiguration:
        """Enter `plan`'s generation (engine/entry/enter.py) and build the stage's schedule. Raises
        LayersLost, with the new stage installed, when a layer has no surviving copy (the caller
        restores the newest checkpoint)."""
        self._drop_groups()  # the previous generation's: its groups are destroyed by the entry
        began = time.time()
        installed = self.entry.enter(
            self.state,
            plan,
            store,
            roll_forward=self._roll_forward,
            detach_kept=self.applier.detach_kept,
            load_plan=load_plan,
        )
        self.state, self.applier.detach_kept = installed.state, False
        if installed.groups is None:  # a donor: it holds nothing now and leaves
            gc.collect()
            return installed.info
        self.groups = installed.groups
        self._build_pipeline(plan, installed.control)
        self.entry_window = (began, time.time())  # voted at every step (engine/telemetry/board.py)
        if installed.lost:
            raise LayersLost(list(installed.lost))
        return installed.info

    def reseed_shadows(self) -> int:
        """Seed every shadow copy this worker keeps again from the layers' holders (after a
        checkpoint restore; engine/step/shadows.py). Collective over the generation's
        stages; the bytes this worker sent plus received."""
        if self.plan is None or self.state.shadows is None:
            return 0
        self.state.shadows, moved = self.entry.seed_shadows(self.state, self.plan, self.rank, None, {})
        return moved

    def _drop_groups(self) -> None:
        """Forget this generation's stage, schedule and process groups (a gloo group closes its
        sockets only when the last reference to it goes)."""
        if self.grad_sync is not None:
            self.grad_sync.close()  # its hooks must never post on the groups dropped here
        self.stage_module = None
        self.schedule = None
        self.grad_sync = None
        self.shadow_link = None
        self.groups = None
        self.step_group = None

    def _build_pipeline(self, plan: Plan, control: Optional[dist.ProcessGroup]) -> None:
        """The generation's step group, gradient sync and shadow link, then this worker's stage
        (engine/stage/build.py). `control`: the entry's control group (stages and donors)."""
        assert self.groups is not None
        self.pipeline, self.stage = plan.stage_of(self.rank)
        self.lane = self.rank - self.stage.rank
        # the entry's control group, or with donors (which leave after the entry) one of the stages
        self.step_group = control_group(plan.world_size, self.timeout) if plan.donors else control
        self.grad_sync = GradSync(self.groups, self.layer_model, self.owned)
        if plan.shadows is not None and plan.shadows.copies > 0:  # every stage worker makes the group
            group = nccl_rules.host_group(dist.new_group(list(range(plan.world_size)), timeout=self.timeout))
            self.shadow_link = ShadowLink(plan, self.rank, group)
        built = build_stage(
            self.cfg,
            self.pipeline,
            self.stage,
            layer_model=self.layer_model,
            groups=self.groups,
            grad_sync=self.grad_sync,
            loss_fn=self.loss_fn,
            microbatch_size=plan.microbatch_size,
            seq_len=self.dataset[0][0].shape[-1],
            device=self.device,
            dtype=self.dtype,
            compile=self.compile,
            progress=self.progress,
            clock=self.clock,
            log=log.at(gen=plan.generation, node=self.node),
            step=lambda: self._step,
        )
        self.stage_module, self.schedule = built.module, built.schedule
        if built.schedule is not None:  # a one-stage pipeline keeps the ends and the pacer it had
            self.holds_first_last, self.pacer = built.holds_first_last, built.pacer

    # ------------------------------------------------------------------ one step
    def my_samples(self, step: int) -> list[int]:
        indices = self.sampler.indices(step)
        assert self.plan is not None, "enter a generation first"
        start, end = pipeline_slices([p.microbatches for p in self.plan.pipelines], self.plan.microbatch_size)[
            self.pipeline.index
        ]
        return indices[start:end]

    def train_step(
        self,
        step: int,
        *,
        seen_generation: int = 0,
        rejections: int = 0,
        stop: bool = False,
        epoch: Optional[int] = None,
    ) -> StepResult:
        """Run step `step` (0-based) and apply it. It may run in another thread: it uses the
        generation's objects as they were when it started, and after `abandon()` it raises
        StepAbandoned instead of changing this trainer's state. `seen_generation`: the newest plan
        generation this worker has seen; `rejections`: how often this worker has seen the step
        guard reject `step`; `stop`: this worker saw a request to stop the job (the commit agrees on
        the largest of each, engine/step/commit.py);
        `epoch`: the step applier's epoch when the step was handed to its thread (default: now)."""
        t0 = time.perf_counter()
        epoch = self.applier.epoch if epoch is None else epoch
        with self.applier.current(epoch):  # abandoned before its thread took it up: touch nothing
            pass
        self._begin(step)  # may sleep or block: the control plane may abandon the step meanwhile
        # the generation's objects, taken while the step is current (abandon() waits for the lock): an
        # abandoned step's thread that wakes up later never runs on the next generation's schedule
        with self.applier.current(epoch):
            self._step = step
            self.clock.take()  # what an abandoned or rejected run left
            generation, plan, pipeline, rank = self.generation, self.plan, self.pipeline, self.rank
            x, y = self.batches.get(step)
            self._fed(step)
            schedule, grad_sync, shadow_link = self.schedule, self.grad_sync, self.shadow_link
            step_group = self.step_group  # this generation's, whatever the next one installs
            holds_first_last, stage_module = self.holds_first_last, self.stage_module
        assert grad_sync is not None and plan is not None, "enter a generation first"
        self.progress.new_step()
        grad_sync.begin_step(pipeline.microbatches)  # reductions start as layers finish
        local_loss = forward_backward(
            schedule,
            x,
            y,
            holds_first_last=holds_first_last,
            module=stage_module,
            loss_fn=self.loss_fn,
            microbatch_size=plan.microbatch_size,  # the plan's: training.microbatch_size may be auto
            device=self.device,
            dtype=self.dtype,
            progress=self.progress,
            clock=self.clock,
        )
        local_loss = self.faults.poisoned(local_loss, rank=rank, step=step, params=self.params)
        norm2, loss = self._synchronise(step, local_loss, grad_sync, step_group, epoch, shadow_link)
        errored = self._group_errors(step)  # read after every wait of the step, before voting
        agreed = commit(
            self._vote(seen_generation, rejections, stop, len(errored)),
            group=step_group,
            progress=self.progress,
            while_waiting=lambda: self.faults.block(rank=self.rank, step=step, where="comm"),
        )
        refuse_errored(agreed, step=step, mine=errored)
        spike_factor = self.cfg.fault_tolerance.loss_spike_factor
        verdict = judge(loss, norm2, running_max=agreed.max_loss, spike_factor=spike_factor)
        repaired: tuple[Corrupt, ...] = ()
        unrepairable = ""
        interval = self.cfg.fault_tolerance.fingerprint_interval_steps
        collectives = step_collectives(step, applied=verdict.apply, fingerprint_interval=interval)
        if verdict.apply:
            self.applier.apply(self.state, step, norm2, epoch)
            self.samples.committed("applied", step, generation=generation, rank=self.rank, how="step")
            self.faults.flip_bit(rank=self.rank, step=step, layers=self.layer_model.layers)
        if Collective.FINGERPRINTS in collectives:
            repaired, unrepairable = self._compare_copies(step_group)
        self.applier.settle(self.state, verdict, loss, agreed.max_loss, epoch)
        return StepResult(
            step=step,
            loss=loss,
            seconds=time.perf_counter() - t0,
            grad_norm=norm2**0.5,
            next_generation=agreed.generation,
            peak_rss_bytes=agreed.peak_rss_bytes,
            peak_device_bytes=agreed.peak_device_bytes,
            rejected=verdict.reason,
            rejections=agreed.rejections,
            stop=bool(agreed.stop),
            repaired=repaired,
            unrepairable=unrepairable,
            compute_s=agreed.compute_s,
            shadow_s=self.shadow_s,
            entry_window=(agreed.entry_began, agreed.entry_ended),
        )

    def _fed(self, step: int) -> None:
        """The sample ledger's record of the batch just taken, by the worker feeding the pipeline."""
        if self.stage.index != 0 or self.lane != 0 or self.batches.last is None or self.plan is None:
            return
        taken, indices = self.batches.last
        slices = pipeline_slices([p.microbatches for p in self.plan.pipelines], self.plan.microbatch_size)
        self.samples.fed(
            taken,
            indices,
            generation=self.generation,
            rank=self.rank,
            pipeline=self.pipeline.index,
            pipelines=len(self.plan.pipelines),
            slice_=slices[self.pipeline.index],
        )

    def _roll_forward(self, step: int, norm2: float) -> None:
        """Apply the interrupted step while entering a generation (engine/entry/enter.py);
        the sample ledger records it against the generation that fed it (still this state's)."""
        self.applier.apply(self.state, step, norm2)
        if self.state.committed_step == step:
            self.samples.committed("applied", step, generation=self.generation, rank=self.rank, how="roll_forward")

    def _begin(self, step: int) -> None:
        """The injected faults of a step's start (engine/resilience/faults.py)."""
        self.faults.check(rank=self.rank, step=step)
        self.faults.block(rank=self.rank, step=step, where="loop")

    def _synchronise(
        self,
        step: int,
        local_loss: torch.Tensor,
        grad_sync: GradSync,
        step_group: Optional[dist.ProcessGroup],
        epoch: int,
        shadow_link: Optional[ShadowLink] = None,
    ) -> tuple[float, float]:
        """The step's communication before the commit (`synchronise`, engine/step/grad_sync.py): the
        gradients summed among each layer's holders, then one SUM all-reduce of the squared norm
        and the loss; (squared norm, loss), global. The summed gradients of layers with shadow
        copies go to their keepers meanwhile, and the keepers' arrive, before this returns (so
        before the commit: engine/step/shadows.py), and are kept only while the step is current."""
        shadows = self.state.shadows
        synced = synchronise(
            grad_sync,
            local_loss,
            layer_model=self.layer_model,
            lane=self.lane,
            step_group=step_group,
            progress=self.progress,
            shadow_link=shadow_link,
            shadows=shadows,
            timeout=self.timeout,
        )
        self.shadow_s = synced.shadow_s
        with self.applier.current(epoch):
            if synced.shadow_grads is not None and shadows is not None:
                shadows.received(step, synced.shadow_grads)
            self.state.synced_step, self.state.synced_norm2 = step, synced.norm2
        return synced.norm2, synced.loss

    def _group_errors(self, step: int) -> list[str]:
        """This generation's device groups whose error state is not success (engine/entry/devices.py
        `group_errors`), and an injected one (engine/resilience/faults.py)."""
        groups = self.groups.ordered if self.groups is not None else []
        injected = self.faults.group_error(rank=self.rank, step=step, params=self.params)
        return group_errors(groups, self.device) + ([injected] if injected else [])

    def _vote(self, seen_generation: int, rejections: int, stop: bool, errored_groups: int = 0) -> CommitVote:
        """This worker's part of the COMMIT (engine/step/commit.py): the newest generation it has
        seen, its peak memory, the step guard's running maximum and rejections, and its compute
        seconds in this step (the straggler clock, engine/resilience/straggler.py), when it began and
        finished entering this generation (engine/telemetry/board.py), and how many of its device
        groups reported an error (`_group_errors`)."""
        device_peak = memory.peak_device_bytes(self.device)
        assert self.plan is not None
        return CommitVote(
            generation=max(seen_generation, self.generation),
            peak_rss_bytes=memory.peak_rss_bytes(),
            peak_device_bytes=device_peak,
            max_loss=self.state.max_loss,
            rejections=rejections,
            stop=int(stop),
            entry_began=self.entry_window[0],
            entry_ended=self.entry_window[1],
            compute_s=own_slot(self.rank, self.plan.world_size, self.clock.take()),
            errored_groups=errored_groups,
        )

    def _compare_copies(self, step_group: Optional[dist.ProcessGroup]) -> tuple[tuple[Corrupt, ...], str]:
        """After an applied step, every `fingerprint_interval_steps` (`step_collectives`: the same
        steps on every worker): the layers' copies compared with their other holders' and the
        corrupt ones repaired (`check_replicas`, engine/resilience/fingerprint.py; collective over
        `step_group`); (the repaired copies, why the job must stop: a layer's copies have no majority)."""
        try:
            assert self.plan is not None and self.groups is not None
            tensors = {i: layer_tensors(self.layer_model.held(i), self.optimizer) for i in self.owned}
            corrupt = check_replicas(
                self.plan,
                tensors,
                rank=self.rank,
                group=step_group,
                holder_groups=self.groups.sets,
                progress=self.progress,
            )
            return tuple(corrupt), ""
        except Unrepairable as err:
            return (), str(err)

    def skip(self, step: int) -> None:
        """Count `step` as done with no update: the step guard rejected it twice (engine/resilience/guard.py)."""
        self.applier.skip(self.state, step)
        self.samples.committed("skipped", step, generation=self.generation, rank=self.rank)

    def abort(self, *, abandoned: bool = False) -> None:
        """After a communication error, or when the control plane abandoned a step (`abandoned`):
        tear every process group down at once, so that the error reaches every peer blocked on
        this worker in tens of milliseconds (NCCL operations blocked on a hung peer are aborted;
        a blocked gloo operation is left to its thread, see `engine/entry/devices.py`). A gloo group
        closes its sockets only when the last reference goes, so the schedule, stage and groups
        are dropped and collected too (call this outside the `except` block: the exception's
        traceback keeps the failed call's frames, and with them the groups, alive)."""
        self.faults.disarm()  # engine/resilience/faults.py: a stuck step is injected once per job
        if abandoned:
            self.applier.abandon()
        self._drop_groups()
        try:
            release_groups(abort=True, busy=abandoned_threads())
        except Exception:  # noqa: BLE001 - the groups are broken anyway
            pass
        gc.collect()  # cheap: what existed before the first generation is frozen (engine/run.py)

    def close(self) -> None:
        self.batches.close()
        if self.plan is not None and dist.is_initialized():
            dist.destroy_process_group()
