"""How much of the cross-replica gradient all-reduce the pipeline leaves exposed.

The engine posts each layer's all-reduce as soon as the layer's gradient is final
(engine/generation/grad_sync.py): after the stage's last backward of the step has passed through
that layer. Within a full backward B the layers finish from the stage's last to its first, so
layer j is final at

    start(B) + (end(B) - start(B)) x (backward of the stage's layers >= j) / (backward of the stage)

A schedule that splits the backward (zero-bubble: I, then W) assigns the weight gradients in the
W pass, all at once: every layer of the stage is final when its last W ends. A device's
reductions run one after another on its link (each layer's ring all-reduce among the replicas,
`Links.all_reduce_s`), each starting when its layer is final and the previous one is done. The
step ends when the schedule has ended and every device's last reduction is done, so the exposed
all-reduce is

    max(0, max over devices of (the end of its last reduction) - the schedule's end)

charged once per step (`exposed_sync_s`). Simplifications: a reduction also waits for the other
replicas' holders, which run other templates and finish the layer at other times (each pipeline
is costed alone); reductions do not slow the pipeline's own sends; tied parameters (GPT-2's
embedding and head) are reduced with their layers.
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
