"""Optimizer, learning-rate schedule, loss scaling and gradient clipping, shared by the
single-process reference and the pipelined engine so both do exactly the same math.

- Loss: every microbatch's token cross-entropy is SUMMED and divided by the number of tokens in
  the GLOBAL batch, so summing gradients over microbatches, stages and replicas gives the
  gradient of the mean loss over the global batch, whatever the plan (docs/design.md, invariant 1).
- Clipping: the global gradient norm is computed from per-parameter squared sums (each
  parameter counted once in the whole job) and the same coefficient is applied everywhere.
- AdamW with decoupled weight decay on matrices only; LR warm-up then constant/linear/cosine.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import TrainingConfig


def token_sum_loss(global_tokens: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """loss_fn(logits, labels) = sum of token cross-entropies / global_tokens."""

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                               ignore_index=-100, reduction="sum") / global_tokens

    return loss_fn


def build_optimizer(params: Iterable[nn.Parameter], cfg: TrainingConfig) -> torch.optim.Optimizer:
    """AdamW (or SGD) over `params`; weight decay on tensors with >= 2 dims only."""
    params = list(dict.fromkeys(params))  # unique, in first-seen order
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [g for g in ({"params": decay, "weight_decay": o.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)


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
    if coefficient < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coefficient)
