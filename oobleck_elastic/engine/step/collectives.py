"""The control collectives of a generation: which ones an entry, a step and a checkpoint issue,
in one order decided here, on a group that carries nothing else.

Every worker calls `entry_collectives`, `step_collectives` and `retake_collectives` with the
same inputs (the plan, and values an earlier control collective agreed), so every member issues
the same control collectives in the same order by construction. They run on the generation's
control group (`control_group`), never on a group that carries point-to-point traffic (layer
and shadow transfers): gloo counts a rank's sends and receives in its group's sequence number,
which torch's checker (TORCH_DISTRIBUTED_DEBUG=DETAIL) compares at every collective, so a
collective after transfers between some members reads as a mismatch. docs/training.md.
"""

from __future__ import annotations

from datetime import timedelta
from enum import Enum
from typing import Optional

import torch.distributed as dist

from ...planning import Plan
from ..resilience import nccl_rules
from ..resilience.fingerprint import is_check_step

__all__ = [
    "Collective",
    "checked_timeout",
    "control_group",
    "entry_collectives",
    "retake_collectives",
    "step_collectives",
]


class Collective(str, Enum):
    """One control collective, named by what it agrees on."""

    AGREE_STEP = "agree_step"
    """Entry: MAX of (generation, committed step, synchronised step)."""
    AGREE_LAYOUTS = "agree_layouts"
    """Entry: what every member holds (layers, shadow copies)."""
    RELEASE_DONORS = "release_donors"
    """Entry: donors leave once every transfer has landed."""
    NORM_AND_LOSS = "norm_and_loss"
    """Step: SUM of the squared gradient norm and the loss."""
    COMMIT = "commit"
    """Step: the commit vote (engine/step/commit.py)."""
    FINGERPRINTS = "fingerprints"
    """Step: the replica fingerprints' all-gather (repairs follow on holder groups)."""
    CHECKPOINT_EXISTS = "checkpoint_exists"
    """Retake: MAX of "rank 0 found a complete checkpoint of the step"."""
    CHECKPOINT_ROOM = "checkpoint_room"
    """Save: SUM of the bytes each member writes, rank 0's free bytes and previous checkpoint's
    size, so every member takes the same decision to save or skip; nobody writes before the old
    directory is set aside."""
    CHECKPOINT_BARRIER = "checkpoint_barrier"
    """Save: rank 0 completes the checkpoint after all wrote."""


def entry_collectives(plan: Plan) -> tuple[Collective, ...]:
    """The entry into `plan`'s generation, over its stages and donors."""
    release = (Collective.RELEASE_DONORS,) if plan.donors else ()
    return (Collective.AGREE_STEP, Collective.AGREE_LAYOUTS, *release)


def step_collectives(step: int, *, applied: bool, fingerprint_interval: int) -> tuple[Collective, ...]:
    """Step `step` (0-based). `applied`: the step guard's verdict, a function of the agreed loss,
    norm and running maximum (engine/resilience/guard.py), so the same on every worker."""
    check = (Collective.FINGERPRINTS,) if applied and is_check_step(step, fingerprint_interval) else ()
    return (Collective.NORM_AND_LOSS, Collective.COMMIT, *check)


def save_collectives(*, fits: bool = True) -> tuple[Collective, ...]:
    """A checkpoint save (engine/checkpointing.py `save`): the room, then the writes unless the
    agreed room (`fits`, checkpoint/directory.py `room_for_save`) says it does not fit."""
    if not fits:
        return (Collective.CHECKPOINT_ROOM,)
    return (Collective.CHECKPOINT_ROOM, Collective.CHECKPOINT_BARRIER)


def retake_collectives(*, exists: Optional[bool]) -> tuple[Collective, ...]:
    """A retake (engine/checkpointing.py): the look, then a save unless the agreed look found a
    complete checkpoint (`exists`; None: not looked yet, only the look is decided)."""
    if exists is None or exists:
        return (Collective.CHECKPOINT_EXISTS,)
    return (Collective.CHECKPOINT_EXISTS, *save_collectives())


def control_group(members: int, timeout: timedelta) -> dist.ProcessGroup:
    """A generation's control group over ranks 0..members-1 (every member creates it, in the same
    place of its group creations); it carries only the collectives above, on CPU tensors (gloo on
    every device: a host group, exempt from NCCL's rules, docs/nccl.md)."""
    return nccl_rules.host_group(dist.new_group(list(range(members)), timeout=timeout))


def checked_timeout(connect: timedelta, run: timedelta) -> timedelta:
    """The timeout a group that carries collectives is created with: `connect` (the short join
    timeout, so that a peer that died meanwhile is given up on soon), except under
    TORCH_DISTRIBUTED_DEBUG=DETAIL: torch's checker then runs a barrier before every collective
    under the creation timeout, which no later `set_timeout` reaches, so a worker slower than the
    join timeout would fail it; `run` (the communication timeout) then."""
    return max(connect, run) if dist.get_debug_level() == dist.DebugLevel.DETAIL else connect
