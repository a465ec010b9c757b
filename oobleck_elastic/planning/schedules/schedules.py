"""Pipeline schedules as action lists: what each device computes, in which order.

A `ScheduleAction` is one computation of one stage on one microbatch, written like torch's
schedule IR: `2F0`, `2B0`, or the zero-bubble split `2I0` / `2W0`. `schedule_order` builds the
per-device `Order` of `gpipe`, `1f1b`, `interleaved-1f1b`, `zero-bubble` (ZB-H1) and `zbv`, with
`stage_placement` (which device runs each stage). Invariant: these orders are exactly torch's
(`pipeline_order`, without idle slots); the tests compare them action for action. No torch is
imported here. docs/schedules.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache, partial
from itertools import chain, repeat
from typing import Callable, Iterable, Literal, NamedTuple

from ..errors import PlanningError

__all__ = ["SCHEDULES", "ScheduleAction", "Order", "ScheduleError", "schedule_order", "stage_placement"]

Kind = Literal["F", "B", "I", "W"]
SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "zbv")
"""Schedule names `schedule_order` knows."""


class ScheduleError(PlanningError):
    """A schedule that cannot be built or run; the message says which action and what to change."""


_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")


class ScheduleAction(NamedTuple):
    """One computation of one stage on one microbatch (a named tuple: the simulator hashes
    millions of them at scale, and a tuple hashes in C)."""

    stage: int
    """Stage index in pipeline order (0 = embedding side), over all chunks of all devices."""
    kind: Kind
    """F forward, B full backward, I input gradient, W weight gradient (I + W = B)."""
    microbatch: int
    """Microbatch index, 0 .. m - 1."""

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "ScheduleAction":
        """`ScheduleAction.parse("2F0")`: the inverse of str()."""
        found = _ACTION.match(text.strip())
        if found is None:
            raise ScheduleError(f"'{text}' is not an action: write stage, F/B/I/W, microbatch (e.g. 2F0)")
        return cls(int(found[1]), found[2], int(found[3]))  # type: ignore[arg-type]


_make_action = partial(tuple.__new__, ScheduleAction)
"""`_make_action((stage, kind, microbatch))`: a ScheduleAction without NamedTuple's Python-level
constructor (the planner builds millions)."""


@dataclass(frozen=True)
class Order:
    """A schedule: per device, the actions it runs, in order."""

    name: str
    """The schedule's name (one of SCHEDULES, or anything for hand-made orders)."""
    devices: tuple[tuple[ScheduleAction, ...], ...]
    """devices[d]: device d's actions in the order it runs them."""
    num_stages: int
    """Stages over all devices (devices x chunks per device)."""
    microbatches: int
    """Microbatches per step."""

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def stage_devices(self) -> dict[int, int]:
        """Stage -> the device running it (ScheduleError when a stage runs on two devices)."""
        where: dict[int, int] = {}
        for d, actions in enumerate(self.devices):
            for s in sorted({a[0] for a in actions}):
                if where.setdefault(s, d) != d:
                    return self._stage_devices_error()
        return where

    def _stage_devices_error(self) -> dict[int, int]:
        """stage_devices' error: the first action, in device order, of a stage seen on an earlier device."""
        where: dict[int, int] = {}
        for d, actions in enumerate(self.devices):
            for a in actions:
                if where.setdefault(a.stage, d) != d:
                    raise ScheduleError(f"stage {a.stage} has actions on device {where[a.stage]} and device {d} ({a})")
        return where  # unreachable: stage_devices found a stage on two devices

    def __str__(self) -> str:
        return "\n".join(f"{d}: " + " ".join(map(str, acts)) for d, acts in enumerate(self.devices))

    @classmethod
    def parse(cls, text: str, *, name: str = "custom") -> "Order":
        """An order from lines of actions, one line per device (`str(order)` without the prefixes)."""
        rows = [line.split(":", 1)[-1].split() for line in text.strip().splitlines()]
        devices = tuple(tuple(ScheduleAction.parse(a) for a in row) for row in rows)
        flat = [a for row in devices for a in row]
        return cls(
            name=name,
            devices=devices,
            num_stages=1 + max((a.stage for a in flat), default=-1),
            microbatches=1 + max((a.microbatch for a in flat), default=-1),
        )


def schedule_order(name: str, devices: int, microbatches: int, chunks: int = 1) -> Order:
    """The action lists of schedule `name` on `devices` devices with `microbatches` microbatches
    and `chunks` stages per device (interleaved-1f1b and zero-bubble: any v >= 1; zbv: 2;
    1f1b and gpipe: 1). Raises ScheduleError naming what to change."""
    if devices < 1 or microbatches < 1 or chunks < 1:
        raise ScheduleError(
            f"a schedule needs >= 1 device, microbatch and chunk (got {devices}, {microbatches}, {chunks})"
        )
    if name in ("1f1b", "gpipe") and chunks != 1:
        raise ScheduleError(f"schedule {name} runs one stage per device (got chunks={chunks}): use interleaved-1f1b")
    if name == "zbv" and chunks != 2:
        raise ScheduleError(f"schedule zbv runs exactly 2 chunks per device (got chunks={chunks})")
    build: dict[str, Callable[[int, int, int], list[list[ScheduleAction]]]] = {
        "1f1b": lambda d, m, v: [_one_f_one_b(s, d, m) for s in range(d)],
        "gpipe": lambda d, m, v: [_gpipe(s, m) for s in range(d)],
        "interleaved-1f1b": lambda d, m, v: [_looped(r, d, m, v, zero_bubble=False) for r in range(d)],
        "zero-bubble": lambda d, m, v: [_looped(r, d, m, v, zero_bubble=True) for r in range(d)],
        "zbv": lambda d, m, v: [_zbv(r, d, m) for r in range(d)],
    }
    if name not in build:
        raise ScheduleError(f"unknown schedule '{name}': use one of {', '.join(SCHEDULES)}")
    lists = build[name](devices, microbatches, chunks)
    return Order(
        name=name,
        devices=tuple(tuple(a) for a in lists),
        num_stages=devices * chunks,
        microbatches=microbatches,
    )


def _gpipe(stage: int, m: int) -> list[ScheduleAction]:
    return [ScheduleAction(stage, "F", k) for k in range(m)] + [ScheduleAction(stage, "B", k) for k in range(m)]


def _one_f_one_b(stage: int, devices: int, m: int) -> list[ScheduleAction]:
    warmup = min(m, devices - stage)
    out = [ScheduleAction(stage, "F", k) for k in range(warmup)]
    for b in range(m):
        out.append(ScheduleAction(stage, "B", b))
        if warmup + b < m:
            out.append(ScheduleAction(stage, "F", warmup + b))
    return out


def _rounds(devices: int, m: int, chunks: int) -> int:
    """Microbatches per round of the looped schedules (depth-first groups of forwards). With one
    chunk per device the rounds change nothing (every forward is of the one chunk, and the warm-up
    of the chunks before the last is empty): all m run as one round, whatever m."""
    if chunks == 1:
        return m
    rounds = max(1, m // devices)
    if m % rounds:
        raise ScheduleError(
            f"interleaved schedules run microbatches in {rounds} rounds of equal size, and {m} "
            f"microbatches on {devices} devices do not divide into them: use a multiple of {rounds}"
        )
    return m // rounds


def _looped(rank: int, devices: int, m: int, v: int, *, zero_bubble: bool) -> list[ScheduleAction]:
    """Interleaved 1F1B or (zero_bubble) interleaved ZB-H1 on device `rank`, loop placement.
    The device's i-th forward (and i-th backward, i-th weight gradient) is of chunk (i // r) % v
    (backwards: v - 1 - that) and of microbatch (i // (r v)) r + i % r: each chunk sees its
    microbatches in rounds of r, in order. After the warm-up, backward j follows forward
    warm-up + j (while there are forwards) and, in zero-bubble, weight gradient j - rank."""
    per_round = _rounds(devices, m, v)
    total = m * v  # forwards (and backwards) of this device
    spread = 1 if zero_bubble else 2  # extra warm-up forwards per hop from the last device
    warmup = min((v - 1) * per_round + spread * (devices - 1 - rank), total)
    chunk, micro = _rounds_of(per_round, v, total)
    fwd_stage = [c * devices + rank for c in range(v)]
    bwd_stage = fwd_stage[::-1]
    fwd = _actions(map(fwd_stage.__getitem__, chunk), "F", micro)
    bwd = _actions(map(bwd_stage.__getitem__, chunk), "I" if zero_bubble else "B", micro)
    wgt = _actions(map(bwd_stage.__getitem__, chunk), "W", micro) if zero_bubble else []
    left = total - warmup  # backwards that a forward still follows
    late = min(rank, total) if zero_bubble else total  # the first backward a weight gradient follows
    lo, hi = min(left, late), max(left, late)
    out = fwd[:warmup] + _zip(fwd[warmup : warmup + lo], bwd[:lo])
    if left <= late:
        out += bwd[lo:hi]
    else:
        out += _zip(fwd[warmup + lo : warmup + hi], bwd[lo:hi], wgt[: hi - late])
    return out + _zip(bwd[hi:], wgt[hi - late : total - late]) + wgt[total - late :]


@lru_cache(maxsize=64)
def _rounds_of(per_round: int, v: int, total: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per forward i of a device: its chunk, (i // r) % v, and its microbatch, (i // (r v)) r + i % r."""
    block = per_round * v
    chunks = tuple((i // per_round) % v for i in range(total))
    return chunks, tuple((i // block) * per_round + i % per_round for i in range(total))


def _actions(stages: Iterable[int], kind: Kind, micro: Iterable[int]) -> list[ScheduleAction]:
    return list(map(_make_action, zip(stages, repeat(kind), micro)))


def _zip(*lists: list[ScheduleAction]) -> list[ScheduleAction]:
    """The lists' first elements, then their second ones, ... (as long as the shortest)."""
    return list(chain.from_iterable(zip(*lists)))


def _zbv(rank: int, devices: int, m: int) -> list[ScheduleAction]:
    """ZB-V on device `rank`: chunk 0 is stage `rank`, chunk 1 stage 2 D - 1 - rank."""
    low, high = rank, 2 * devices - 1 - rank
    n = max(2 * devices - 1, m)  # the V fills only with enough microbatches: extras dropped below
    count = {(s, k): 0 for s in (low, high) for k in "FIW"}
    out: list[ScheduleAction] = []

    def act(stage: int, *kinds: Kind) -> None:
        for kind in kinds:
            out.append(ScheduleAction(stage, kind, count[stage, kind]))
            count[stage, kind] += 1

    for _ in range(2 * (devices - rank) - 1):
        act(low, "F")
    for _ in range(rank):
        act(high, "F")
        act(low, "F")
    for _ in range(devices - rank):
        act(high, "F", "I", "W")
    while count[high, "F"] < count[low, "F"] or count[low, "F"] < n:
        if count[low, "F"] < n:
            act(low, "F")
        act(low, "I", "W")
        act(high, "F", "I", "W")
    for _ in range(rank):
        act(low, "I")
        act(high, "I")
    for _ in range(devices - rank):
        act(low, "I")
        out.append(ScheduleAction(low, "W", count[low, "W"]))
        count[low, "W"] += 1
    for stage in (high, low):
        while count[stage, "W"] < count[stage, "I"]:
            act(stage, "W")
    return [a for a in out if a.microbatch < m]


def stage_placement(name: str, devices: int, chunks: int) -> list[int]:
    """Stage -> device of schedule `name`: loop placement (stage s on device s % D), or the V of
    zbv (stage s < D on device s, stage s >= D on device 2 D - 1 - s)."""
    if name == "zbv":
        return [s if s < devices else 2 * devices - 1 - s for s in range(2 * devices)]
    return [s % devices for s in range(devices * chunks)]
