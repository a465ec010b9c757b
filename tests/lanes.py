"""Test lanes: each folder under tests/ is one lane, named by what its tests need to run.

A lane's `conftest.py` calls `mark_lane`, which gives every test collected under that folder the
lane's marker (so `-m worlds` works) and the lane's per-test time cap (pytest-timeout), unless the
test sets its own `pytest.mark.timeout`. `extended_shard` picks the rotating shard of `extended`
tests that `make test` runs, balanced by the recorded durations (`DURATIONS`); in the jobs lane
(`ROTATING`) every test not marked `core` takes its turn there too. tests/README.md lists the
lanes and their measured times.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import pytest

# lane -> (what it needs, per-test cap in seconds). A cap stops a hung test; it is not a speed goal:
# each is over four times the slowest test of the lane on a loaded 2-core machine (load 8: unit
# 40 s, control 10 s, worlds 44 s, jobs 87 s; a chaos seed takes 2-5 minutes), and above the
# test's own waits (a job's is 400 s).
LANES: dict[str, tuple[str, int]] = {
    "unit": ("pure, in-process: no etcd, no process group of several ranks, no job", 180),
    "control": ("one real etcd (agents, leases, watches, the mirror), no training job", 300),
    "worlds": ("gloo worlds of several ranks checked against the single-process reference", 600),
    "jobs": ("whole jobs: the local launcher, torchrun, Slurm, with faults injected", 900),
    "chaos": ("long randomized failure runs: the seeded chaos test (make chaos) and its fixed seeds", 1800),
}


def mark_lane(items: list[pytest.Item], folder: Path, lane: str) -> None:
    """Mark every item collected under `folder` with `lane` and cap its time. The chaos lane adds
    no marker: `chaos` already marks the hand-run seeded test, which `make test` leaves out while it
    runs the lane's extended seeds in turn."""
    cap = LANES[lane][1]
    for item in items:
        if folder not in Path(str(item.path)).parents:
            continue
        if lane != "chaos":
            item.add_marker(getattr(pytest.mark, lane))
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(cap))


def parse_shard(text: str) -> tuple[int, int]:
    """'i/K' -> (i, K) with 0 <= i < K."""
    try:
        i, k = (int(part) for part in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--extended-shard={text!r}: expected i/K, e.g. 2/6") from None
    if k < 1 or not 0 <= i < k:
        raise pytest.UsageError(f"--extended-shard={text!r}: need K >= 1 and 0 <= i < K")
    return i, k


ROTATING = ("jobs",)
"""Lanes that `make test` runs in turns: only their tests marked `core` run at every landing, the
others join the `extended` tests' rotation. A whole job takes 15-90 s on the 2-core machine: the
whole jobs lane at every landing (30 min) would keep CI far above its 20-minute goal."""


def rotate(items: list[pytest.Item], tests: Path) -> None:
    """Mark `extended` every test of a `ROTATING` lane under `tests` that is not marked `core`
    (only for a sharded run: a plain `pytest tests/jobs/...` runs them all)."""
    for item in items:
        parts = Path(str(item.path)).relative_to(tests).parts
        if parts[:1] and parts[0] in ROTATING and not any(item.get_closest_marker(m) for m in ("core", "full_matrix")):
            item.add_marker(pytest.mark.extended)


DURATIONS = Path(__file__).resolve().parent / "durations.json"
"""Measured seconds (setup + call + teardown) of the tests that run in turns, by node id:
`extended_shard` balances the shards by them. Refresh after adding slow tests with
`pytest tests/jobs -m "not core and not full_matrix and not chaos" --store-durations` (it merges
the times of the tests it ran into the file)."""


MIN_COST_S = 1.0
"""What a test costs the shard at least: its process start and fixtures, whatever its recorded time."""


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    """The recorded durations, or none when the file is missing."""
    return json.loads(path.read_text()) if path.exists() else {}


def store_durations(measured: Mapping[str, float], path: Path = DURATIONS) -> None:
    """Merge `measured` into the file at `path`, one test a line so that a diff reads."""
    merged = {**load_durations(path), **{k: round(v, 1) for k, v in measured.items()}}
    lines = [f"  {json.dumps(k)}: {merged[k]}" for k in sorted(merged)]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")


def extended_shard(
    items: list[pytest.Item], shard: tuple[int, int], durations: Mapping[str, float] = {}
) -> list[pytest.Item]:
    """The `extended` items of shard i of K. The K shards are disjoint, cover every extended test
    and take about the same time: longest first, each test goes to the shard with the least
    recorded time so far (lowest index on a tie), so a shard exceeds another by at most its
    longest test. A test with no recorded duration counts as the median recorded one, and every
    test as at least `MIN_COST_S` (so the many quick ones spread over the shards too)."""
    i, k = shard
    extended = [it for it in items if it.get_closest_marker("extended")]
    known = sorted(durations[it.nodeid] for it in extended if it.nodeid in durations)
    typical = known[len(known) // 2] if known else 1.0
    cost = {it.nodeid: max(MIN_COST_S, durations.get(it.nodeid, typical)) for it in extended}
    loads = [0.0] * k
    chosen = []
    for it in sorted(extended, key=lambda it: (-cost[it.nodeid], it.nodeid)):
        j = min(range(k), key=lambda s: (loads[s], s))
        loads[j] += cost[it.nodeid]
        if j == i:
            chosen.append(it)
    return sorted(chosen, key=lambda it: it.nodeid)
