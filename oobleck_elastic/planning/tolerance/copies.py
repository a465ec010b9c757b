"""Copies of each layer in a plan, and whether they meet the fault-tolerance target f.

A layer's copies are the distinct NODES holding it (a stage and its lanes count once; `extra`
adds copies kept elsewhere, such as host-memory shadows, unless the node holds the layer on its
devices). With fewer than f+1 copies of some layer, `shortfall` names it, and the engine retakes
a checkpoint. docs/shadows.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from ..plan.plan import Plan, device_holders

__all__ = ["Shortfall", "layer_copies", "shortfall"]


def layer_copies(plan: Plan, extra: Optional[Mapping[int, Iterable[str]]] = None) -> list[int]:
    """Copies of every layer of `plan` (index = layer): the distinct nodes holding it, on their
    devices or, by `extra` ({layer: nodes}), elsewhere."""
    holders = [set(nodes) for nodes in device_holders(plan)]
    for layer, nodes in (extra or {}).items():
        if not 0 <= layer < plan.num_layers:
            raise ValueError(f"extra copies of layer {layer}: the plan has layers 0..{plan.num_layers - 1}")
        holders[layer].update(nodes)
    return [len(h) for h in holders]


@dataclass(frozen=True)
class Shortfall:
    """Some layer has fewer copies than f+1."""

    layer: int
    """The first layer with the fewest copies."""
    copies: int
    """Its copies."""
    needed: int
    """f+1."""
    short: tuple[int, ...]
    """Every layer with fewer than f+1 copies."""
    num_layers: int
    """Layers of the model."""

    def describe(self) -> str:
        """`layer 3 has 1 copy < f+1=2` (and how many layers are short, when more than one)."""
        copies = f"{self.copies} cop{'y' if self.copies == 1 else 'ies'}"
        text = f"layer {self.layer} has {copies} < f+1={self.needed}"
        if len(self.short) > 1:
            text += f" ({len(self.short)} of {self.num_layers} layers have fewer than {self.needed})"
        return text


def shortfall(
    plan: Plan, extra: Optional[Mapping[int, Iterable[str]]] = None, *, f: Optional[int] = None
) -> Optional[Shortfall]:
    """The layers of `plan` with fewer than f+1 copies (`layer_copies`), f the plan's own unless
    given; None when every layer has f+1 or more."""
    needed = (plan.f if f is None else f) + 1
    copies = layer_copies(plan, extra)
    short = tuple(i for i, c in enumerate(copies) if c < needed)
    if not short:
        return None
    fewest = min(copies)
    return Shortfall(layer=copies.index(fewest), copies=fewest, needed=needed, short=short, num_layers=plan.num_layers)
