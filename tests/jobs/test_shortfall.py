"""A launched job that gives less than its config asks says so, and fails at its start under
`fault_tolerance.strict`: f = 1 asks for two pipelines, and the tiny model needs two nodes for
one (n0 = 2), so two nodes give one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import run_job, tiny_profile
from oobleck_elastic.etcd import EtcdSettings, connect
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.rendezvous.membership import read_events

pytestmark = pytest.mark.slow

ASKED = ["fault_tolerance.f=1"]
SHORT = "generation 1 gives less than the config asks: 1 pipeline(s) instead of f+1=2 (fault_tolerance.f=1): "


@pytest.mark.core
def test_a_shortfall_is_said_by_the_leader_and_fails_the_start_under_strict(
    tmp_path: Path, etcd_server, run_id
) -> None:
    profile = tiny_profile(tmp_path / "profile.json")
    out, _, _ = run_job(tmp_path / "said", etcd_server, run_id + "a", ["--nodes", "2"], 2, profile, extra=ASKED)
    assert re.search(rf"node node[01]: {re.escape(SHORT)}only 2 nodes \(n0=2\)", out), out[-4000:]  # the leader's line
    strict = [*ASKED, "fault_tolerance.strict=true"]
    out, _, _ = run_job(
        tmp_path / "strict", etcd_server, run_id + "b", ["--nodes", "2"], 2, profile, extra=strict, expect_failure=True
    )
    keys = Keys("/oobleck", run_id + "b")
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    try:
        closed = client.get_json(keys.closed)[0] or {}
        plans = [ev.generation for _, ev in read_events(client, keys) if ev.kind == "plan"]
    finally:
        client.close()
    assert closed.get("failed") is True and closed["reason"].startswith(f"fault_tolerance.strict: {SHORT}"), closed
    assert closed.get("known_error") is True, closed  # a setting to change: every agent exits 2
    assert out.count("exited with status 2") == 2, out[-3000:]
    assert closed["reason"].endswith("or set fault_tolerance.strict=false to train with less"), closed
    assert plans == [], plans  # refused before any plan was published: no step trained with less
    assert "[launcher] done:" in out and "2 failed: fault_tolerance.strict: generation 1" in out, out[-3000:]
