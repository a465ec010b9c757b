"""The trainer: one worker's part of a plan, or the whole model in one process (the reference).

Single process (no plan): every layer is built here; each global batch is cut into
microbatches of `microbatch_size`, run forward/backward one after another with the
token-sum loss, then clipped and stepped. This is the reference every plan must match.

Pipelined (a plan and a rank): the worker builds only its stage's layers (their initial weights
depend on (seed, layer) only), joins the generation's default process group and the groups of
groups.py, wraps its layers in a `torch.distributed.pipelining.PipelineStage` and runs its
pipeline's schedule (1F1B, or GPipe when chosen or when the pipeline has fewer microbatches
than stages) on its pipeline's contiguous share of the global batch. Then:

1. gradients are SUM-reduced among each layer's holders (GradSync);
2. one tiny all-reduce over the whole generation carries the squared gradient norm and the loss:
   it is the COMMIT point of the step (DESIGN.md invariant 2): a worker calls optimizer.step()
   only after it returns, i.e. after every worker finished all communication of the step;
3. the same clip coefficient, LR and AdamW update are applied everywhere, so replicas stay equal.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..config import JobConfig
from ..models import LayerModel, build_layer_model
from ..planning import Plan
from .groups import GenerationGroups, GradSync, Holders
from .optim import build_optimizer, clip_coefficient, scale_grads, set_lr, token_sum_loss

log = logging.getLogger(__name__)


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


def collate(dataset: Any, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    items = [dataset[i] for i in indices]
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


class Trainer:
    def __init__(self, cfg: JobConfig, *, dataset: Any, plan: Optional[Plan] = None, rank: int = 0,
                 store: Optional[dist.Store] = None, timeout: Optional[timedelta] = None,
                 device: str = "cpu", node: str = "local") -> None:
        from .data import GlobalBatchSampler

        self.cfg, self.dataset, self.plan, self.rank, self.node = cfg, dataset, plan, rank, node
        self.device = torch.device(device)
        t = cfg.training
        self.sampler = GlobalBatchSampler(len(dataset), t.global_batch_size, t.seed)
        seq_len = dataset[0][0].shape[-1]
        self.loss_fn = token_sum_loss(t.global_batch_size * seq_len)
        self.dtype = torch.bfloat16 if t.precision == "bf16" else None
        self.timeout = timeout or timedelta(seconds=cfg.fault_tolerance.comm_timeout_s)
        if plan is None:
            self.layer_model = build_layer_model(cfg.model, seed=t.seed, device=device)
            self.owned = list(range(self.layer_model.num_layers))
            self.stage_module: nn.Module = Autocast(self.layer_model.stage(0, self.layer_model.num_layers), self.dtype)
            self.pipeline = None
            self.generation = 0
        else:
            self._setup_pipeline(plan, store)
        self.params = list(dict.fromkeys(p for i in self.owned for p in self.layer_model.layers[i].parameters()))
        self.optimizer = build_optimizer(self.params, t)

    # ------------------------------------------------------------------ set-up
    def _setup_pipeline(self, plan: Plan, store: Optional[dist.Store]) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        t = self.cfg.training
        self.generation = plan.generation
        self.pipeline, self.stage = plan.stage_of(self.rank)
        self.owned = list(range(self.stage.start, self.stage.end))
        self.layer_model = build_layer_model(self.cfg.model, seed=t.seed, owned=self.owned, device=str(self.device))
        if not dist.is_initialized():
            dist.init_process_group("gloo" if self.device.type == "cpu" else "nccl", store=store, rank=self.rank,
                                    world_size=plan.world_size, timeout=self.timeout)
        holders = Holders.of(plan, self.layer_model)
        self.groups = GenerationGroups(plan, holders, rank=self.rank, timeout=self.timeout)
        self.grad_sync = GradSync(self.groups, self.layer_model, self.owned)
        self.stage_module = Autocast(self.layer_model.stage(self.stage.start, self.stage.end), self.dtype)
        stages = len(self.pipeline.stages)
        self.schedule = None
        if stages > 1:
            pstage = PipelineStage(self.stage_module, self.stage.index, stages, self.device,
                                   group=self.groups.pipeline_group)
            mb = self.pipeline.microbatches
            use_1f1b = self.cfg.planning.schedule == "1f1b" and mb >= stages
            cls = Schedule1F1B if use_1f1b else ScheduleGPipe
            # every stage gets the loss_fn: without one a schedule runs forward only
            self.schedule = cls(pstage, n_microbatches=mb, loss_fn=self.loss_fn, scale_grads=False)
        log.info("gen %d node %s rank %d: pipeline %d stage %d/%d layers [%d,%d) %d microbatches", plan.generation,
                 self.node, self.rank, self.pipeline.index, self.stage.index, stages, self.stage.start, self.stage.end,
                 self.pipeline.microbatches)

    # ------------------------------------------------------------------ one step
    def my_samples(self, step: int) -> list[int]:
        indices = self.sampler.indices(step)
        if self.plan is None:
            return indices
        mbs = self.cfg.training.microbatch_size
        start = mbs * sum(p.microbatches for p in self.plan.pipelines[: self.pipeline.index])
        return indices[start:start + mbs * self.pipeline.microbatches]

    def _forward_backward_local(self, x: torch.Tensor, y: torch.Tensor) -> float:
        total = 0.0
        mbs = self.cfg.training.microbatch_size
        for i in range(0, x.shape[0], mbs):
            loss = self.loss_fn(self.stage_module(x[i:i + mbs].to(self.device)), y[i:i + mbs].to(self.device))
            loss.backward()
            total += loss.item()
        return total

    def _forward_backward_pipeline(self, x: torch.Tensor, y: torch.Tensor) -> float:
        assert self.pipeline is not None
        if self.schedule is None:  # one-stage pipeline: no pipelining needed
            return self._forward_backward_local(x, y)
        first, last = self.stage.index == 0, self.stage.index == len(self.pipeline.stages) - 1
        losses: list[torch.Tensor] = []
        if first:
            self.schedule.step(x.to(self.device))
        elif last:
            self.schedule.step(target=y.to(self.device), losses=losses)
        else:
            self.schedule.step()
        return float(sum(loss.item() for loss in losses))

    def train_step(self, step: int) -> StepResult:
        t0 = time.perf_counter()
        x, y = collate(self.dataset, self.my_samples(step))
        if self.plan is None:
            loss = self._forward_backward_local(x, y)
            norm2 = float(sum(p.grad.double().pow(2).sum() for p in self.params if p.grad is not None))
        else:
            loss = self._forward_backward_pipeline(x, y)
            self.grad_sync.all_reduce()
            commit = torch.tensor([float(self.grad_sync.norm_squared()), loss], dtype=torch.float64)
            dist.all_reduce(commit)  # the commit point: every worker finished its step's communication
            norm2, loss = float(commit[0]), float(commit[1])
        scale_grads(self.params, clip_coefficient(norm2, self.cfg.training.optimizer.grad_clip))
        set_lr(self.optimizer, step, self.cfg.training)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(step=step, loss=loss, seconds=time.perf_counter() - t0, grad_norm=norm2 ** 0.5)

    # ------------------------------------------------------------------ state
    def layer_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Owned layers' parameters, detached copies, by layer index and local name."""
        return {i: {n: p.detach().clone() for n, p in self.layer_model.layers[i].named_parameters()}
                for i in self.owned}

    def optimizer_state(self) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
        """Owned layers' optimizer state (e.g. exp_avg, exp_avg_sq, step) by layer and name."""
        out: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        for i in self.owned:
            for n, p in self.layer_model.layers[i].named_parameters():
                st = self.optimizer.state.get(p, {})
                out.setdefault(i, {})[n] = {k: v.detach().clone() for k, v in st.items() if torch.is_tensor(v)}
        return out

    def close(self) -> None:
        if self.plan is not None and dist.is_initialized():
            dist.destroy_process_group()


