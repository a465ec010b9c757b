"""What a worker holds across generations (`WorkerState`): its layers, their optimizer, the
last committed and synchronised steps and the plan it entered last. A step writes it only through
engine/step/apply.py; an entry (engine/entry/enter.py) returns the next one. Invariant:
`committed_step` is the last step whose update is applied here, exactly once (docs/recovery.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ...models import LayerModel
from ...models.tensor_parallel import local
from ...planning import Plan
from .shadows import ShadowStore

__all__ = ["WorkerState"]


@dataclass
class WorkerState:
    """What a worker holds across generations (`Trainer.state`); an entry returns the next one."""

    layer_model: LayerModel
    """Every layer's name and shape; the owned ones built (the others None)."""
    owned: list[int] = field(default_factory=list)
    """Indices of the layers of this worker's stage."""
    optimizer: Optional[torch.optim.Optimizer] = None
    """The optimizer over the owned layers' parameters (None before the first generation)."""
    plan: Optional[Plan] = None
    """The plan of the generation entered last."""
    generation: int = 0
    """The generation entered last (0: none yet)."""
    rank: int = 0
    """This worker's rank in that generation."""
    committed_step: int = -1
    """The last step whose optimizer update was applied."""
    synced_step: int = -1
    """The last step whose gradients and norm are fully synchronised here."""
    synced_norm2: float = 0.0
    """The squared global gradient norm of `synced_step`."""
    max_loss: float = 0.0
    """The largest loss of any step applied here (the step guard's spike threshold, engine/resilience/guard.py)."""
    params: list[nn.Parameter] = field(default_factory=list)
    """The owned layers' parameters, each once (tied ones are shared), in the optimizer's order."""
    shadows: Optional[ShadowStore] = None
    """The host-memory shadow copies this worker keeps (shadows.py), if any."""

    def held_bytes(self) -> int:
        """Bytes of the parameters (this lane's shards) and optimizer state this worker holds."""
        optimizer_state = self.optimizer.state if self.optimizer is not None else {}
        tensors = {
            id(t): t
            for p in self.params
            for t in [local(p), *(local(v) for v in optimizer_state.get(p, {}).values() if torch.is_tensor(v))]
        }
        return sum(t.numel() * t.element_size() for t in tensors.values())
