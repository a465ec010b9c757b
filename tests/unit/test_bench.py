"""The benches' entry point and harness (`python -m bench`), in this process:

- without a name it lists every bench, and the list is every module of bench/ but the harness,
  the recovery baseline's torchrun worker and the engine checks gpu_checks runs;
- every bench module imports and declares its harness entry (`BENCH`, a `harness.Bench`);
- the quickest benches (planner, fingerprint) run with `--quick` and print JSON lines, each
  carrying the commit, the bench's name, the load, the CPU count and the torch version;
- `alternate` runs the sides A, B, A, B (with `swap`, A, B, B, A) and gives medians and their ratio;
  the commit is "unknown" outside a git checkout.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from bench import BENCHES, harness
from bench.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
NOT_BENCHES = {"__init__", "__main__", "harness", "baseline_train", "gpu_engine"}


def test_without_a_name_it_lists_every_bench(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert listed == list(BENCHES)
    modules = {p.stem for p in (ROOT / "bench").glob("*.py")} - NOT_BENCHES
    assert sorted(modules) == sorted(BENCHES)


def test_an_unknown_name_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no_such_bench"]) == 2
    assert "planner" in capsys.readouterr().err


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_declares_its_harness_entry(name: str) -> None:
    entry = importlib.import_module(f"bench.{name}").BENCH
    assert isinstance(entry, harness.Bench)
    assert callable(entry.main)
    assert entry.quick is None or all(isinstance(arg, str) for arg in entry.quick)


@pytest.mark.parametrize("name", ["planner", "fingerprint"])
def test_the_quickest_benches_print_json_lines_with_their_context(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([name, "--quick"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines
    for line in lines:
        assert line["bench"] == name
        assert isinstance(line["commit"], str) and line["commit"]
        assert len(line["load"]) == 3 and all(isinstance(x, float) for x in line["load"])
        assert line["cpus"] >= 1 and line["torch"]


def test_the_planners_mixed_fleet_part_plans_each_class_mix(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.planner import classes

    classes({"bench": "planner"}, 1, node_counts=(64,))
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert [len(r["classes"]) for r in rows] == [1, 2, 3]
    assert all(sum(r["classes"].values()) == 64 and r["est_samples_per_s"] > 0 for r in rows)
    assert rows[2]["used"]["v100"] == 0  # 8 V100 nodes cannot hold a replica (n0 = 14)


def test_a_bench_without_a_quick_form_says_so() -> None:
    with pytest.raises(SystemExit, match="no --quick form"):
        main(["recovery", "--quick"])


def test_alternate_runs_the_sides_in_turn_and_gives_medians_and_ratio() -> None:
    order: list[str] = []

    def side(name: str, values: list[float]):
        it = iter(values)

        def measure() -> float:
            order.append(name)
            return next(it)

        return measure

    result = harness.alternate({"a": side("a", [4.0, 6.0, 5.0]), "b": side("b", [2.0, 3.0, 1.0])}, 3)
    assert order == ["a", "b"] * 3
    assert result.samples == {"a": [4.0, 6.0, 5.0], "b": [2.0, 3.0, 1.0]}
    assert result.medians == {"a": 5.0, "b": 2.0}
    assert result.ratio == 2.5

    order.clear()
    blocks = harness.alternate(
        {"a": lambda: order.append("a") or [1.0, 3.0], "b": lambda: order.append("b") or []}, 2, swap=True
    )
    assert order == ["a", "b", "b", "a"]
    assert blocks.medians == {"a": 2.0, "b": None} and blocks.ratio is None


def test_the_commit_is_unknown_outside_a_git_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    harness.commit.cache_clear()
    monkeypatch.setattr(harness, "ROOT", tmp_path)
    try:
        assert harness.commit() == "unknown"
    finally:
        harness.commit.cache_clear()


def test_stress_separates_a_faults_recovery_from_a_stall() -> None:
    """bench/stress.py: from a fault to the first step of the next generation is its recovery, any
    other gap past a lease TTL + settle + two median steps is a stall."""
    from bench import stress

    # the fault at 11.2 s: step 4, in flight, still completes at 11.3; the survivors enter the
    # next generation at 12.0 and complete step 5 there at 12.4
    steps = [(1, 10.0), (2, 10.5), (3, 11.0), (4, 11.3), (5, 12.4), (6, 12.9), (7, 17.0), (8, 17.5)]
    plain, recovery = stress.gaps(steps, faults=[11.2], entries=[9.0, 12.0])
    assert recovery == [pytest.approx(1.2)]
    assert plain == [pytest.approx(x) for x in (0.5, 0.5, 0.5, 4.1, 0.5)]
    assert stress.stall_bound(plain) == pytest.approx(2.0 + 0.2 + 2 * 0.5)
    run = {"passed": False, "lost_job": False, "stalls_s": [4.1], "false_deaths": ["node2: x"]}
    run |= {"weights": "reference", "fault_to_next_step_s": [1.2]}
    summary = stress.summarise("kill", [run])
    assert (summary["stalls"], summary["false_deaths"], summary["false_deaths_survived"]) == (1, 1, 1)
    assert summary["worst_fault_to_next_step_s"] == 1.2
    assert stress.table([summary]).splitlines()[1].split()[:4] == ["kill", "0/1", "0", "1"]
