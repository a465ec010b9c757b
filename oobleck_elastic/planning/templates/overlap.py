"""How much of the cross-replica gradient all-reduce the pipeline leaves exposed.

As the engine posts each layer's all-reduce once its gradient is final (after the stage's last
backward, B, or its W under zero-bubble), each device's reductions run one after another on its
link (`Links.all_reduce_s`); the exposed part is how far the last one ends after the schedule,
charged once per step (`exposed_sync_s`). Simplifications: each pipeline is costed alone, and
reductions do not slow the pipeline's own sends. docs/planning.md.
"""

from __future__ import annotations

from typing import Sequence

from ..comm import Links

__all__ = ["Ready", "exposed_sync_s", "layer_ready_times"]

Ready = tuple[float, int]
"""(when a layer's gradient is final, its gradient bytes)."""


def layer_ready_times(
    start: float, end: float, backward_s: Sequence[float], grad_bytes: Sequence[int], *, split: bool
) -> list[Ready]:
    """The layers of one stage, first to last, whose last backward (B, or W when `split`) ran
    from `start` to `end`: when each is final (module docstring) and its bytes."""
    if split or end <= start:
        return [(end, b) for b in grad_bytes]
    total = sum(backward_s)
    out: list[Ready] = []
    done = 0.0
    for t, b in zip(reversed(backward_s), reversed(grad_bytes)):
        done += t
        share = done / total if total > 0 else 1.0
        out.append((start + (end - start) * share, b))
    return out[::-1]


def exposed_sync_s(devices: Sequence[Sequence[Ready]], makespan_s: float, links: Links, replicas: int) -> float:
    """The all-reduce time left after the schedule's end (module docstring): each device's
    layers reduced one after another in the order they are final."""
    if replicas < 2:
        return 0.0
    last = makespan_s
    for ready in devices:
        free = float("-inf")
        for when, nbytes in sorted(ready):
            free = max(free, when) + links.all_reduce_s(nbytes, replicas, same_node=False)
        last = max(last, free)
    return max(0.0, last - makespan_s)
