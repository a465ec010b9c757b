"""Optimizer, learning-rate schedule, loss scaling and gradient clipping, shared by the
single-process reference and the pipelined engine so both do exactly the same math.

Invariant: clipping uses the global gradient norm (each parameter counted once in the job) and
the same coefficient everywhere; AdamW (torch's fused kernel, weight decay on matrices only)
keeps its `step` as a float32 scalar on the parameters' device (`adamw_step`) wherever state is
installed; nothing here reads a device value back to the host. docs/training.md.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ...config import TrainingConfig
from .loss import token_sum_loss

__all__ = ["token_sum_loss", "build_optimizer", "adamw_step", "lr_factor", "set_lr", "clip_coefficient", "scale_grads"]


def build_optimizer(params: Iterable[nn.Parameter], cfg: TrainingConfig) -> torch.optim.Optimizer:
    """AdamW (or SGD) over `params`; weight decay on tensors with >= 2 dims only."""
    params = list(dict.fromkeys(params))  # unique, in first-seen order
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr)
    groups = []
    for decayed in (True, False):
        for sharded in (False, True):  # fused kernels take DTensors or plain tensors, not both at once
            members = [p for p in params if (p.ndim >= 2) == decayed and isinstance(p, DTensor) == sharded]
            if members:
                groups.append({"params": members, "weight_decay": o.weight_decay if decayed else 0.0})
    return torch.optim.AdamW(groups, lr=o.lr, betas=(float(o.betas[0]), float(o.betas[1])), eps=o.eps, fused=True)


def adamw_step(value: torch.Tensor | float, param: torch.Tensor) -> torch.Tensor:
    """AdamW's `step` state for `param` as the fused optimizer keeps it: a float32 scalar on the
    parameter's device (a checkpoint or a layer transfer may carry it anywhere)."""
    return torch.as_tensor(value).detach().reshape(()).to(param.device, torch.float32, copy=True)


def lr_factor(step: int, cfg: TrainingConfig) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based)."""
    s = cfg.lr_schedule
    if s.warmup_steps and step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    span = max(1, cfg.steps - s.warmup_steps)
    progress = min(1.0, (step - s.warmup_steps) / span)
    if s.decay == "constant":
        return 1.0
    if s.decay == "linear":
        return 1.0 - (1.0 - s.min_lr_ratio) * progress
    return s.min_lr_ratio + (1.0 - s.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: TrainingConfig) -> float:
    lr = cfg.optimizer.lr * lr_factor(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def clip_coefficient(norm_squared: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient, from a global squared norm."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (math.sqrt(norm_squared) + 1e-6))


def scale_grads(params: Iterable[torch.Tensor], coefficient: float) -> None:
    """Multiply every gradient by `coefficient` (one foreach call; nothing when it is 1)."""
    if coefficient < 1.0:
        by_type: dict[type, list[torch.Tensor]] = {}  # foreach takes DTensors or plain tensors, not both
        for p in params:
            if p.grad is not None:
                by_type.setdefault(type(p.grad), []).append(p.grad)
        for grads in by_type.values():
            torch._foreach_mul_(grads, coefficient)


def apply_update(
    optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], step: int, norm2: float, cfg: TrainingConfig
) -> None:
    """Step `step`'s optimizer update from the gradients in place: clipped by the global squared
    norm `norm2`, at the step's learning rate; the gradients are dropped afterwards. The holders
    and the keepers of shadow copies run exactly this (engine/step/apply.py, shadows.py)."""
    scale_grads(params, clip_coefficient(norm2, cfg.optimizer.grad_clip))
    set_lr(optimizer, step, cfg)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
