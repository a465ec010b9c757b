"""The jobs lane in turns (tests/lanes.py): with `--extended-shard`, its `core` tests run in every
shard and each other test in exactly one; without it, every test a command names runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKS = "not chaos and not full_matrix and (not extended or in_shard)"
CORE = "tests/jobs/test_recovery.py::test_kill_one_node_of_four_matches_reference"
TURNS = "tests/jobs/test_recovery.py::test_local_worker_crash_is_restarted_by_its_agent_and_rejoins"


def _collected(*args: str) -> set[str]:
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return {line.strip() for line in res.stdout.splitlines() if "::" in line and " " not in line.strip()}


def test_core_jobs_run_in_every_shard_and_the_others_in_one() -> None:
    shards = [_collected("tests/jobs/test_recovery.py", "-m", MARKS, f"--extended-shard={i}/2") for i in range(2)]
    assert all(CORE in shard for shard in shards)
    assert [TURNS in shard for shard in shards].count(True) == 1, shards
    plain = _collected("tests/jobs/test_recovery.py")  # no shard: the setup.cfg default marks
    assert {CORE, TURNS} <= plain
