"""Activation checkpointing (`training.activation_checkpoint: full`): a layer keeps only its input
and runs its forward once more when its backward first needs what it dropped.

`Recomputed` runs a layer (eager or compiled) under saved-tensor hooks (`_Frame`): each tensor
autograd would save is dropped and numbered; the first unpack runs the layer again on the kept
input, with the forward's RNG and autocast state, and keeps every tensor it saves, for all the
passes of that microbatch's backward. So zero-bubble's split backward recomputes once, in its
input pass, and its weight pass reads the same tensors (torch's non-reentrant checkpoint would
recompute in each pass); they are freed with the graph. Compiled layers keep their saved tensors
outside autograd and replay their compiled forward graph instead (split_layer.py). docs/training.md,
"Activation checkpointing".
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

__all__ = ["Recomputed", "RngState", "recomputed"]


class RngState:
    """The random generators' state at a forward (CPU, and the device's on CUDA), to replay it with
    the same dropout masks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @property
    def nbytes(self) -> int:
        """The bytes this state keeps (the CPU generator's, and the device's)."""
        return self.cpu.numel() + (self.cuda.numel() if self.cuda is not None else 0)

    @contextmanager
    def replayed(self) -> Iterator[None]:
        """Run the block from this state; the generators are as they were after it."""
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


class _Frame:
    """One forward of a layer on one microbatch: its input, the state to replay it, and (after the
    first unpack) the tensors its replay saved, by the order autograd saved them."""

    def __init__(self, layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
        self.layer, self.input, self.requires_grad = layer, x.detach(), x.requires_grad
        self.rng = RngState(x.device)
        kind = x.device.type
        self.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        self.saved = 0
        self.recomputed: Optional[list[torch.Tensor]] = None

    def pack(self, _tensor: torch.Tensor) -> int:
        self.saved += 1
        return self.saved - 1

    def unpack(self, index: int) -> torch.Tensor:
        if self.recomputed is None:
            self.recomputed = self._replay()
        return self.recomputed[index]

    def _replay(self) -> list[torch.Tensor]:
        saved: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> None:
            saved.append(t.detach())

        kind, enabled, dtype = self.autocast
        with self.rng.replayed():
            x = self.input.detach().requires_grad_(self.requires_grad)
            with torch.enable_grad(), torch.autocast(kind, dtype=dtype, enabled=enabled):
                with torch.autograd.graph.saved_tensors_hooks(keep, _never_unpacked):
                    self.layer(x)
        if len(saved) != self.saved:
            raise RuntimeError(
                f"recomputing a layer saved {len(saved)} tensors where its forward saved {self.saved}: "
                "its forward is not deterministic in what it saves"
            )
        return saved


def _never_unpacked(_handle: Any) -> torch.Tensor:
    raise RuntimeError("a replayed forward's own graph is never run backward")


def recomputed(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, keeping only `x` for the backward (module docstring)."""
    if not torch.is_grad_enabled():  # no backward will need anything: nothing to drop
        return layer(x)
    frame = _Frame(layer, x)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return layer(x)


class Recomputed(nn.Module):
    """`layer`, its activations recomputed in the backward (module docstring). A compiled layer
    recomputes in its own graphs instead (split_layer.py)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(self.layer, x)

    @staticmethod
    def kept_bytes(x: torch.Tensor) -> int:
        """What a forward on `x` keeps for the backward: `x` and the random state."""
        return x.numel() * x.element_size() + RngState(x.device).nbytes
