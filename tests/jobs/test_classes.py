"""A mixed fleet running: nodes of two device classes in one job, a kill of each, the reference's weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from oobleck_elastic.checkpoint import latest_checkpoint, read_manifest
from oobleck_elastic.etcd import EtcdSettings, connect
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.records.plans import parse_plan

from helpers import assert_same, run_job, tiny_profile

pytestmark = pytest.mark.slow

# fast: 1.25 GiB devices (the tiny profile's n0 = 2: two-stage pipelines); slow: half the speed
# and twice the memory (n0 = 1: the whole model on one device). Paced devices (k = 1) make each
# node's pass take its class's planned time, so the slow class is slow.
CLASSES = [
    "planning.profiled_class=fast",
    "planning.classes.fast.speed=1",
    "planning.classes.slow.speed=0.5",
    "planning.classes.slow.device_memory_gb=2.5",
    "training.paced_devices=1",
]


def _classes(plan: dict) -> list[set[str]]:
    return [{s["device_class"] for s in p["stages"]} for p in plan["pipelines"]]


def test_a_kill_of_each_class_is_survived_with_the_reference_weights(tmp_path: Path, etcd_server, run_id) -> None:
    steps = 8
    profile = tiny_profile(tmp_path / "profile.json")
    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4", "--device-classes", "fast,fast,slow,slow", "--kill", "2@3", "--kill", "1@5"]
        + ["--faults-at-full-plan"],  # under load the first plans may hold fewer nodes: kill in the 4-node one
        steps,
        profile,
        job_extra=CLASSES,
    )
    assert "[launcher] killed node 2" in out and "[launcher] killed node 1" in out, out[-4000:]
    assert "restart" not in out.lower().replace("restarts=", "")
    assert_same(job, ref)
    manifest = read_manifest(latest_checkpoint(tmp_path / "job" / "ckpt"))
    assert manifest["step"] == steps
    # the last plan: the surviving slow node holds a whole replica; the fast one, alone, cannot
    last = manifest["plan"]
    assert _classes(last) == [{"slow"}] and len(last["spares"]) == 1
    # the first: a two-stage pipeline on the fast nodes, the slow nodes in pipelines of their own
    # (one of two stages or two of one: the same step in the model), every node used
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    try:
        plans = {
            p.generation: p
            for k, d in client.get_prefix_json(Keys("/oobleck", run_id).plans)
            if (p := parse_plan(d, key=k))
        }
    finally:
        client.close()
    first = plans[min(g for g, p in plans.items() if len(p.nodes) == 4)]
    assert [len(p.stages) for p in first.pipelines if p.stages[0].device_class == "fast"] == [2]
    assert sum(len(p.stages) for p in first.pipelines if p.stages[0].device_class == "slow") == 2
    assert all(len({s.device_class for s in p.stages}) == 1 for p in first.pipelines) and first.spares == ()
    # after the slow node's kill: both classes still train, on the three nodes left
    assert any(
        len(p.nodes) == 3 and {s.device_class for q in p.pipelines for s in q.stages} == {"fast", "slow"}
        for p in plans.values()
    )


def test_a_node_of_an_undefined_class_is_refused_in_one_line(tmp_path: Path, etcd_server, run_id) -> None:
    profile = tiny_profile(tmp_path / "profile.json")
    out, _, _ = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "1", "--device-classes", "medium"],
        2,
        profile,
        job_extra=CLASSES,
        expect_failure=True,
    )
    assert (
        "OOBLECK_DEVICE_CLASS=medium: the job config's planning.classes defines fast, slow; add "
        "planning.classes.medium, or give one of them"
    ) in out, out[-4000:]
