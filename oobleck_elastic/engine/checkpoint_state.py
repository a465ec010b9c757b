"""The trainer's state as checkpoints read and write it (`CheckpointState`, torch's `Stateful`).

What leaves the worker is portable: full tensors (not this tensor-parallel lane's shard), without
the padded vocabulary rows (models/vocab.py), on the CPU, by layer index and local name.
Invariant: a checkpoint depends on neither the plan, nor the tensor-parallel degree, nor
`pad_vocab_to`; `load_state_dict` installs one into whatever layers the worker owns now.
docs/recovery.md tells when checkpoints are saved and restored.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..config import JobConfig
from ..models.tensor_parallel import from_full, local, to_full, wrap_like
from ..models.vocab import is_vocab_param, pad_rows, padded_vocab_size, unpad_rows
from .step.optim import adamw_step
from .step.state import WorkerState

__all__ = ["CheckpointState"]


class CheckpointState:
    """A trainer's `WorkerState` in and out of checkpoints (module docstring); `state` returns the
    trainer's current one (an entry replaces it)."""

    def __init__(self, cfg: JobConfig, state: Callable[[], WorkerState]) -> None:
        self.cfg, self._state = cfg, state

    @property
    def state(self) -> WorkerState:
        return self._state()

    def _portable(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A full tensor as it leaves the worker: without the padded vocabulary rows (models/vocab.py)."""
        real = self.state.layer_model.vocab_size
        return unpad_rows(t, real) if real is not None and is_vocab_param(name) else t

    def _installable(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A full tensor from outside (a checkpoint) as the layer holds it: padded again."""
        real = self.state.layer_model.vocab_size
        if real is not None and is_vocab_param(name):
            t = pad_rows(t, padded_vocab_size(real, self.cfg.model.pad_vocab_to))
        return t

    def layer_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Owned layers' parameters, detached copies on the CPU, by layer index and local name."""
        return {
            i: {
                n: self._portable(n, to_full(layer, n, p.detach())).to("cpu", copy=True)
                for n, p in layer.named_parameters()
            }
            for i in self.state.owned
            for layer in [self.state.layer_model.held(i)]
        }

    def optimizer_state(self) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
        """Owned layers' optimizer state (e.g. exp_avg, exp_avg_sq, step) by layer and name, on the CPU."""
        out: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        assert self.state.optimizer is not None
        for i in self.state.owned:
            layer = self.state.layer_model.held(i)
            for n, p in layer.named_parameters():
                st = self.state.optimizer.state.get(p, {})
                out.setdefault(i, {})[n] = {
                    k: (
                        v.detach().to("cpu", copy=True)
                        if k == "step"
                        else self._portable(n, to_full(layer, n, v.detach())).to("cpu", copy=True)
                    )
                    for k, v in st.items()
                    if torch.is_tensor(v)
                }
        return out

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds of this worker (torch's Stateful): the next step to run, and the
        owned layers' parameters and optimizer state by layer index and local name, on the CPU."""
        return {
            "next_step": self.state.committed_step + 1,
            "layers": self.layer_state(),
            "optimizer": self.optimizer_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Install a `state_dict` (of any plan) for the layers this worker owns now: weights are
        copied into the parameters, optimizer moments and AdamW's `step` go to the parameters'
        device; training goes on at `next_step`. Layers missing from `state`
        or a parameter missing from a layer raise KeyError naming them."""
        assert self.state.optimizer is not None
        layers, optim = state["layers"], state.get("optimizer", {})
        for i in self.state.owned:
            if i not in layers:
                raise KeyError(f"the state has no layer {i}")
            layer = self.state.layer_model.held(i)
            for name, p in layer.named_parameters():
                if name not in layers[i]:
                    raise KeyError(f"the state's layer {i} has no parameter '{name}'")
                with torch.no_grad():  # this lane's shard of the full tensor (all of it without tensor parallelism)
                    local(p).copy_(from_full(layer, name, self._installable(name, layers[i][name])))
                moments = optim.get(i, {}).get(name)
                if moments:
                    self.state.optimizer.state[p] = {
                        k: adamw_step(v, local(p))
                        if k == "step"
                        else wrap_like(
                            p,
                            from_full(layer, name, self._installable(name, torch.as_tensor(v))).to(p.device, copy=True),
                        )
                        for k, v in moments.items()
                    }
        self.state.committed_step = self.state.synced_step = int(state["next_step"]) - 1
