"""One discrete-event simulation for every pipeline schedule: its makespan, bubble and memory.

Each device runs its actions in order, an action starting when the device is free and its inputs
are there (the previous stage's forward, the next stage's backward or I, its own I for a W); a
message between devices occupies the receiver right before the action that needs it. Where
templates.py's closed form is exact, the simulation gives it. An order that cannot run raises
`ScheduleError` naming each blocked device. `simulate` runs on flat integer slots and agrees bit
for bit with `simulate_reference`, the plain event loop the rules read like. docs/schedules.md;
its speed in bench/RESULTS.md.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from .schedules import Order, ScheduleAction, ScheduleError

__all__ = ["Comm", "Simulation", "StageTimes", "simulate", "simulate_reference"]

Comm = Callable[[int, int, int], float]
"""comm(boundary, src_device, dst_device): seconds for one message between stage `boundary` and
`boundary + 1` (the activation forward and the gradient backward cost the same)."""


@dataclass(frozen=True)
class StageTimes:
    """Per stage (all chunks of all devices, in pipeline order) compute times of one microbatch."""

    forward_s: Sequence[float]
    """Forward time."""
    input_grad_s: Sequence[float]
    """Backward time for the gradient of the stage's input (what the stage before waits for)."""
    weight_grad_s: Sequence[float]
    """Backward time for the gradient of the stage's weights."""
    activation_bytes: Optional[Sequence[int]] = None
    """Bytes a forward keeps until its backward finishes (None: counted as 0)."""
    backward_s: Optional[Sequence[float]] = None
    """A full backward B's time, where it was measured apart from its split (None: B takes I + W)."""

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        others = [self.input_grad_s, self.weight_grad_s] + [
            x for x in (self.activation_bytes, self.backward_s) if x is not None
        ]
        if any(len(x) != n for x in others):
            raise ScheduleError(
                "StageTimes: forward, input-grad, weight-grad, backward and activation lists differ in length"
            )
        times = (self.forward_s, self.input_grad_s, self.weight_grad_s, self.backward_s or ())
        if any(t < 0 for x in times for t in x):
            raise ScheduleError("StageTimes: times must be >= 0")

    @property
    def num_stages(self) -> int:
        return len(self.forward_s)

    @classmethod
    def uniform(
        cls, stages: int, forward_s: float, backward_s: float, weight_share: float = 0.5, activation_bytes: int = 0
    ) -> "StageTimes":
        """Every stage alike; the backward split into I and W by `weight_share` (W = share x B)."""
        w = backward_s * weight_share
        return cls(
            forward_s=[forward_s] * stages,
            input_grad_s=[backward_s - w] * stages,
            weight_grad_s=[w] * stages,
            activation_bytes=[activation_bytes] * stages,
        )

    def duration(self, a: ScheduleAction) -> float:
        s = a.stage
        if a.kind == "F":
            return self.forward_s[s]
        if a.kind == "I":
            return self.input_grad_s[s]
        if a.kind == "W":
            return self.weight_grad_s[s]
        return self.full_backward_s(s)

    def full_backward_s(self, s: int) -> float:
        """Stage s's full backward B: measured, else I + W."""
        if self.backward_s is not None:
            return self.backward_s[s]
        return self.input_grad_s[s] + self.weight_grad_s[s]


@dataclass(frozen=True)
class Simulation:
    """What one simulated step of an order took."""

    makespan_s: float
    """From the first action's start to the last one's end."""
    busy_s: tuple[float, ...]
    """Per device: seconds computing."""
    comm_s: tuple[float, ...]
    """Per device: seconds receiving from other devices."""
    peak_in_flight: tuple[int, ...]
    """Per device: the most forwards whose activations were kept at once."""
    peak_activation_bytes: tuple[int, ...]
    """Per device: the most activation bytes kept at once."""
    span_table: Callable[[], dict[ScheduleAction, tuple[float, float]]] = field(repr=False, compare=False)
    """What builds `spans` (a planner keeps hundreds of simulations and reads none of their spans)."""
    last_backward: tuple[tuple[float, float, bool], ...] = ()
    """Per stage: (start, end) of its last backward to finish, B or W, and whether it was a W
    (when its weight gradients are final: planning/templates/overlap.py)."""

    @property
    def spans(self) -> dict[ScheduleAction, tuple[float, float]]:
        """Every action's (start, end) of its compute (its receive ends at its start)."""
        return self.span_table()

    @property
    def bubble_fraction(self) -> float:
        """Share of the devices' time not spent computing (receiving counts as idle)."""
        total = self.makespan_s * len(self.busy_s)
        return 0.0 if total <= 0 else 1.0 - sum(self.busy_s) / total

    @property
    def bubble_s(self) -> float:
        """Device-seconds not spent computing, over all devices."""
        return self.makespan_s * len(self.busy_s) - sum(self.busy_s)


def _check(order: Order, times: StageTimes) -> dict[int, int]:
    """Stage -> device, after checking that the order runs every stage's work exactly once."""
    if times.num_stages != order.num_stages:
        raise ScheduleError(f"the order has {order.num_stages} stages but the times give {times.num_stages}")
    where = order.stage_devices()
    seen: dict[ScheduleAction, tuple[int, int]] = {}
    for d, acts in enumerate(order.devices):
        for i, a in enumerate(acts):
            if not (0 <= a.stage < order.num_stages and 0 <= a.microbatch < order.microbatches):
                raise ScheduleError(
                    f"device {d} runs {a} (position {i}): stages are 0..{order.num_stages - 1}, "
                    f"microbatches 0..{order.microbatches - 1}"
                )
            if a in seen:
                first = f"device {seen[a][0]} position {seen[a][1]}"
                raise ScheduleError(f"{a} is listed twice: {first} and device {d} position {i}")
            seen[a] = (d, i)
    for s in range(order.num_stages):
        for k in range(order.microbatches):
            f, b, i, w = (ScheduleAction(s, kind, k) in seen for kind in "FBIW")  # type: ignore[arg-type]
            if b and (i or w):
                raise ScheduleError(f"stage {s} microbatch {k} has both a full backward {s}B{k} and a split one (I/W)")
            missing = ([] if f else [f"{s}F{k}"]) + (
                []
                if b or (i and w)
                else [f"{s}I{k}" if w else f"{s}W{k}" if i else f"{s}B{k} (or {s}I{k} and {s}W{k})"]
            )
            if missing:
                raise ScheduleError(
                    f"the order never runs {', '.join(missing)}: every stage needs F and B (or I and W) "
                    "for every microbatch"
                )
    return where


def simulate(
    order: Order,
    times: StageTimes,
    comm: Optional[Comm] = None,
    *,
    checked: bool = False,
    rebuild: Optional[Callable[[], Order]] = None,
) -> Simulation:
    """Simulate one step of `order` with `times` and messages costing `comm` (None: free; it must
    be a pure function of its arguments). Raises ScheduleError when the order is incomplete or
    cannot run (module docstring). `checked`: the order is known complete (schedules.py built
    it; its tests check every one), so only its stage count is compared; the planner simulates
    thousands. The same rules as `simulate_reference`, computed on integer slots and lists
    (module docstring, "Speed"): the same floats, bit for bit. `rebuild`: what builds `order`
    again when the spans are asked for, so that the simulation need not keep its actions alive
    (the garbage collector scans every live ScheduleAction: a planner's hundreds of kept simulations
    would hold millions)."""
    where = _where(order, times, checked)
    sim = _run(order, times, comm, where, rebuild or (lambda: order))
    return sim if sim is not None else simulate_reference(order, times, comm, checked=True)  # raises: blocked


def _where(order: Order, times: StageTimes, checked: bool) -> list[int]:
    if checked:
        if times.num_stages != order.num_stages:
            raise ScheduleError(f"the order has {order.num_stages} stages but the times give {times.num_stages}")
        where = order.stage_devices()
    else:
        where = _check(order, times)
    return [where[s] for s in range(order.num_stages)]


def _run(
    order: Order, times: StageTimes, comm: Optional[Comm], where: list[int], rebuild: Callable[[], Order]
) -> Optional[Simulation]:
    """The simulation on slots (None when the order cannot run: the reference says why). ScheduleAction
    (stage s, kind, microbatch k) has slot base[kind] + s m + k; `end` holds each slot's finish
    (-1: not yet run), so an input is found by arithmetic instead of hashing actions."""
    n, stages, m = order.num_devices, order.num_stages, order.microbatches
    last, sm = stages - 1, stages * m
    i_base, w_base, b_base = sm, 2 * sm, 3 * sm
    fwd, inp, wgt = list(times.forward_s), list(times.input_grad_s), list(times.weight_grad_s)
    full = [times.full_backward_s(s) for s in range(stages)]
    act = list(times.activation_bytes) if times.activation_bytes else [0] * stages
    # the message into stage s: its input activation from s - 1 (cf), its output gradient from
    # s + 1 (cb); None where the two stages share a device (free)
    cf: list[Optional[float]] = [None] * stages
    cb: list[Optional[float]] = [None] * stages
    if comm is not None:
        for s in range(1, stages):
            if where[s - 1] != where[s]:
                cf[s] = comm(s - 1, where[s - 1], where[s])
                cb[s - 1] = comm(s - 1, where[s], where[s - 1])
    grad_base = [b_base] * sm  # per (s, k): the slot base of its backward, I when split, else B
    for acts in order.devices:
        for s, kind, k in acts:
            if kind == "I":
                grad_base[s * m + k] = i_base
    begin = [-1.0] * (4 * sm)
    end = [-1.0] * (4 * sm)
    free, busy, recv = [0.0] * n, [0.0] * n, [0.0] * n
    head = [0] * n
    held, held_bytes, top, top_bytes = [0] * n, [0] * n, [0] * n, [0] * n
    waiting: dict[int, list[int]] = {}
    ready = list(range(n))
    while ready:
        d = ready.pop()
        acts = order.devices[d]
        h, count = head[d], len(acts)
        t, b, r = free[d], busy[d], recv[d]
        hl, hb, tp, tb = held[d], held_bytes[d], top[d], top_bytes[d]
        while h < count:
            s, kind, k = acts[h]
            j = s * m + k
            if kind == "F":
                start = t
                if s:
                    e = end[j - m]
                    if e < 0.0:
                        waiting.setdefault(j - m, []).append(d)
                        break
                    if e > start:
                        start = e
                    c = cf[s]
                    if c is not None:
                        start += c
                        r += c
                slot, dur = j, fwd[s]
                hl += 1
                hb += act[s]
                if hl > tp:
                    tp = hl
                if hb > tb:
                    tb = hb
            elif kind == "W":
                e = end[i_base + j]
                if e < 0.0:
                    waiting.setdefault(i_base + j, []).append(d)
                    break
                start = e if e > t else t
                slot, dur = w_base + j, wgt[s]
                hl -= 1
                hb -= act[s]
            else:  # I or B: this stage's forward, and the next stage's gradient
                e = end[j]
                if e < 0.0:
                    waiting.setdefault(j, []).append(d)
                    break
                start = e if e > t else t
                if s != last:
                    g = grad_base[j + m] + j + m
                    e = end[g]
                    if e < 0.0:
                        waiting.setdefault(g, []).append(d)
                        break
                    if e > start:
                        start = e
                    c = cb[s]
                    if c is not None:
                        start += c
                        r += c
                if kind == "I":
                    slot, dur = i_base + j, inp[s]
                else:
                    slot, dur = b_base + j, full[s]
                    hl -= 1
                    hb -= act[s]
            finish = start + dur
            begin[slot] = start
            end[slot] = finish
            b += finish - start
            t = finish
            h += 1
            woken = waiting.pop(slot, None)
            if woken is not None:
                ready.extend(woken)
        head[d], free[d], busy[d], recv[d] = h, t, b, r
        held[d], held_bytes[d], top[d], top_bytes[d] = hl, hb, tp, tb
    if any(head[d] < len(order.devices[d]) for d in range(n)):
        return None
    firsts = [begin[_slot(acts[0], m, sm)] for acts in order.devices if acts]
    return Simulation(
        makespan_s=max(end) - min(firsts) if firsts else 0.0,
        busy_s=tuple(busy),
        comm_s=tuple(recv),
        peak_in_flight=tuple(top),
        peak_activation_bytes=tuple(top_bytes),
        span_table=_SlotSpans(rebuild, array("d", begin), array("d", end)),
        last_backward=tuple(_last_backward(begin, end, s, m, sm) for s in range(stages)),
    )


_BASE = {"F": 0, "I": 1, "W": 2, "B": 3}


def _slot(a: ScheduleAction, m: int, sm: int) -> int:
    return _BASE[a.kind] * sm + a.stage * m + a.microbatch


def _last_backward(begin: list[float], end: list[float], s: int, m: int, sm: int) -> tuple[float, float, bool]:
    """Stage s's backward (B or W) that finished last: (start, end, is a W)."""
    best = (0.0, 0.0, False)
    for base, split in ((_BASE["B"] * sm, False), (_BASE["W"] * sm, True)):
        for k in range(m):
            e = end[base + s * m + k]
            if e >= 0.0 and e > best[1]:
                best = (begin[base + s * m + k], e, split)
    return best


class _SlotSpans:
    """A fast simulation's spans, kept as two arrays of slots; the dict is built when asked for."""

    def __init__(self, order: Callable[[], Order], begin: array, end: array) -> None:
        self.order, self.begin, self.end = order, begin, end

    def __call__(self) -> dict[ScheduleAction, tuple[float, float]]:
        order = self.order()
        m, sm = order.microbatches, order.num_stages * order.microbatches
        out = {}
        for acts in order.devices:
            for a in acts:
                i = _slot(a, m, sm)
                out[a] = (self.begin[i], self.end[i])
        return out


def simulate_reference(
    order: Order, times: StageTimes, comm: Optional[Comm] = None, *, checked: bool = False
) -> Simulation:
    """`simulate` as the rules read (module docstring): actions as tuples in a dict, one at a
    time; the definition the fast `simulate` is tested against, and what explains an order that
    cannot run."""
    where = dict(enumerate(_where(order, times, checked)))
    last = order.num_stages - 1
    n = order.num_devices
    # a backward's gradient comes from the next stage's I when it has one, else its B
    split = {(a.stage, a.microbatch) for acts in order.devices for a in acts if a.kind == "I"}
    done: dict[ScheduleAction, tuple[float, float]] = {}
    free = [0.0] * n
    busy = [0.0] * n
    recv = [0.0] * n
    head = [0] * n
    waiting: defaultdict[ScheduleAction, list[int]] = defaultdict(list)
    blocked: dict[int, ScheduleAction] = {}
    ready = list(range(n))
    while ready:
        d = ready.pop()
        blocked.pop(d, None)
        acts = order.devices[d]
        while head[d] < len(acts):
            a = acts[head[d]]
            needs = _inputs(a, last, split)
            missing = next((x for x in needs if x not in done), None)
            if missing is not None:
                waiting[missing].append(d)
                blocked[d] = missing
                break
            start = free[d]
            for x in needs:
                end = done[x][1]
                src = where[x.stage]
                if src == d or comm is None:
                    start = max(start, end)
                else:  # received over a link, after the sender finished and once this device is free
                    boundary = min(x.stage, a.stage)
                    t = comm(boundary, src, d)
                    start = max(start, end) + t
                    recv[d] += t
            finish = start + times.duration(a)
            done[a] = (start, finish)
            busy[d] += finish - start
            free[d] = finish
            head[d] += 1
            ready.extend(waiting.pop(a, ()))
    if blocked:
        raise ScheduleError(
            f"order '{order.name}' cannot run, its dependencies are violated: "
            + "; ".join(_blocked(order, where, d, head[d], w) for d, w in sorted(blocked.items()))
        )
    peaks, peak_bytes = _memory(order, times)
    makespan = max((e for _, e in done.values()), default=0.0) - min((s for s, _ in done.values()), default=0.0)
    return Simulation(
        makespan_s=makespan,
        busy_s=tuple(busy),
        comm_s=tuple(recv),
        peak_in_flight=peaks,
        peak_activation_bytes=peak_bytes,
        span_table=lambda: done,
        last_backward=tuple(
            max(
                ((b, e, a.kind == "W") for a, (b, e) in done.items() if a.stage == s and a.kind in "BW"),
                key=lambda x: x[1],
                default=(0.0, 0.0, False),
            )
            for s in range(order.num_stages)
        ),
    )


def _blocked(order: Order, where: dict[int, int], device: int, position: int, wanted: ScheduleAction) -> str:
    """One blocked device, for the error: its next action, what it waits for, and where that is."""
    line = f"device {device} at {order.devices[device][position]} (position {position}) waits for {wanted}"
    owner = order.devices[where[wanted.stage]]
    if wanted in owner:
        line += f", which device {where[wanted.stage]} runs later (position {owner.index(wanted)})"
    return line


def _inputs(a: ScheduleAction, last: int, split: set[tuple[int, int]]) -> list[ScheduleAction]:
    s, k = a.stage, a.microbatch
    if a.kind == "F":
        return [ScheduleAction(s - 1, "F", k)] if s > 0 else []
    if a.kind == "W":
        return [ScheduleAction(s, "I", k)]
    if s == last:
        return [ScheduleAction(s, "F", k)]
    return [ScheduleAction(s, "F", k), ScheduleAction(s + 1, "I" if (s + 1, k) in split else "B", k)]


def _memory(order: Order, times: StageTimes) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per device, the most forwards (and activation bytes) kept at once, walking its order."""
    act = times.activation_bytes or [0] * times.num_stages
    peaks, peak_bytes = [], []
    for acts in order.devices:
        held = held_bytes = top = top_bytes = 0
        for a in acts:
            if a.kind == "F":
                held += 1
                held_bytes += act[a.stage]
                top, top_bytes = max(top, held), max(top_bytes, held_bytes)
            elif a.kind in ("B", "W"):  # an I keeps them: its W still needs the stage's inputs
                held -= 1
                held_bytes -= act[a.stage]
        peaks.append(top)
        peak_bytes.append(top_bytes)
    return tuple(peaks), tuple(peak_bytes)
