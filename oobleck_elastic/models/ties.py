"""Tied parameters across (and inside) the layers of a flat layer list.

Once the layers are split into stages the members of a tie may live in different processes;
their gradients are summed across the stages that hold one. The story: docs/training.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch
from torch import nn

__all__ = ["TiedGroup", "find_tied_parameters", "describe_ties"]


@dataclass
class TiedGroup:
    """Parameters that are one tensor: a list of (layer index, parameter name inside the layer)."""

    members: list[tuple[int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.members = sorted((int(i), str(n)) for i, n in self.members)

    @property
    def layer_indices(self) -> list[int]:
        """The distinct layers holding a member, ascending."""
        return sorted({i for i, _ in self.members})

    @property
    def spans_layers(self) -> bool:
        """True when the members sit in more than one layer (grads must then be summed across
        whichever stages hold those layers)."""
        return len(self.layer_indices) > 1

    def names_in(self, layer_index: int) -> list[str]:
        """The member names that belong to one layer."""
        return [n for i, n in self.members if i == layer_index]


def _tensor_key(p: torch.Tensor) -> Hashable:
    if p.is_meta or p.numel() == 0:
        return ("id", id(p))
    st = p.untyped_storage()
    return ("storage", str(p.device), st.data_ptr(), p.storage_offset(), tuple(p.shape), p.stride())


def find_tied_parameters(layers: Sequence[nn.Module | None]) -> list[TiedGroup]:
    """Groups of parameter names (across all built layers) that share one tensor.

    `None` entries (layers not built in this process) are skipped. Groups come sorted by their
    first member; a model without ties gives an empty list.
    """
    groups: dict[Hashable, list[tuple[int, str]]] = {}
    for index, layer in enumerate(layers):
        if layer is None:
            continue
        for name, param in layer.named_parameters(remove_duplicate=False):
            groups.setdefault(_tensor_key(param), []).append((index, name))
    found = [TiedGroup(members) for members in groups.values() if len(set(members)) > 1]
    return sorted(found, key=lambda g: g.members[0])


def describe_ties(groups: Sequence[TiedGroup], names: Sequence[str]) -> str:
    """Human-readable ties, e.g. `embedding.wte.weight = head.lm_head.weight`; `none` if empty."""
    if not groups:
        return "none"
    parts = []
    for group in groups:
        parts.append(" = ".join(f"{names[i]}.{n}" if i < len(names) else f"layer{i}.{n}" for i, n in group.members))
    return "; ".join(parts)
