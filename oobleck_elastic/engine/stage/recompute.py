"""Activation checkpointing (`training.activation_checkpoint: full`): a layer keeps only its input
and runs its forward again when the backward needs what it dropped.

`Recomputed` wraps one layer (eager or compiled) in torch's non-reentrant `torch.utils.checkpoint`,
which drops the tensors the layer's backward would read and recomputes them on first use, with
the RNG and autocast state of the forward. The autograd graph is the layer's own, so gradients
equal eager ones under every schedule. docs/training.md, "Activation checkpointing".
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Recomputed"]


class Recomputed(nn.Module):
    """`layer`, its activations recomputed in the backward (module docstring)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # no backward will need anything: nothing to drop
            return self.layer(x)
        return checkpoint(self.layer, x, use_reentrant=False)
