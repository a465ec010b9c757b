"""A worker's stage in a generation: built once at its entry, run at every step.

`build_stage` turns the layers this worker holds into what a step runs: one module per virtual
stage (its chunk of layers; one range without chunks; a one-stage pipeline's are contiguous),
compiled when `training.compile` says so and under the step's precision (`stage_module`). A
pipeline of several stages also gets torch `PipelineStage`s, one per virtual stage, with static
input and output shapes (meta tensors: torch then exchanges no pickled metadata between stages),
each of whose passes is padded (`training.paced_devices`, engine/step/paced.py), timed by the
straggler clock (engine/resilience/straggler.py) and a progress point of the step thread
(engine/resilience/progress.py); its weight passes tell the generation's `GradSync` when a
virtual stage's last weight gradient is final (`_after_weight_pass`). `schedule_for` picks the
torch schedule that runs the pipeline's planned schedule over those stages (only what
`planning.schedules.choice.ENGINE_RUNS` lists).

A step then runs this stage's part: `run_schedule` feeds the first stage, gives the last its
targets and sums the losses it returns; `run_local`, a one-stage pipeline, which needs no
schedule, runs its microbatches one after another. Both return the summed loss on the device
(the step's only host read comes later, with the gradient norm: `synchronise`, grad_sync.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from ...config import JobConfig
from ...logs import JobLog
from ...models import LayerModel
from ...planning import PipelineSpec, PlanningError, StagePlacement
from ...planning.schedules.choice import ENGINE_RUNS, engine_runs_text
from ..resilience.progress import Progress, watch_pipeline_waits
from ..resilience.straggler import ComputeClock
from ..step.compiled import compiled_stage
from ..step.paced import Pacer, pace_stage
from ..step.result import Autocast
from .devices import to_device
from .grad_sync import GradSync
from .groups import GenerationGroups

__all__ = ["BuiltStage", "build_stage", "stage_module", "schedule_for", "run_local", "run_schedule"]


@dataclass(frozen=True)
class BuiltStage:
    """What `build_stage` made of a worker's stage."""

    module: nn.Module
    """The stage's layers (an `nn.Sequential` of its virtual stages' modules when it has chunks)."""
    schedule: Any
    """The torch schedule (None: a one-stage pipeline, run by `run_local`)."""
    ends: tuple[bool, bool]
    """Whether the worker's virtual stages include the pipeline's first and its last (with a schedule)."""
    pacer: Optional[Pacer]
    """The first chunk's pacer (with a schedule; None when not paced)."""


def stage_module(
    layer_model: LayerModel, start: int, end: int, *, compile: bool, dtype: Optional[torch.dtype]
) -> nn.Module:
    """Layers [start, end) of this worker, compiled when `training.compile` says so, under the
    step's precision (the model's last layer hands on bf16 logits)."""
    layers = layer_model.stage(start, end)
    last = end == layer_model.num_layers
    return Autocast(compiled_stage(list(layers)) if compile else layers, dtype, last=last)


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
    modules = [stage_module(layer_model, u, v, compile=compile, dtype=dtype) for u, v in ranges]
    module = modules[0] if len(modules) == 1 else nn.Sequential(*modules)
    if stages <= 1:
        return BuiltStage(module, None, (True, True), None)
    from ...planning.schedules.schedules import stage_placement
    from ..step.shapes import stage_io

    placed = stage_placement(pipeline.schedule, stages, len(ranges))  # virtual stage -> device
    indices = [k for k, on in enumerate(placed) if on == stage.index]
    ends = (0 in indices, len(placed) - 1 in indices)  # holds the first / the last virtual stage
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
        pacer = pace_stage(  # training.paced_devices: pad each pass (engine/step/paced.py)
            pstage,
            stage,
            cfg.training.paced_devices,
            device=device,
            log=log,
            step=step,
            chunk=len(pstages),
        )
        if not pstages:
            first_pacer = pacer  # the first chunk's (tests read what it padded)
        # a split backward assigns the weight gradients in its W pass, no hook sees them:
        # the gradient sync is told when a virtual stage's last W has run (grad_sync.py)
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
    return BuiltStage(module, schedule_for(pipeline, pstages, loss_fn), ends, first_pacer)


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
    `OneChunkZeroBubble`, engine/step/zero_bubble.py; its interleaved form over 2..8 chunks) or
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

    from ..step.zero_bubble import OneChunkZeroBubble

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


def run_local(
    module: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    microbatch_size: int,
    device: torch.device,
    progress: Progress,
) -> torch.Tensor:
    """Forward and backward of every microbatch in turn; the summed loss, on the device."""
    x, y = to_device(x, device), to_device(y, device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(0, x.shape[0], microbatch_size):
        loss = loss_fn(module(x[i : i + microbatch_size]), y[i : i + microbatch_size])
        loss.backward()
        total += loss.detach()
        progress.point()  # a compute chunk (engine/resilience/progress.py)
    return total


def run_schedule(
    schedule: Any, ends: tuple[bool, bool], x: torch.Tensor, y: torch.Tensor, *, device: torch.device
) -> torch.Tensor:
    """This stage's part of the pipeline schedule (`ends`: whether the worker holds the first and
    the last virtual stage); the summed loss on the last stage (zero on the others), on the device."""
    first, last = ends
    losses: list[torch.Tensor] = []
    if first and last:  # zbv's V: device 0 holds the first and the last stage
        schedule.step(to_device(x, device), target=to_device(y, device), losses=losses)
    elif first:
        schedule.step(to_device(x, device))
    elif last:
        schedule.step(target=to_device(y, device), losses=losses)
    else:
        schedule.step()
    if not losses:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([loss.detach().double() for loss in losses]).sum()
