"""The local launcher's decisions, without starting a job: worker threads, its command line."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from launcher.local import LocalCluster, Roles, build_parser, parse_at, resolve, worker_threads


def test_workers_share_the_cores_unless_omp_num_threads_is_set() -> None:
    assert worker_threads(2, 4, {}) == (
        1,
        "each worker computes on 1 thread(s): 2 core(s) over up to 4 worker(s) (set OMP_NUM_THREADS to choose)",
    )
    assert worker_threads(16, 4, {})[0] == 4
    assert worker_threads(16, 5, {})[0] == 3
    assert worker_threads(2, 1, {})[0] == 2
    threads, line = worker_threads(2, 4, {"OMP_NUM_THREADS": "2"})
    assert threads is None and line == "each worker computes on OMP_NUM_THREADS=2 thread(s), as set (2 core(s))"


def test_every_node_the_job_may_run_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("launcher.local.cores_available", lambda: 8)
    args = build_parser().parse_args(["--nodes", "2", "--max-nodes", "4", "--nproc-per-node", "2"])
    cluster = LocalCluster(args, ["examples/train.py"])
    assert cluster.threads == 1 and cluster.node_env()["OMP_NUM_THREADS"] == "1"  # 8 cores over 4 x 2 workers
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    cluster = LocalCluster(argparse.Namespace(**{**vars(args), "nproc_per_node": 1}), ["examples/train.py"])
    assert cluster.threads is None and cluster.node_env()["OMP_NUM_THREADS"] == "3"


def test_help_and_a_missing_script() -> None:
    run = [sys.executable, "-m", "launcher.local"]
    help_ = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0 and "--kill NODE@STEP" in help_.stdout
    missing = subprocess.run([*run, "--nodes", "2"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2
    assert missing.stderr.strip().endswith(
        "error: give the training script after --, e.g. -- examples/train.py --config CFG"
    )
    bad = subprocess.run(
        [*run, "--nodes", "two", "--", "examples/train.py"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "argument --nodes: invalid int value: 'two'" in bad.stderr


def test_a_target_is_a_number_a_node_id_or_a_role() -> None:
    assert parse_at("2@5") == (2, 5) and parse_at("node3@0") == ("node3", 0) and parse_at("leader@4") == ("leader", 4)
    for bad in ("two@5", "2", "boss@1", "node@1", "1@x"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not NODE@STEP: NODE a launcher number"):
            parse_at(bad)
    roles = Roles(ids={0: "node1", 1: "node0", 2: "node2", 3: "node3"}, leader="node0", rank0="node0")
    live = [0, 1, 2, 3]
    assert resolve("leader", live, roles) == (1, "", False) and resolve("rank0", live, roles) == (1, "", False)
    assert resolve("follower", live, roles) == (0, "", False)
    assert resolve("node2", live, roles) == (2, "", False) and resolve(3, live, roles) == (3, "", False)
    assert resolve(3, [0, 1, 2], roles) == (None, "there is no running node 3", False)
    assert resolve("node3", [0, 1, 2], roles) == (None, "no running node is node3", False)
    assert resolve("follower", [1], roles) == (None, "every running node is the leader or rank 0", False)
    unknown = Roles(ids={0: "node0"})
    assert resolve("leader", live, unknown) == (None, "the leader is not known yet", True)
    assert resolve("follower", live, unknown) == (None, "the leader, rank 0 or a node's id is not known yet", True)
    # a node whose id is not known yet may be the one named: ask again, do not drop the kill
    assert resolve("node5", live, unknown) == (None, "no running node is node5 yet", True)
    partly = Roles(ids={0: "node1"}, leader="node0", rank0="node1")
    assert resolve("leader", [0, 1], partly) == (None, "no running node is node0 yet", True)
    assert resolve("follower", [0, 1], partly)[2] is True
    assert roles.describe(1) == "node0, the leader and rank 0" and roles.describe(2) == "node2"
    assert Roles(ids={0: "node1"}, leader="node1", rank0="node0").describe(0) == "node1, the leader"
    assert unknown.describe(3) == ""
