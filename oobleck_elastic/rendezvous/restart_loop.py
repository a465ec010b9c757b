"""The bound on restarts without progress (`fault_tolerance.max_restarts_without_progress`).

A restart is a generation on exactly the previous plan's nodes: its workers saw their generation
break and every node answered the roll call. A defect that breaks every generation before its
first step (an error that looks like a peer's failure) would have the leader restart forever.
`restart_verdict`, a pure function of the last generations (their nodes, the error that ended
each) and of the generation of the last committed step, says when to close the job as failed
instead, with one line naming those errors; `read_attempts` gathers its input from etcd for the
leader. The rule: docs/recovery.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..etcd.protocols import KVReader
from ..logs import clip
from ..planning import Plan
from ..records.errors import ErrorRecord
from ..records.keys import Keys
from ..records.read import read_progress

KEY = "fault_tolerance.max_restarts_without_progress"


@dataclass(frozen=True)
class Attempt:
    """One generation, as the restart bound sees it."""

    generation: int
    nodes: tuple[str, ...]
    """The nodes of its plan."""
    error: Optional[ErrorRecord] = None
    """The error of the first worker that saw it break before it committed a step there (None:
    none was recorded)."""


@dataclass(frozen=True)
class RestartVerdict:
    """Close the job as failed: the restarts made no progress."""

    reason: str
    """One line: the generations, the bound, and the error that ended each of them."""
    record: Optional[ErrorRecord]
    """The last of those errors, with its traceback (stored as the job's `errors` record)."""


def restart_verdict(
    attempts: Sequence[Attempt], *, next_nodes: Sequence[str], progress: int, bound: int
) -> Optional[RestartVerdict]:
    """None to go on and publish the next generation on `next_nodes`; a verdict to close the job
    as failed instead. It fails when the next generation is a restart (on the last attempt's
    nodes) and the last `bound` + 1 attempts ran on these same nodes, in consecutive generations,
    all after generation `progress` (that of the last committed step; 0: none): the first attempt
    after a step or a membership change, then `bound` restarts, none of which committed a step.
    `attempts`: generations oldest first, the one that just broke last. `bound` 0: never."""
    if bound <= 0 or not attempts or tuple(next_nodes) != attempts[-1].nodes:
        return None
    streak: list[Attempt] = []
    for attempt in reversed(attempts):
        follows = not streak or attempt.generation == streak[-1].generation - 1
        if not follows or attempt.nodes != attempts[-1].nodes or attempt.generation <= progress:
            break
        streak.append(attempt)
    if len(streak) <= bound:
        return None
    streak = streak[bound::-1]  # the last bound + 1, oldest first
    errors: dict[str, list[int]] = {}  # what ended them -> generations, in order of first appearance
    for attempt in streak:
        errors.setdefault(_what(attempt.error), []).append(attempt.generation)
    ended = "; ".join(f"{what}, in generation{'s' if len(g) > 1 else ''} {_spans(g)}" for what, g in errors.items())
    reason = (
        f"generations {streak[0].generation}-{streak[-1].generation} on the same {len(streak[-1].nodes)} node(s) "
        f"all broke before a step committed: {bound} restart(s) in a row without progress ({KEY}={bound}); "
        f"what ended them: {ended}"
    )
    last = next((a.error for a in reversed(streak) if a.error is not None), None)
    return RestartVerdict(reason=clip(reason, 1000), record=last)


def _what(record: Optional[ErrorRecord]) -> str:
    if record is None:
        return "no worker recorded why"
    return f"{clip(record.error, 200)} at step {record.step} on {record.node} local rank {record.local_rank}"


def _spans(generations: Sequence[int]) -> str:
    """Sorted generations as ranges: [3, 4, 5, 7] -> "3-5, 7"."""
    spans: list[list[int]] = []
    for g in generations:
        if spans and g == spans[-1][1] + 1:
            spans[-1][1] = g
        else:
            spans.append([g, g])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def read_attempts(reader: KVReader, keys: Keys, current: Plan, bound: int) -> tuple[list[Attempt], int]:
    """(attempts, progress) for `restart_verdict` about a restart after `current`: the generation
    of the last committed step (`progress` key; 0: none), and the generations since it, back to
    `bound` + 1 of them (`plans/<generation>`, and what ended each: `failures/g<generation>`, or
    first the `errors` record of a worker's own error in that generation). When no more than `bound`
    generations came after the last step, nothing else is read (no loop can be shown yet): the
    common case costs one read per restart."""
    rec = read_progress(reader, keys)
    progress = rec.generation if rec is not None else 0
    if bound <= 0 or current.generation - progress <= bound:
        return [], progress
    own = ErrorRecord.parse(reader.get_json(keys.errors)[0])

    def ended(generation: int) -> Optional[ErrorRecord]:  # a worker's own error first: its peers saw its exit
        if own is not None and own.generation == generation:
            return own
        return ErrorRecord.parse(reader.get_json(keys.failure(generation))[0])

    attempts = [Attempt(current.generation, current.nodes, ended(current.generation))]
    for generation in range(current.generation - 1, max(progress, current.generation - bound - 1), -1):
        data, _ = reader.get_json(keys.plan_at(generation))
        nodes = data.get("nodes") if isinstance(data, dict) else None
        if not isinstance(nodes, list):
            break  # history missing or malformed: the streak cannot be shown to go further back
        attempts.insert(0, Attempt(generation, tuple(str(n) for n in nodes), ended(generation)))
        if attempts[0].nodes != current.nodes:
            break
    return attempts, progress


__all__ = ["Attempt", "KEY", "RestartVerdict", "read_attempts", "restart_verdict"]
