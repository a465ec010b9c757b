"""The trainer: one worker's part of a plan, or the whole model in one process (the reference).

Single process (no plan): every layer is built here; each global batch is cut into
microbatches of `microbatch_size`, run forward/backward one after another with the
token-sum loss, then clipped and stepped. This is the reference every plan must match.

Pipelined: a worker enters a generation (`enter_generation`, the same protocol for the first
start, a join, a drain and a failure): it joins the generation's default process group (the
workers of its stages, plus those of its donors: drained nodes that only hand their layers
over, then leave; steps then run on `step_group`, the stages alone), and one
MAX all-reduce tells everyone the previous generation and the last step anyone COMMITTED. A
worker holding synchronised gradients of that step which it had not yet applied rolls forward
(applies them); otherwise an interrupted step is discarded and replayed. Then layers move from
surviving holders (reconfigure.py), and the stage, the schedule and the groups of groups.py are
rebuilt. A step (`train_step`) runs the pipeline's schedule (1F1B, or GPipe when chosen or when
the pipeline has fewer microbatches than stages) on its share of the global batch, then:

1. gradients are SUM-reduced among each layer's holders (GradSync);
2. one all-reduce over the generation sums the squared gradient norm and the loss;
3. one tiny all-reduce is the COMMIT point (docs/design.md, invariant 2): a worker calls
   optimizer.step() only after it returns, i.e. after every worker finished steps 1-2, so if any
   worker committed, every worker holds the synchronised gradients and the norm. It is a MAX of
   the newest plan generation each worker has seen, so everyone leaves for a new generation at
   the same step boundary.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _set_pg_timeout

from ..config import JobConfig
from ..models import build_layer_model
from ..planning import Plan, StagePlacement
from .data import collate, pipeline_slices
from .devices import backend_for, release_groups, to_device
from .errors import StepAbandoned
from .faults import FaultInjector
from .groups import GenerationGroups, GradSync, Holders
from .optim import build_optimizer, clip_coefficient, scale_grads, set_lr, token_sum_loss
from .reconfigure import Identity, Transfer, exchange, plan_transfers, retie

log = logging.getLogger(__name__)


class LayersLost(RuntimeError):
    """Some layer has no surviving copy: the job must restore a checkpoint."""

    def __init__(self, layers: list[int]) -> None:
        super().__init__(f"no surviving copy of layer(s) {layers}")
        self.layers = layers


@dataclass(frozen=True)
class StepResult:
    step: int
    """0-based optimizer step that was applied."""
    loss: float
    """Mean token loss over the global batch."""
    seconds: float
    """Wall time of the step on this worker."""
    grad_norm: float
    """Global gradient norm before clipping."""
    next_generation: int = 0
    """Newest plan generation any worker had seen at this step's end."""


@dataclass(frozen=True)
class Reconfiguration:
    generation: int
    """The generation entered."""
    previous: int
    """The generation left (0 at the first start)."""
    resume_step: int
    """Next step to run."""
    rolled_forward: bool
    """This worker applied the interrupted step's gradients after the failure."""
    bytes_moved: int
    """Layer bytes this worker sent plus received."""
    seconds: float
    """Wall time of the protocol on this worker."""
    lost_layers: tuple[int, ...] = ()
    """Layers without a surviving copy (then the checkpoint was restored)."""
    donor: bool = False
    """This worker only handed its layers over (a drained node) and leaves the job."""


def _release_donors() -> None:
    """One all-reduce over the entry (stages and donors) after the layer exchange: a donor leaves
    only once every receiver has its layers (a process that exits with data in flight could reset
    the connection under it). Steps then run on `Trainer.step_group`, without the donors."""
    dist.all_reduce(torch.zeros(1, dtype=torch.float64))


class Autocast(nn.Module):
    """Runs a stage under bf16 autocast (fp32 master weights stay in the wrapped module)."""

    def __init__(self, module: nn.Module, dtype: Optional[torch.dtype]) -> None:
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype is None:
            return self.module(x)
        with torch.autocast(device_type=x.device.type, dtype=self.dtype):
            out = self.module(x)
        return out.float() if out.is_floating_point() else out


class Trainer:
    def __init__(self, cfg: JobConfig, *, dataset: Any, plan: Optional[Plan] = None, rank: int = 0,
                 store: Optional[dist.Store] = None, timeout: Optional[timedelta] = None,
                 device: str | torch.device = "cpu", node: str = "local", local_rank: int = 0) -> None:
        from .data import GlobalBatchSampler

        self.cfg, self.dataset, self.node = cfg, dataset, node
        self.device = torch.device(device)
        t = cfg.training
        self.sampler = GlobalBatchSampler(len(dataset), t.global_batch_size, t.seed)
        seq_len = dataset[0][0].shape[-1]
        self.loss_fn = token_sum_loss(t.global_batch_size * seq_len)
        self.dtype = torch.bfloat16 if t.precision == "bf16" else None
        self.timeout = timeout or timedelta(seconds=cfg.fault_tolerance.comm_timeout_s)
        self.join_timeout = timedelta(seconds=cfg.fault_tolerance.join_timeout_s)
        self.plan: Optional[Plan] = None
        self.generation = 0
        self.rank = rank
        self.identity = (node, local_rank)
        self.committed_step = -1  # last step whose optimizer update was applied
        self.synced_step = -1  # last step whose gradients and norm are fully synchronised here
        self._synced_norm2 = 0.0
        self.owned: list[int] = []
        self.layer_model = build_layer_model(cfg.model, seed=t.seed, owned=[], device=device)
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.params: list[nn.Parameter] = []
        self.stage_module: Optional[nn.Module] = None
        self.step_group: Optional[dist.ProcessGroup] = None
        """The group of the generation's step collectives: its stages (None: the whole world)."""
        # A step may run in another thread that the control plane can abandon (engine/run.py):
        # `_epoch` grows at every abandonment, and a step only writes this trainer's state under
        # `_lock` while its epoch is current; the next generation then works on copies of the
        # kept layers (`_detach_kept`), so an abandoned step that wakes up touches nothing in use.
        self._lock = threading.Lock()
        self._epoch = 0
        self._detach_kept = False
        self.faults = FaultInjector.from_env()
        if plan is None and store is None:  # the single-process reference
            self.layer_model = build_layer_model(cfg.model, seed=t.seed, device=device)
            self._adopt(list(range(self.layer_model.num_layers)), {})
        elif plan is not None:
            self.identity = (plan.stage_of(rank)[1].node, plan.stage_of(rank)[1].local_rank)
            self.enter_generation(plan, store)

    # ------------------------------------------------------------------ generations
    def enter_generation(self, plan: Plan, store: Optional[dist.Store], *,
                         load_plan: Callable[[int], Optional[Plan]] = lambda g: None) -> Reconfiguration:
        """Join generation `plan.generation` (see the module docstring): connect, agree on the
        step, settle the interrupted step, agree on who holds what, move layers and install the
        new stage. Raises LayersLost when a layer has no surviving copy (the caller restores the
        newest checkpoint)."""
        t0 = time.perf_counter()
        stage = plan.stage_at(*self.identity)
        donor = plan.donor_rank(*self.identity)
        if stage is None and donor is None:
            raise ValueError(f"{self.identity} has no stage in generation {plan.generation}")
        rank = stage.rank if stage is not None else donor
        assert rank is not None
        self._connect(plan, rank, store)
        previous, committed = self._agree_on_step()
        rolled, current = self._settle(committed)
        held = self._agree_on_layouts(plan, rank, current, load_plan)
        transfers, lost = plan_transfers(held, plan)
        if stage is None:
            gave = list(self.owned)
            moved = self._hand_over(plan, rank, transfers, exchange_layers=not lost)
            info = Reconfiguration(generation=plan.generation, previous=previous, resume_step=committed + 1,
                                   rolled_forward=rolled, bytes_moved=moved, seconds=time.perf_counter() - t0,
                                   donor=True)
            log.info("gen %d step %d node %s rank %d: handed layers %s over as a donor (%d layer bytes sent, "
                     "%.3f s); leaving", plan.generation, committed + 1, self.node, rank, gave, moved,
                     info.seconds)
            return info
        moved = self._install(plan, stage, transfers, exchange_layers=not lost, current=current)
        if lost and held:  # (nobody holding anything is the first start: layers built from the seed)
            raise LayersLost(lost)
        info = Reconfiguration(generation=plan.generation, previous=previous, resume_step=committed + 1,
                               rolled_forward=rolled, bytes_moved=moved, seconds=time.perf_counter() - t0)
        log.info("gen %d step %d node %s rank %d: entered from generation %d (%s, %d layer bytes moved, %.3f s)",
                 plan.generation, committed + 1, self.node, stage.rank, previous,
                 "rolled forward" if rolled else "no step to roll forward", moved, info.seconds)
        return info

    def _connect(self, plan: Plan, rank: int, store: Optional[dist.Store]) -> None:
        """The generation's default group (stages and donors). It connects under the short join
        timeout (a peer that died during the reconfiguration holds gloo's connection set-up for
        ~5x it); collectives then run under the comm timeout (`_agree_on_layouts` switches once
        every peer is seen)."""
        release_groups(abort=False)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend_for(self.device), store=store, rank=rank,
                                world_size=plan.entry_world_size, timeout=min(self.timeout, self.join_timeout))

    def _agree_on_step(self) -> tuple[int, int]:
        """One MAX all-reduce: (newest generation anyone was in, newest step anyone committed)."""
        agree = torch.tensor([self.generation, self.committed_step, self.synced_step], dtype=torch.float64)
        dist.all_reduce(agree, op=dist.ReduceOp.MAX)
        return int(agree[0]), int(agree[1])

    def _settle(self, committed: int) -> tuple[bool, bool]:
        """Settle the interrupted step by the commit rule: a worker holding the synchronised
        gradients of the step someone committed applies them (rolls forward); anything else (a
        discarded step, possibly half a backward pass) is dropped and replayed. Returns (rolled
        forward, this worker's layers are at the agreed step)."""
        rolled = self.synced_step > self.committed_step and self.synced_step == committed
        if rolled:
            self._apply(self.synced_step, self._synced_norm2)
        current = self.committed_step == committed
        self._zero_grad()
        self.committed_step = self.synced_step = committed
        return rolled, current

    def _agree_on_layouts(self, plan: Plan, rank: int, current: bool,
                          load_plan: Callable[[int], Optional[Plan]]) -> dict[Identity, range]:
        """What every worker of `plan`'s entry (stages and donors) really holds: the layers of its
        stage in the generation it last entered (not always the previous one: an entry may have
        failed half-way on some workers), or nothing (new, restarted, or behind the agreed step).
        One all-reduce of generations; every copy is at the same committed step, so any is a source."""
        held = torch.zeros(plan.entry_world_size, dtype=torch.float64)
        held[rank] = self.generation if self.owned and current else 0
        dist.all_reduce(held)
        _set_pg_timeout(self.timeout)  # every peer is connected now
        layouts = {int(g) for g in held.tolist() if g > 0}
        plans = {g: self.plan if self.plan is not None and self.plan.generation == g else load_plan(g) for g in layouts}
        missing = sorted(g for g, p in plans.items() if p is None)
        if missing:
            raise RuntimeError(f"plan(s) of generation(s) {missing} are not available to {self.identity}")
        return {ident: plans[int(held[r])].layers_by_worker().get(ident, range(0))
                for ident, r in plan.entry_ranks().items() if int(held[r]) > 0}

    def _install(self, plan: Plan, stage: StagePlacement, transfers: list[Transfer], *, exchange_layers: bool,
                 current: bool) -> int:
        """Build the stage's layers: kept ones stay (copies after an abandoned step), received ones
        come with their optimizer state, others are built from the seed; then a new optimizer and
        the pipeline. Returns the layer bytes this worker sent plus received."""
        owned = list(range(stage.start, stage.end))
        kept = [i for i in owned if i in self.owned] if current else []
        fresh = [i for i in owned if i not in kept]
        target = build_layer_model(self.cfg.model, seed=self.cfg.training.seed, owned=fresh, device=str(self.device))
        kept_layers, kept_params = self._kept_layers(kept)
        for i in kept:
            target.layers[i] = kept_layers[i]
        retie(target)
        states, moved = ({}, 0)
        if exchange_layers:
            states, moved = exchange(transfers, rank=stage.rank, source=self.layer_model, optimizer=self.optimizer,
                                     target=target)
        if plan.donors:
            _release_donors()
        old_state = self.optimizer.state if self.optimizer is not None else {}
        keep_state = {id(new): (new, {k: v.clone() if new is not old else v for k, v in old_state[old].items()})
                      for old, new in kept_params if old in old_state}
        self._detach_kept = False
        self.layer_model, self.plan, self.generation, self.rank = target, plan, plan.generation, stage.rank
        self._adopt(owned, {**keep_state, **states})
        self._build_pipeline(plan)
        return moved

    def _hand_over(self, plan: Plan, rank: int, transfers: list[Transfer], *, exchange_layers: bool) -> int:
        """A donor's part of the entry: send the layers (with their optimizer state) the plan's
        stages need from it, then leave the generation. Returns the bytes sent."""
        moved = 0
        if exchange_layers:
            _, moved = exchange(transfers, rank=rank, source=self.layer_model, optimizer=self.optimizer,
                                target=self.layer_model)
        _release_donors()
        release_groups(abort=False)
        # drop the previous generation's pipeline and groups now, as a stage's next generation
        # does: process groups left for the interpreter's exit to destroy abort it
        self.stage_module = None
        self._drop_groups()
        self.plan, self.generation, self.owned, self.optimizer = plan, plan.generation, [], None
        self.layer_model = build_layer_model(self.cfg.model, seed=self.cfg.training.seed, owned=[],
                                             device=str(self.device))
        gc.collect()
        return moved

    def _drop_groups(self) -> None:
        """Forget this generation's schedule and process groups (a gloo group closes its sockets
        only when the last reference to it goes)."""
        self.schedule = None
        self.grad_sync = None  # type: ignore[assignment]
        self.groups = None  # type: ignore[assignment]
        self.step_group = None

    def _kept_layers(self, kept: list[int]) -> tuple[dict[int, nn.Module], list[tuple[nn.Parameter, nn.Parameter]]]:
        """The kept layers for the next generation and (old, new) pairs of their parameters: the
        layers themselves, or copies after an abandoned step (whose thread may still run)."""
        layers: dict[int, nn.Module] = {}
        pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        for i in kept:
            old = self.layer_model.layers[i]
            assert old is not None
            new = copy.deepcopy(old) if self._detach_kept else old
            layers[i] = new
            pairs += list(zip(old.parameters(), new.parameters()))
        return layers, pairs

    def _adopt(self, owned: list[int], states: dict[int, tuple[nn.Parameter, dict[str, torch.Tensor]]]) -> None:
        """Use the layers `owned` of self.layer_model with a new optimizer holding `states`."""
        self.owned = owned
        self.params = list(dict.fromkeys(p for i in owned for p in self.layer_model.layers[i].parameters()))
        self.optimizer = build_optimizer(self.params, self.cfg.training)
        for p, state in states.values():
            if any(p is q for q in self.params):
                self.optimizer.state[p] = state
        if self.plan is None:
            self.stage_module = Autocast(self.layer_model.stage(0, self.layer_model.num_layers), self.dtype)

    def _build_pipeline(self, plan: Plan) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.pipeline, self.stage = plan.stage_of(self.rank)
        # the generation's stages without its donors (which leave after the entry); None = the world
        self.step_group = dist.new_group(list(range(plan.world_size)), timeout=self.timeout) if plan.donors else None
        holders = Holders.of(plan, self.layer_model)
        self.groups = GenerationGroups(plan, holders, rank=self.rank, timeout=self.timeout,
                                       connect_timeout=self.join_timeout)
        self.grad_sync = GradSync(self.groups, self.layer_model, self.owned)
        self.stage_module = Autocast(self.layer_model.stage(self.stage.start, self.stage.end), self.dtype)
        stages = len(self.pipeline.stages)
        self.schedule = None
        if stages > 1:
            from .shapes import stage_io

            # static shapes (meta tensors): torch then exchanges no pickled metadata between stages
            inputs, outputs = stage_io(self.cfg.model, seed=self.cfg.training.seed, start=self.stage.start,
                                       end=self.stage.end, microbatch_size=self.cfg.training.microbatch_size,
                                       seq_len=self.dataset[0][0].shape[-1], autocast=self.dtype)
            pstage = PipelineStage(self.stage_module, self.stage.index, stages, self.device, input_args=inputs,
                                   output_args=outputs, group=self.groups.pipeline_group)
            mb = self.pipeline.microbatches
            cls = Schedule1F1B if self.cfg.planning.schedule == "1f1b" and mb >= stages else ScheduleGPipe
            # every stage gets the loss_fn: without one a schedule runs forward only
            self.schedule = cls(pstage, n_microbatches=mb, loss_fn=self.loss_fn, scale_grads=False)

    # ------------------------------------------------------------------ one step
    def my_samples(self, step: int) -> list[int]:
        indices = self.sampler.indices(step)
        if self.plan is None:
            return indices
        start, end = pipeline_slices([p.microbatches for p in self.plan.pipelines],
                                     self.cfg.training.microbatch_size)[self.pipeline.index]
        return indices[start:end]

    def _forward_backward_local(self, x: torch.Tensor, y: torch.Tensor) -> float:
        total = 0.0
        mbs = self.cfg.training.microbatch_size
        assert self.stage_module is not None
        x, y = to_device(x, self.device), to_device(y, self.device)
        for i in range(0, x.shape[0], mbs):
            loss = self.loss_fn(self.stage_module(x[i:i + mbs]), y[i:i + mbs])
            loss.backward()
            total += loss.item()
        return total

    def _forward_backward_pipeline(self, x: torch.Tensor, y: torch.Tensor, schedule: Any) -> float:
        if schedule is None:  # one-stage pipeline: no pipelining needed
            return self._forward_backward_local(x, y)
        first, last = self.stage.index == 0, self.stage.index == len(self.pipeline.stages) - 1
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(to_device(x, self.device))
        elif last:
            schedule.step(target=to_device(y, self.device), losses=losses)
        else:
            schedule.step()
        return float(sum(loss.item() for loss in losses))

    def train_step(self, step: int, *, seen_generation: int = 0) -> StepResult:
        """Run step `step` (0-based) and apply it. It may run in another thread: it uses the
        generation's objects as they were when it started, and after `abandon()` it raises
        StepAbandoned instead of changing this trainer's state."""
        t0 = time.perf_counter()
        epoch = self._epoch
        if self.plan is not None:
            self.faults.check(rank=self.rank, step=step)
        x, y = collate(self.dataset, self.my_samples(step))
        next_generation = self.generation
        if self.plan is None:
            loss = self._forward_backward_local(x, y)
            norm2 = float(sum(p.grad.double().pow(2).sum() for p in self.params if p.grad is not None))
            self._apply(step, norm2, epoch)
        else:
            schedule, grad_sync, step_group = self.schedule, self.grad_sync, self.step_group
            loss = self._forward_backward_pipeline(x, y, schedule)
            grad_sync.all_reduce()
            # control collectives: CPU tensors, so they go over gloo whatever the data backend
            reduced = torch.tensor([float(grad_sync.norm_squared()), loss], dtype=torch.float64)
            dist.all_reduce(reduced, group=step_group)
            norm2, loss = float(reduced[0]), float(reduced[1])
            with self._current(epoch):
                self.synced_step, self._synced_norm2 = step, norm2
            # COMMIT: returns only once every worker has finished this step's communication; it also
            # carries the newest plan generation anyone has seen, so all leave at the same boundary
            seen = torch.tensor([max(seen_generation, self.generation)], dtype=torch.float64)
            dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=step_group)
            self._apply(step, norm2, epoch)
            next_generation = int(seen[0])
        return StepResult(step=step, loss=loss, seconds=time.perf_counter() - t0, grad_norm=norm2 ** 0.5,
                          next_generation=next_generation)

    @contextlib.contextmanager
    def _current(self, epoch: int) -> Iterator[None]:
        """Hold the state lock, or raise StepAbandoned when the step of `epoch` was abandoned."""
        with self._lock:
            if self._epoch != epoch:
                raise StepAbandoned(f"the step of epoch {epoch} was abandoned (now {self._epoch})")
            yield

    def _apply(self, step: int, norm2: float, epoch: Optional[int] = None) -> None:
        with self._current(self._epoch if epoch is None else epoch):
            assert self.optimizer is not None
            scale_grads(self.params, clip_coefficient(norm2, self.cfg.training.optimizer.grad_clip))
            set_lr(self.optimizer, step, self.cfg.training)
            self.optimizer.step()
            self._zero_grad()
            self.committed_step = step

    def _zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ state
    def layer_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Owned layers' parameters, detached copies on the CPU, by layer index and local name."""
        return {i: {n: p.detach().to("cpu", copy=True) for n, p in self.layer_model.layers[i].named_parameters()}
                for i in self.owned}

    def optimizer_state(self) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
        """Owned layers' optimizer state (e.g. exp_avg, exp_avg_sq, step) by layer and name, on the CPU."""
        out: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        assert self.optimizer is not None
        for i in self.owned:
            for n, p in self.layer_model.layers[i].named_parameters():
                st = self.optimizer.state.get(p, {})
                out.setdefault(i, {})[n] = {k: v.detach().to("cpu", copy=True) for k, v in st.items()
                                            if torch.is_tensor(v)}
        return out

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds of this worker (torch's Stateful): the next step to run, and the
        owned layers' parameters and optimizer state by layer index and local name, on the CPU."""
        return {"next_step": self.committed_step + 1, "layers": self.layer_state(),
                "optimizer": self.optimizer_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Install a `state_dict` (of any plan) for the layers this worker owns now: weights are
        copied into the parameters, optimizer moments go to the parameters' device and AdamW's
        `step` stays on the CPU; training goes on at `next_step`. Layers missing from `state`
        or a parameter missing from a layer raise KeyError naming them."""
        assert self.optimizer is not None
        layers, optim = state["layers"], state.get("optimizer", {})
        for i in self.owned:
            if i not in layers:
                raise KeyError(f"the state has no layer {i}")
            for name, p in self.layer_model.layers[i].named_parameters():
                if name not in layers[i]:
                    raise KeyError(f"the state's layer {i} has no parameter '{name}'")
                with torch.no_grad():
                    p.copy_(layers[i][name])
                moments = optim.get(i, {}).get(name)
                if moments:
                    self.optimizer.state[p] = {k: torch.as_tensor(v).to("cpu" if k == "step" else p.device, copy=True)
                                               for k, v in moments.items()}
        self.committed_step = self.synced_step = int(state["next_step"]) - 1

    def abort(self, *, abandoned: bool = False) -> None:
        """After a communication error, or when the control plane abandoned a step (`abandoned`):
        tear every process group down at once, so that the error reaches every peer blocked on
        this worker in tens of milliseconds (NCCL operations blocked on a hung peer are aborted;
        a blocked gloo operation is left to its thread, see `engine/devices.py`). A gloo group
        closes its sockets only when the last reference goes, so the schedule, stage and groups
        are dropped and collected too (call this outside the `except` block: the exception's
        traceback keeps the failed call's frames, and with them the groups, alive)."""
        if abandoned:
            with self._lock:
                self._epoch += 1
                self._detach_kept = True
        self._drop_groups()
        try:
            release_groups(abort=True)
        except Exception:  # noqa: BLE001 - the groups are broken anyway
            pass
        gc.collect()

    def close(self) -> None:
        if self.plan is not None and dist.is_initialized():
            dist.destroy_process_group()
