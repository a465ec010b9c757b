"""Node-availability traces: what the simulator replays.

A trace is a time-sorted list of node events, `time_ms,add|remove,node` per line (the format of
the Oobleck SOSP'23 artifact's traces, which this project ships). An `add` at
time t means the node is provisioned and available from t; a `remove` means it is gone at t
(a spot preemption or a failure). `synthetic_trace` draws one: N nodes at t = 0, each failing
after an exponential lifetime of mean `mtbf_h` (Poisson failures per node), optionally replaced
by a new node `join_delay_s` later (the provisioning delay). The story: docs/simulate.md.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

__all__ = ["NodeEvent", "TraceError", "load_trace", "synthetic_trace", "node_counts", "to_csv"]


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the line."""


@dataclass(frozen=True, order=True)
class NodeEvent:
    time_s: float
    """When it happens, seconds from the start of the run."""
    kind: str
    """`add` or `remove`."""
    node: str
    """The node's name."""


def load_trace(path: str | Path) -> list[NodeEvent]:
    """The events of a `time_ms,add|remove,node` file, sorted by time (stable)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file '{path}' does not exist")
    events = []
    with path.open(newline="") as f:
        for lineno, row in enumerate(csv.reader(f), 1):
            if not row or not "".join(row).strip() or row[0].lstrip().startswith("#"):
                continue
            if len(row) != 3:
                raise TraceError(f"{path}:{lineno}: expected time_ms,add|remove,node (got {','.join(row)!r})")
            time_ms, kind, node = (c.strip() for c in row)
            try:
                t = float(time_ms) / 1000.0
            except ValueError:
                raise TraceError(f"{path}:{lineno}: time '{time_ms}' is not a number of milliseconds") from None
            if kind not in ("add", "remove") or not node or t < 0:
                raise TraceError(
                    f"{path}:{lineno}: expected add or remove of a named node at a time >= 0 (got {','.join(row)!r})"
                )
            events.append(NodeEvent(t, kind, node))
    if not events:
        raise TraceError(f"{path}: no events")
    return sorted(events, key=lambda e: e.time_s)


def synthetic_trace(
    nodes: int, *, mtbf_h: float, duration_h: float, join_delay_s: Optional[float] = None, seed: int = 0
) -> list[NodeEvent]:
    """`nodes` nodes at t = 0; each fails after an exponential lifetime of mean `mtbf_h` hours;
    with `join_delay_s`, a replacement node joins that long after each failure (and may fail in
    turn). Events up to `duration_h` hours."""
    if nodes < 1 or mtbf_h <= 0 or duration_h <= 0:
        raise ValueError(f"need nodes >= 1, mtbf_h > 0 and duration_h > 0 (got {nodes}, {mtbf_h}, {duration_h})")
    rng = random.Random(seed)
    end = duration_h * 3600.0
    events = [NodeEvent(0.0, "add", f"node{i}") for i in range(nodes)]
    alive = [(0.0, f"node{i}") for i in range(nodes)]
    next_id = nodes
    while alive:
        start, node = alive.pop()
        death = start + rng.expovariate(1.0 / (mtbf_h * 3600.0))
        if death >= end:
            continue
        events.append(NodeEvent(death, "remove", node))
        if join_delay_s is not None and death + join_delay_s < end:
            name = f"node{next_id}"
            next_id += 1
            events.append(NodeEvent(death + join_delay_s, "add", name))
            alive.append((death + join_delay_s, name))
    return sorted(events, key=lambda e: e.time_s)


def node_counts(events: Iterable[NodeEvent]) -> list[tuple[float, int]]:
    """(time, nodes available from then on) after each distinct event time."""
    up: set[str] = set()
    out: list[tuple[float, int]] = []
    for e in sorted(events, key=lambda e: e.time_s):
        if e.kind == "add":
            up.add(e.node)
        else:
            up.discard(e.node)
        if out and out[-1][0] == e.time_s:
            out[-1] = (e.time_s, len(up))
        else:
            out.append((e.time_s, len(up)))
    return out


def to_csv(events: Iterable[NodeEvent], path: str | Path) -> None:
    """Write events in the trace format (milliseconds)."""
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        for e in events:
            w.writerow([int(round(e.time_s * 1000)), e.kind, e.node])
