"""The jobs lane in turns (tests/lanes.py): with `--extended-shard`, its `core` tests run in every
shard and each other test in exactly one, the shards balanced by the recorded durations; without
it, every test a command names runs."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lanes import extended_shard, load_durations, store_durations

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
    commands = [("tests/jobs/test_recovery.py", "-m", MARKS, f"--extended-shard={i}/2") for i in range(2)]
    commands.append(("tests/jobs/test_recovery.py",))  # no shard: the setup.cfg default marks
    with ThreadPoolExecutor(len(commands)) as pool:  # three collections at once: each imports torch
        *shards, plain = pool.map(lambda args: _collected(*args), commands)
    assert all(CORE in shard for shard in shards)
    assert [TURNS in shard for shard in shards].count(True) == 1, shards
    assert {CORE, TURNS} <= plain


class _Item:
    """A made-up collected test: its node id, extended or not."""

    def __init__(self, nodeid: str, extended: bool = True) -> None:
        self.nodeid, self.extended = nodeid, extended

    def get_closest_marker(self, name: str) -> object:
        return object() if name == "extended" and self.extended else None


def test_shards_are_disjoint_cover_every_extended_test_and_balance_the_recorded_time() -> None:
    times = {"a": 90.0, "b": 80.0, "c": 10.0, "d": 10.0, "e": 10.0, "f": 5.0}
    items = [_Item(n) for n in times] + [_Item("core", extended=False), _Item("new")]  # "new": no time yet
    shards = [extended_shard(items, (i, 3), times) for i in range(3)]  # type: ignore[arg-type]
    names = [[it.nodeid for it in s] for s in shards]
    assert sorted(n for s in names for n in s) == sorted([*times, "new"])  # each extended test once, core never
    # longest first onto the least-loaded shard; "new" counts as the median recorded time (10 s)
    assert names == [["a"], ["b"], ["c", "d", "e", "f", "new"]]
    loads = [sum(times.get(n, 10.0) for n in s) for s in names]
    assert max(loads) - min(loads) <= max(times.values())
    assert names == [[it.nodeid for it in extended_shard(items, (i, 3), times)] for i in range(3)]  # type: ignore[arg-type]


def test_recorded_durations_merge_one_test_a_line(tmp_path: Path) -> None:
    path = tmp_path / "durations.json"
    store_durations({"t::b": 2.04, "t::a": 1.0}, path)
    store_durations({"t::b": 3.0}, path)
    assert load_durations(path) == {"t::a": 1.0, "t::b": 3.0}
    assert path.read_text() == '{\n  "t::a": 1.0,\n  "t::b": 3.0\n}\n'
    assert load_durations(tmp_path / "missing.json") == {}
