"""The commit: one MAX all-reduce of every worker's `CommitVote`, the point of exactly-once steps.

A worker calls `optimizer.step()` only after the commit returns, and it returns only once every
worker has finished the step's gradient sums and norm; so if any worker applied step s, every
survivor holds s's synchronised gradients: after a failure they roll s forward if anyone
committed it, else replay it (docs/recovery.md). What the workers must agree on at a step
boundary rides on it as typed fields, each with its rule (`_largest`, `_by_rank`, `_smallest`),
packed into one float64 tensor (`pack`, `unpack`, `combine`): the newest generation seen, peak
memory, the guard's running maximum, a stop request, compute seconds, the entry's window, and
device groups that reported an error after their waits (`refuse_errored`: nobody applies the step).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..resilience.errors import GroupErrored
from ..resilience.progress import STEP_PROGRESS, Progress

__all__ = ["CommitVote", "combine", "commit", "own_slot", "refuse_errored"]


@dataclass(frozen=True)
class _Rule:
    """How a field of the vote travels and reduces (module docstring)."""

    by_rank: bool
    """One slot per rank (a worker fills its own) rather than one slot."""
    kind: type
    """`int` or `float`: what a slot reads back as."""
    wire: torch.dtype
    """The precision a value is rounded to on its way into the float64 tensor."""
    optional: bool = False
    """`None` travels as -1, and a negative slot reads back as `None`."""
    negated: bool = False
    """The value travels negated, so the MAX gives the smallest."""

    def encode(self, value: Any) -> Any:
        if self.optional and value is None:
            return -1
        return -value if self.negated else value

    def decode(self, slot: float) -> Any:
        if self.optional and slot < 0:
            return None
        return self.kind(-slot if self.negated else slot)


def _largest(kind: type, *, optional: bool = False, wire: torch.dtype = torch.float32, default: Any = None) -> Any:
    """A one-slot field: the commit gives the largest value of any worker. An optional field's None
    travels as -1 (never wins; any negative reads back as None). `wire`: the one-slot fields travel
    rounded to float32, the protocol's wire format (changing it would move the step guard's
    threshold in its eighth digit); Unix times travel as float64 (float32 is off by minutes).
    `default`: the value of a vote that leaves the field out (None: it must be given)."""
    metadata = {"vote": _Rule(False, kind, wire, optional)}
    return field(metadata=metadata) if default is None else field(default=default, metadata=metadata)


def _smallest(kind: type, *, wire: torch.dtype = torch.float32) -> Any:
    """A one-slot field that travels negated: the commit gives the smallest value of any worker."""
    return field(metadata={"vote": _Rule(False, kind, wire, negated=True)})


def _by_rank() -> Any:
    """A field of one float64 slot per rank: the commit gives every worker's value by rank (a
    worker fills its own slot, `own_slot`, and leaves the others 0: the values are never negative)."""
    return field(metadata={"vote": _Rule(True, float, torch.float64)})


@dataclass(frozen=True)
class CommitVote:
    """One worker's vote, or (from `commit`, `unpack`, `combine`) the generation's agreed one."""

    generation: int = _largest(int)
    """The newest plan generation seen: every worker leaves for the agreed one at this boundary."""
    peak_rss_bytes: int = _largest(int)
    """Peak resident memory (engine/telemetry/memory.py)."""
    peak_device_bytes: Optional[int] = _largest(int, optional=True)
    """Peak device memory (None off CUDA)."""
    max_loss: float = _largest(float)
    """The largest loss of any applied step (the step guard's spike threshold)."""
    rejections: int = _largest(int)
    """How many times this step was rejected by the step guard before this run of it."""
    stop: int = _largest(int)
    """1 when this worker saw a request to stop the job (`ControlPlane.stop_requested`): every
    worker stops at this boundary."""
    entry_began: float = _smallest(float, wire=torch.float64)
    """Unix time this worker began entering the current generation (the agreed vote: the first)."""
    entry_ended: float = _largest(float, wire=torch.float64)
    """Unix time this worker had entered it (the agreed vote: the last)."""
    compute_s: tuple[float, ...] = _by_rank()
    """Compute seconds in the step, by rank (a worker's own vote: its own slot, 0 elsewhere)."""
    errored_groups: int = _largest(int, default=0)
    """How many of this worker's device groups reported an error after the step's waits
    (engine/entry/devices.py `group_errors`); the agreed vote: the most of any worker, and any
    makes every worker refuse the step (`refuse_errored`)."""

    def __post_init__(self) -> None:
        widths = {len(getattr(self, f.name)) for f, rule in _rules() if rule.by_rank}
        if len(widths) > 1:
            raise ValueError(f"a commit vote's per-rank fields must have one length (one slot per rank): {widths}")

    @property
    def world_size(self) -> int:
        """The ranks the vote has slots for."""
        return next((len(getattr(self, f.name)) for f, rule in _rules() if rule.by_rank), 0)

    @classmethod
    def layout(cls, world_size: int) -> dict[str, slice]:
        """Each field's slots in the packed tensor of a vote over `world_size` ranks, in order."""
        out, start = {}, 0
        for f, rule in _rules():
            width = world_size if rule.by_rank else 1
            out[f.name], start = slice(start, start + width), start + width
        return out

    @classmethod
    def size(cls, world_size: int) -> int:
        """Slots of the packed tensor of a vote over `world_size` ranks."""
        return max((s.stop for s in cls.layout(world_size).values()), default=0)

    def pack(self) -> torch.Tensor:
        """The flat float64 tensor of `layout(world_size)` that the commit all-reduces: the fields in
        declaration order. Every rule is a MAX, so one MAX all-reduce is the field-wise reduction; a
        feature that needs the workers to agree on something adds a field with its rule."""
        layout = self.layout(self.world_size)
        out = torch.zeros(self.size(self.world_size), dtype=torch.float64)
        for f, rule in _rules():
            value = getattr(self, f.name)
            values = [rule.encode(v) for v in value] if rule.by_rank else [rule.encode(value)]
            out[layout[f.name]] = torch.tensor(values, dtype=rule.wire)
        return out

    @classmethod
    def unpack(cls, packed: torch.Tensor, *, world_size: int) -> "CommitVote":
        """The vote `packed` holds (a `pack`ed vote over `world_size` ranks, reduced or not);
        ValueError when it has another shape or dtype."""
        size = cls.size(world_size)
        if packed.dtype != torch.float64 or tuple(packed.shape) != (size,):
            names = ", ".join(f"{name} x {s.stop - s.start}" for name, s in cls.layout(world_size).items())
            raise ValueError(
                f"a commit vote over {world_size} ranks is a flat float64 tensor of {size} slots ({names}); "
                f"got shape {tuple(packed.shape)} of {packed.dtype}"
            )
        values: dict[str, Any] = {}
        for (f, rule), where in zip(_rules(), cls.layout(world_size).values()):
            slots = packed[where].tolist()
            values[f.name] = tuple(rule.decode(s) for s in slots) if rule.by_rank else rule.decode(slots[0])
        return cls(**values)


def _rules() -> list[tuple[Any, _Rule]]:
    """The vote's fields with their rules, in declaration order."""
    return [(f, f.metadata["vote"]) for f in fields(CommitVote)]


def own_slot(rank: int, world_size: int, value: float) -> tuple[float, ...]:
    """A per-rank field of one worker's vote: `value` in its own slot, 0 in the others."""
    return tuple(value if r == rank else 0.0 for r in range(world_size))


def combine(votes: Sequence[CommitVote]) -> CommitVote:
    """What the commit all-reduce makes of `votes`, field by field in plain Python: the largest
    value of each one-slot field (`None` only when every vote has `None`), the largest value of
    each per-rank slot (for values the wire carries exactly: see `_largest`)."""
    if not votes:
        raise ValueError("no votes to combine")
    values: dict[str, Any] = {}
    for f, rule in _rules():
        column = [getattr(v, f.name) for v in votes]
        if rule.by_rank:
            values[f.name] = tuple(max(slot) for slot in zip(*column))
        else:
            values[f.name] = rule.decode(max(rule.encode(v) for v in column))
    return CommitVote(**values)


def commit(
    vote: CommitVote,
    *,
    group: Optional[dist.ProcessGroup],
    progress: Progress = STEP_PROGRESS,
    while_waiting: Callable[[], None] = lambda: None,
) -> CommitVote:
    """The COMMIT (module docstring): one MAX all-reduce of this worker's `vote` over `group` (the
    generation's stages; None: the world), a CPU tensor, so over gloo whatever the data backend.
    Returns only once every worker has joined; the agreed vote, the same on every worker. Its wait
    is marked on `progress` (engine/resilience/progress.py); `while_waiting` runs inside it (an
    injected block, engine/resilience/faults.py)."""
    packed = vote.pack()
    work = dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group, async_op=True)
    with progress.waiting(work):
        while_waiting()
        work.wait()
    return CommitVote.unpack(packed, world_size=vote.world_size)


def refuse_errored(agreed: CommitVote, *, step: int, mine: Sequence[str] = ()) -> None:
    """Raise `GroupErrored` when the agreed vote says some worker's device group reported an error
    after the step's waits: its gradients or activations may be partial, so no worker applies step
    `step`; the communication error sends every worker to the next generation, which replays it
    (nobody committed it, so nobody rolls it forward). `mine`: this worker's own errors, named in
    the message."""
    if agreed.errored_groups:
        whose = "; ".join(mine) if mine else "on another worker"
        raise GroupErrored(
            f"step {step} refused by every worker: a device group reported an error after its waits "
            f"({whose}); the step is replayed in the next generation"
        )
