"""The GPU checks' dry runs (docs/gpu.md): `bash bench/gpu_check.sh --dry-run` runs every one-GPU
check's CPU half (a one-node job under the local launcher among them) and prints one JSON line per
check with a passing verdict, its bound and its device, and nothing else on stdout; without a GPU
and without `--dry-run` it refuses in one line. `bash bench/multigpu_check.sh --dry-run` accepts
every command and config of the two machines' four scenarios, and with `--cpu` its two machines'
drivers, as two processes of this one, run the kill scenario under gloo: machine 1 SIGKILLs its
second agent at step 4 and machine 0 finds the job's weights equal to the reference's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_checks import CHECKS
from bench.multigpu import SCENARIOS

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHON": sys.executable}


def json_lines(stdout: str) -> list[dict]:
    """Every line of `stdout` as JSON; fails on a line that is not a JSON object."""
    lines = []
    for line in stdout.splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"stdout holds a line that is not JSON: {line!r}") from None
        assert isinstance(lines[-1], dict), line
    return lines


@pytest.mark.timeout(400)
def test_the_gpu_checks_dry_run_prints_one_passing_json_line_per_check() -> None:
    res = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=360
    )
    lines = json_lines(res.stdout)
    assert [x["check"] for x in lines] == list(CHECKS), res.stderr[-3000:]
    failed = {x["check"]: x.get("error") or x for x in lines if x["verdict"] != "pass"}
    assert not failed, json.dumps(failed)[:4000]
    for x in lines:
        assert x["device"] == "cpu" and x["dry_run"] is True and x["bound"], x
        assert x["bench"] == "gpu_checks" and x["commit"]
    assert res.returncode == 0, res.stderr[-3000:]
    by = {x["check"]: x for x in lines}
    assert by["adamw_drift"]["fused_drift"] == 0.0  # the same kernel on holder and keeper: bit-identical
    assert by["group_cycles"]["cycles"] == 20 and by["job_vs_reference"]["max_rel_diff_fp32"] == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_the_check_says_to_use_the_dry_run_in_one_line() -> None:
    res = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, env=ENV)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == (
        "bench/gpu_check.sh needs a CUDA GPU (none here); run bash bench/gpu_check.sh --dry-run for the CPU half\n"
    )


def test_the_multigpu_dry_run_accepts_both_machines_commands_for_every_scenario() -> None:
    res = subprocess.run(
        ["bash", "bench/multigpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True, env=ENV
    )
    lines = json_lines(res.stdout)
    assert [x["check"] for x in lines] == [f"multigpu_{name}" for name in SCENARIOS], res.stderr[-3000:]
    for x in lines:
        assert x["verdict"] == "pass" and x["problems"] == [], x
        # four nodes of two GPUs: a 2-stage pipeline per node, data parallel across nodes (and hosts)
        assert x["plans"]["4"] == [[[0, 3], [3, 6]]] * 4 and len(x["plans"]["3"]) == 3
    assert res.returncode == 0


@pytest.mark.extended  # a 4-node job of 8 workers and its reference: 1.5-4 minutes on 2 cores
@pytest.mark.timeout(600)
def test_the_multigpu_drivers_run_the_kill_scenario_on_cpus(tmp_path: Path, etcd_server, run_id) -> None:
    def driver(machine: int) -> list[str]:
        return ["bash", "bench/multigpu_check.sh", "--cpu", "--machine", str(machine), "--scenario", "kill"] + [
            "--endpoint",
            etcd_server.endpoint,
            "--shared",
            str(tmp_path),
            "--tag",
            run_id,
        ]

    m1 = subprocess.Popen(driver(1), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        m0 = subprocess.run(driver(0), cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=500)
        out1, err1 = m1.communicate(timeout=120)
    finally:
        if m1.poll() is None:
            m1.kill()
            m1.wait()
    (line0,), (line1,) = json_lines(m0.stdout), json_lines(out1)
    assert line1["acted"] == "SIGKILL agent 1" and line1["agent_exits"] == {"0": 0, "1": -9}, err1[-3000:]
    assert line1["verdict"] == "pass" and line1["reconfigured"] is True, line1
    assert line0["agent_exits"] == {"0": 0, "1": 0} and line0["verdict"] == "pass", (line0, m0.stderr[-3000:])
    assert m0.returncode == 0 and m1.returncode == 0
