"""Test lanes: each folder under tests/ is one lane, named by what its tests need to run.

A lane's `conftest.py` calls `mark_lane`, which gives every test collected under that folder the
lane's marker (so `-m worlds` works) and the lane's per-test time cap (pytest-timeout), unless the
test sets its own `pytest.mark.timeout`. `extended_shard` picks the rotating shard of `extended`
tests that `make test` runs; in the jobs lane (`ROTATING`) every test not marked `core` takes its
turn there too. tests/README.md lists the lanes and their measured times.
"""

from __future__ import annotations

from pathlib import Path

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


def extended_shard(items: list[pytest.Item], shard: tuple[int, int]) -> list[pytest.Item]:
    """The `extended` items of shard i of K: every K-th of them in node-id order, from the i-th,
    so the K shards are disjoint, cover every extended test and differ in size by one at most."""
    i, k = shard
    extended = sorted((it for it in items if it.get_closest_marker("extended")), key=lambda it: it.nodeid)
    return extended[i::k]
