"""`oobleck plan` on every shipped config, as a user runs it (a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# gpt2-small is profiled for real on this CPU: keep its microbatch small so the test stays fast
FAST = {"gpt2-small": ["training.microbatch_size=1", "training.global_batch_size=8", "data.seq_len=32"]}


def oobleck(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "oobleck_elastic.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "gpt2-small", "gpt3-175b"])
def test_plan_json_on_every_shipped_config(name: str, tmp_path: Path) -> None:
    cfg = ROOT / "configs" / f"{name}.yaml"
    overrides = FAST.get(name, []) + [f"data.cache_dir={tmp_path}"]
    if name == "gpt3-175b":
        overrides.append(f"planning.profile_path={ROOT / 'configs/profiles/gpt3-175b-tp{tp}.json'}")
    nodes = "64" if name == "gpt3-175b" else "4"
    res = oobleck("plan", "--config", str(cfg), "--nodes", nodes, "--json", *overrides, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert set(out) >= {"templates", "guarantee", "plan"}
    plan = out["plan"]
    assert len(plan["nodes"]) == int(nodes) and plan["spares"] == []
    assert sum(p["microbatches"] for p in plan["pipelines"]) * plan["microbatch_size"] == {
        "gpt3-175b": 1536,
        "gpt2-small": 8,
    }.get(name, 16)
    assert len(plan["pipelines"]) >= 2  # f = 1
    for t in out["templates"]:
        assert t["stages"][0]["layers"][0] == 0 and t["peak_memory_bytes"] > 0


def test_plan_text_report_and_profile_cache(tmp_path: Path) -> None:
    args = ["plan", "--config", str(ROOT / "configs/gpt2-tiny.yaml"), "--nodes", "3", f"data.cache_dir={tmp_path}"]
    first = oobleck(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "profiling layer 6/6 head" in first.stderr
    assert "templates (iteration time" not in first.stdout  # the table only on request
    assert "6 template(s), for 1..6 node(s): --templates prints them" in first.stdout
    assert "guarantee: templates for 1..6 nodes" in first.stdout
    assert "plan for 3 node(s), generation 0:" in first.stdout
    second = oobleck(*args, "--templates", cwd=tmp_path)
    assert "profiling layer" not in second.stderr and "profile: reusing cached" in second.stderr
    out = second.stdout
    assert out.index("plan for 3 node(s)") < out.index("templates (iteration time with 4 microbatches")  # summary first
    assert "--templates prints them" not in out


def test_plan_reports_profiling_progress_and_measures_again_on_request(tmp_path: Path) -> None:
    args = ["plan", "--config", str(ROOT / "configs/gpt2-tiny.yaml"), "--nodes", "2", f"data.cache_dir={tmp_path}"]
    first = oobleck(*args, "planning.profile_repeats=2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "identical blocks measured once: 3 layers to build and time, 3 runs each)" in first.stderr
    lines = [line for line in first.stderr.splitlines() if line.startswith("profiling layer ")]
    assert [line.split("; ")[-1].split(",")[0] for line in lines if "identical" not in line] == [
        "1/3 layers measured",
        "2/3 layers measured",
        "3/3 layers measured",
    ]
    assert "s so far, about " in lines[0] and " s left" in lines[0]
    (cached,) = (tmp_path / "profiles").glob("*.json")
    os.utime(cached, (1_000_000_000, 1_000_000_000))  # measured long ago
    reused = oobleck(*args, "planning.profile_repeats=2", cwd=tmp_path)
    assert "profiling layer" not in reused.stderr and "ago; to measure again: oobleck plan --reprofile" in reused.stderr
    assert cached.stat().st_mtime == 1_000_000_000
    again = oobleck(*args, "planning.profile_repeats=2", "--reprofile", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"profile: measuring again as asked (reprofile): replacing {cached}" in again.stderr
    assert "profiling layer 6/6 head" in again.stderr and cached.stat().st_mtime > 1_000_000_000
    both = oobleck(*args, "--reprofile", "--profile", str(cached), cwd=tmp_path)
    assert both.returncode == 2 and both.stderr.strip() == (
        "oobleck plan: error: --reprofile measures the profile, but --profile gives a profile file: drop one of them"
    )


def test_plan_with_profile_file_and_errors(tmp_path: Path) -> None:
    cfg = str(ROOT / "configs/gpt3-175b.yaml")
    prof = str(ROOT / "configs/profiles/gpt3-175b-tp{tp}.json")
    ok = oobleck("plan", "--config", cfg, "--nodes", "1024", "--profile", prof, cwd=ROOT)
    assert ok.returncode == 0 and "plan for 1024 node(s)" in ok.stdout
    assert len(ok.stdout.splitlines()) <= 25 and "layer ranges" not in ok.stdout  # a summary
    table = oobleck("plan", "--config", cfg, "--nodes", "1024", "--profile", prof, "--templates", cwd=ROOT)
    assert table.stdout.startswith(ok.stdout.split("\n\n")[0]) and "layer ranges" in table.stdout
    few = oobleck("plan", "--config", cfg, "--nodes", "5", "--profile", prof, cwd=ROOT)
    assert few.returncode == 2
    assert few.stderr.strip() == (
        "oobleck plan: error: 5 node(s) cannot hold one replica of the model: at least "
        "n0=6 nodes of 8 device(s) are needed; the job waits for more nodes"
    )
    small = oobleck(
        "plan", "--config", cfg, "--nodes", "8", "--profile", prof, "planning.device_memory_gb=20", cwd=ROOT
    )
    assert small.returncode == 2 and "layer 1 'block.0' alone needs 27.05 GiB" in small.stderr
    refuse = oobleck(
        "plan",
        "--config",
        cfg,
        "--nodes",
        "8",
        "--profile",
        prof,
        "planning.max_nodes=16",
        "fault_tolerance.f=2",
        cwd=ROOT,
    )
    assert refuse.returncode == 2 and "cannot tolerate f=2" in refuse.stderr
    missing = oobleck("plan", "--config", cfg, "--nodes", "8", "--profile", str(tmp_path / "x.json"), cwd=ROOT)
    assert missing.returncode == 2 and "profile file" in missing.stderr and "does not exist" in missing.stderr
    # a bad node count is refused before anything is profiled (gpt2-tiny has no profile file: it would profile)
    for bad, why in (("-2", "-2: give at least 1 node"), ("four", "'four' is not a number of nodes")):
        neg = oobleck("plan", "--config", str(ROOT / "configs/gpt2-tiny.yaml"), "--nodes", bad, cwd=tmp_path)
        assert neg.returncode == 2 and neg.stderr.strip().endswith(f"oobleck plan: error: argument --nodes: {why}")
        assert not (tmp_path / ".oobleck-cache").exists()


def test_outcome_exit_status_follows_the_closed_record() -> None:
    """`oobleck outcome` gives a batch script the run's result: a lost node's exit status is not it."""
    from oobleck_elastic.cluster_ops import OUTCOME_OPEN, outcome
    from oobleck_elastic.records.job import ClosedRecord

    assert outcome(ClosedRecord(time=1.0, reason="finished 12 steps"), "7") == (0, "run 7 finished: finished 12 steps")
    assert outcome(ClosedRecord(time=1.0, reason="ValueError at step 3", failed=True), "7") == (
        1,
        "run 7 failed: ValueError at step 3",
    )
    stopped = ClosedRecord(time=1.0, reason="stopped at step 4 of 12 on request (oobleck stop)", stopped=True)
    assert outcome(stopped, "7") == (
        4,
        "run 7 stopped before its last step: stopped at step 4 of 12 on request (oobleck stop)",
    )
    code, line = outcome(None, "7")
    assert code == OUTCOME_OPEN == 3 and line.startswith("run 7 is not closed: it still runs, or every node stopped")


def test_plan_previews_a_loss_of_a_plan_it_printed(tmp_path: Path) -> None:
    cfg = str(ROOT / "configs/gpt3-175b.yaml")
    prof = str(ROOT / "configs/profiles/gpt3-175b-tp{tp}.json")
    first = oobleck("plan", "--config", cfg, "--nodes", "64", "--profile", prof, "--json", cwd=ROOT)
    assert first.returncode == 0, first.stderr
    (tmp_path / "plan.json").write_text(first.stdout)
    lose = oobleck(
        "plan",
        "--config",
        cfg,
        "--profile",
        prof,
        "--previous",
        str(tmp_path / "plan.json"),
        "--lose",
        "node5",
        cwd=ROOT,
    )
    assert lose.returncode == 0, lose.stderr
    assert lose.stdout.startswith("losing node5: ") and "bytes to receive: " in lose.stdout
    both = oobleck("plan", "--config", cfg, "--nodes", "8", "--lose", "node1", cwd=ROOT)
    assert both.returncode == 2 and both.stderr.strip() == (
        "oobleck plan: error: give --nodes N, or --previous PLAN.json with --lose NODE[,NODE...] (not both)"
    )
