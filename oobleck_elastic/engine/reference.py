"""The single-process reference: one `Trainer` holding every layer, the weights a job must match.

`single_process` enters the one-worker plan (one stage holding every layer) on an in-memory store
(engine/control.py); tests and benchmarks compare a job's weights with it (docs/design.md).
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import JobConfig
from ..models import num_layers
from .trainer import Trainer

__all__ = ["single_process"]


def single_process(cfg: JobConfig, *, dataset: Any, device: str | torch.device = "cpu") -> Trainer:
    """The single-process reference: a trainer that entered the one-worker plan (one stage holding
    every layer) on an in-memory store. It initialises this process's default process group (a
    world of one); `close()` it before making another."""
    from .control import LocalControl

    control = LocalControl(cfg, num_layers(cfg.model))
    plan = control.plan()
    assert plan is not None
    return Trainer(
        cfg, dataset=dataset, plan=plan, rank=0, store=control.store_for(plan.generation, cfg), device=device
    )
