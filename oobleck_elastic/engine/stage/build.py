"""A worker's stage, built once at the entry of a generation (`build_stage`): one module per
virtual stage (compiled when `training.compile` says so, under the step's precision: `Autocast`)
and, for a pipeline of several stages, torch `PipelineStage`s with static shapes (shapes.py),
paced (paced.py), timed by the straggler clock and watched as progress points, and the torch
schedule that runs the planned one (`schedule_for`), each layer recomputed when the plan says so
for the stage (`recomputes`). Invariant: the engine only builds what
`planning.schedules.choice.ENGINE_RUNS` lists, and every schedule sums (never averages) the
microbatches' gradients. A step runs it with engine/step/forward_backward.py; docs/schedules.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from ...config import JobConfig
from ...logs import JobLog
from ...models import LayerModel
from ...planning import PipelineSpec, PlanningError, StagePlacement
from ...planning.fleet import class_speed
from ...planning.schedules.choice import ENGINE_RUNS, engine_runs_text
from ..resilience.progress import Progress, watch_pipeline_waits
from ..resilience.straggler import ComputeClock
from ..step.grad_sync import GradSync
from .compiled import compiled_stage
from .paced import Pacer, node_factor, pace_stage
from ...models.recompute import Recomputed

if TYPE_CHECKING:
    from ..entry.groups import GenerationGroups

__all__ = ["Autocast", "BuiltStage", "build_stage", "stage_module", "schedule_for"]


@dataclass(frozen=True)
class BuiltStage:
    """What `build_stage` made of a worker's stage."""

    module: nn.Module
    """The stage's layers (an `nn.Sequential` of its virtual stages' modules when it has chunks)."""
    schedule: Any
    """The torch schedule (None: a one-stage pipeline, run by `run_local`)."""
    holds_first_last: tuple[bool, bool]
    """Whether the worker's virtual stages include the pipeline's first and its last (with a schedule)."""
    pacer: Optional[Pacer]
    """The first chunk's pacer (with a schedule; None when not paced)."""


class Autocast(nn.Module):
    """Runs a stage under bf16 autocast (fp32 master weights stay in the wrapped module). What it
    hands to the next stage is float32; the last stage's logits are bf16 (`last`; what a head's
    matrix multiply gives under autocast), for the loss to upcast chunk by chunk (engine/step/loss.py)."""

    def __init__(self, module: nn.Module, dtype: Optional[torch.dtype], *, last: bool = False) -> None:
        super().__init__()
        self.module, self.dtype, self.last = module, dtype, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype is None:
            return self.module(x)
        with torch.autocast(device_type=x.device.type, dtype=self.dtype):
            out = self.module(x)
        if not out.is_floating_point():
            return out
        return out.to(self.dtype) if self.last else out.float()


def recomputes(cfg: JobConfig, stage: StagePlacement) -> bool:
    """Whether this worker recomputes its layers' activations: as the plan says for its stage
    (`StagePlacement.activation_checkpoint`; per stage under `auto`), else, for a plan that does
    not record it, `training.activation_checkpoint` (`auto` there: none)."""
    return (stage.activation_checkpoint or cfg.training.activation_checkpoint) == "full"


def stage_module(
    layer_model: LayerModel,
    start: int,
    end: int,
    *,
    compile: bool,
    dtype: Optional[torch.dtype],
    recompute: bool = False,
) -> nn.Module:
    """Layers [start, end) of this worker, compiled when `training.compile` says so, their
    activations recomputed in the backward when `recompute` (models/recompute.py), under the step's
    precision (the model's last layer hands on bf16 logits)."""
    layers = layer_model.stage(start, end)
    if compile:
        layers = compiled_stage(list(layers), recompute=recompute)
    elif recompute:
        layers = nn.Sequential(*[Recomputed(layer) for layer in layers])
    return Autocast(layers, dtype, last=end == layer_model.num_layers)


def build_stage(
    cfg: JobConfig,
    pipeline: PipelineSpec,
    stage: StagePlacement,
    *,
    layer_model: LayerModel,
    groups: GenerationGroups,
    grad_sync: GradSync,
    loss_fn: Callable[..., torch.Tensor],
    microbatch_size: int,
    seq_len: int,
    device: torch.device,
    dtype: Optional[torch.dtype],
    compile: bool,
    progress: Progress,
    clock: ComputeClock,
    log: JobLog,
    step: Callable[[], int],
) -> BuiltStage:
    """This worker's `stage` of `pipeline` (module docstring); `step` tells the pacer the step running."""
    from torch.distributed.pipelining import PipelineStage

    stages = len(pipeline.stages)
    # the device's virtual stages (one range without chunks); a one-stage pipeline's are contiguous
    held = stage.layers()
    ranges = stage.layer_ranges() if stages > 1 else ((min(held), max(held) + 1),)
    recompute = recomputes(cfg, stage)
    modules = [stage_module(layer_model, u, v, compile=compile, dtype=dtype, recompute=recompute) for u, v in ranges]
    module = modules[0] if len(modules) == 1 else nn.Sequential(*modules)
    if stages <= 1:
        return BuiltStage(module, None, (True, True), None)
    from ...planning.schedules.schedules import stage_placement
    from .shapes import stage_io

    placed = stage_placement(pipeline.schedule, stages, len(ranges))  # virtual stage -> device
    indices = [k for k, on in enumerate(placed) if on == stage.index]
    holds_first_last = (0 in indices, len(placed) - 1 in indices)  # holds the first / the last virtual stage
    first_pacer: Optional[Pacer] = None
    pstages: list[PipelineStage] = []
    for index, (start, end), chunk_module in zip(indices, ranges, modules, strict=True):
        # static shapes (meta tensors): torch then exchanges no pickled metadata between stages
        inputs, outputs = stage_io(
            cfg.model,
            seed=cfg.training.seed,
            start=start,
            end=end,
            microbatch_size=microbatch_size,
            seq_len=seq_len,
            autocast=dtype,
        )
        pstage = PipelineStage(
            chunk_module,
            index,
            len(placed),
            device,
            input_args=inputs,
            output_args=outputs,
            group=groups.pipeline_group,
        )
        pacer = pace_stage(  # training.paced_devices: pad each pass (engine/stage/paced.py)
            pstage,
            stage,
            _paced_factor(cfg, stage),
            device=device,
            log=log,
            step=step,
            chunk=len(pstages),
        )
        if not pstages:
            first_pacer = pacer  # the first chunk's (tests read what it padded)
        # a split backward assigns the weight gradients in its W pass, no hook sees them:
        # the gradient sync is told when a virtual stage's last W has run (engine/step/grad_sync.py)
        pstage.backward_weight_one_chunk = _after_weight_pass(  # type: ignore[method-assign]
            pstage.backward_weight_one_chunk, grad_sync, range(start, end)
        )
        # time the stage's own compute, not its waits for its neighbours (engine/resilience/straggler.py)
        # and each chunk is a progress point of the step thread (engine/resilience/progress.py);
        # zero-bubble splits the backward into the input gradient and the weight gradient
        for chunk in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(pstage, chunk, progress.timed(clock.timed(getattr(pstage, chunk))))
        pstages.append(pstage)
    watch_pipeline_waits(progress)  # the schedule's sends and receives are waits
    return BuiltStage(module, schedule_for(pipeline, pstages, loss_fn), holds_first_last, first_pacer)


def _after_weight_pass(weight_pass: Callable[..., Any], sync: GradSync, layers: range) -> Callable[..., Any]:
    """`weight_pass` (a stage's backward_weight_one_chunk), then `sync.weight_pass(layers)`: the
    generation's own GradSync, bound here, so an abandoned step never reaches the next one's."""

    def run(*args: Any, **kwargs: Any) -> Any:
        out = weight_pass(*args, **kwargs)
        sync.weight_pass(layers)
        return out

    return run


def schedule_for(pipeline: PipelineSpec, stages: list[Any], loss_fn: Callable[..., torch.Tensor]) -> Any:
    """The torch schedule running `pipeline`'s schedule on this worker's `stages` (its virtual
    stages, in pipeline order): 1F1B (GPipe when chosen, or when the pipeline has fewer
    microbatches than stages), interleaved 1F1B over the chunks, zero-bubble (torch's interleaved
    zero-bubble schedule: ZB-H1 on one chunk per device, at any microbatch count with
    `OneChunkZeroBubble`, engine/stage/zero_bubble.py; its interleaved form over 2..8 chunks) or
    ZB-V (two stages per device in a V), the orders planning/schedules/schedules.py simulates. Every stage
    gets the loss_fn (without one a schedule runs forward only) and sums, never averages, the
    microbatches' gradients (`scale_grads=False`: the loss is already divided by the global batch)."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    from .zero_bubble import OneChunkZeroBubble

    if (pipeline.schedule, pipeline.num_chunks) not in ENGINE_RUNS:
        raise PlanningError(
            f"pipeline {pipeline.index} runs {pipeline.schedule} with {pipeline.num_chunks} chunk(s) per device, "
            f"which the engine does not run (it runs {engine_runs_text()}): set planning.schedule to one of those"
        )
    mb = pipeline.microbatches
    many = {
        "interleaved-1f1b": ScheduleInterleaved1F1B,
        "zero-bubble": OneChunkZeroBubble if len(stages) == 1 else ScheduleInterleavedZeroBubble,
        "zbv": ScheduleZBVZeroBubble,
    }
    if pipeline.schedule in many:
        return many[pipeline.schedule](stages, n_microbatches=mb, loss_fn=loss_fn, scale_grads=False)
    (one_stage,) = stages
    one = Schedule1F1B if pipeline.schedule == "1f1b" and mb >= len(pipeline.stages) else ScheduleGPipe
    return one(one_stage, n_microbatches=mb, loss_fn=loss_fn, scale_grads=False)


def _paced_factor(cfg: JobConfig, stage: StagePlacement) -> float:
    """training.paced_devices for this device, at its own speed (OOBLECK_PACED_SPEED) against the
    one the plan assumed for its class (`node_factor`)."""
    given = os.environ.get("OOBLECK_PACED_SPEED")
    planned = 1.0
    if stage.device_class and stage.device_class in cfg.planning.classes:
        planned = class_speed(cfg, stage.device_class)[0]
    return node_factor(cfg.training.paced_devices, planned, float(given) if given else None)
