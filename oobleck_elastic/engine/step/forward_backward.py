"""This stage's part of a step's forward and backward (`forward_backward`): `run_schedule` runs
the torch pipeline schedule built at entry (engine/stage/build.py), `run_local` a one-stage
pipeline's microbatches one after another. Both return the summed loss on the device: the step's only host
read comes later, with the gradient norm (engine/step/grad_sync.py). docs/schedules.md tells
which schedule runs where.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from ..resilience.progress import Progress
from ..resilience.straggler import ComputeClock

__all__ = ["forward_backward", "run_local", "run_schedule", "to_device"]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to `device`: through pinned memory without blocking on CUDA."""
    if device.type == "cpu":
        return t
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)


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
    schedule: Any, holds_first_last: tuple[bool, bool], x: torch.Tensor, y: torch.Tensor, *, device: torch.device
) -> torch.Tensor:
    """This stage's part of the pipeline schedule (`holds_first_last`: whether the worker holds the first and
    the last virtual stage); the summed loss on the last stage (zero on the others), on the device."""
    first, last = holds_first_last
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


def forward_backward(
    schedule: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    holds_first_last: tuple[bool, bool],
    module: Optional[nn.Module],
    loss_fn: Callable[..., torch.Tensor],
    microbatch_size: int,
    device: torch.device,
    dtype: Optional[torch.dtype],
    progress: Progress,
    clock: ComputeClock,
) -> torch.Tensor:
    """This stage's part of the step's `schedule` (None: a one-stage pipeline, whose `module` runs
    its microbatches one after another, timed by the straggler `clock` as a whole) in one autocast
    region (torch casts each weight to bf16 once per region, its autocast cache, not once per
    microbatch); the summed loss, on the device."""
    with torch.autocast(device_type=device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        if schedule is None:
            assert module is not None
            return clock.timed(run_local)(
                module, loss_fn, x, y, microbatch_size=microbatch_size, device=device, progress=progress
            )
        return run_schedule(schedule, holds_first_last, x, y, device=device)
