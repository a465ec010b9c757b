"""The harder failure scenarios, each against the single-process reference: the leader
dies; a node dies while the survivors are entering the next generation; a node dies while
another joins; two nodes die at once with f=2; 8 nodes become 6 (where the published Oobleck raised KeyError: 1: no
template of the old sizes fits the new count). Real torchrun nodes, real etcd, gloo.

The victims are chosen from the plan in etcd (`kill_node` SIGKILLs an agent's whole process
tree); `when` fires each kill at the moment the test names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import assert_same, paced, run_job, tiny_profile, when

pytestmark = pytest.mark.slow


def _plan(client, keys, generation=None):
    from oobleck_elastic.planning import Plan

    data = client.get_json(keys.plan if generation is None else keys.plan_at(generation))[0]
    return Plan.from_json(data) if data is not None else None


def _pid(client, keys, node: str) -> int:
    from oobleck_elastic.rendezvous.membership import live_nodes

    return next(r.agent_pid for r in live_nodes(client, keys) if r.node_id == node)


def _leader(client, keys) -> str:
    from oobleck_elastic.records.read import read_leader

    leader = read_leader(client, keys)
    return leader.node_id if leader is not None else ""


def _step(client, keys) -> int:
    return (client.get_json(keys.progress)[0] or {}).get("step", 0)


def _events(endpoint: str, keys) -> list:
    from oobleck_elastic.etcd import EtcdSettings, connect
    from oobleck_elastic.rendezvous.membership import read_events

    client = connect(EtcdSettings(endpoint=endpoint))
    try:
        return [ev for _, ev in read_events(client, keys)]
    finally:
        client.close()


@pytest.mark.core
def test_kill_the_leader(tmp_path: Path, etcd_server, run_id) -> None:
    """The leader's node dies mid-run with a 30 s lease TTL: its workers' peers check in at the
    roll call, a deputy finds the leader's agent gone (its liveness socket) or silent (a ping) and
    revokes its lease, a new leader re-plans."""
    from launcher.faults import kill_node
    from oobleck_elastic.records.keys import Keys

    keys = Keys("/oobleck", run_id)
    killed: list[str] = []

    def kill_leader(c) -> None:
        killed.append(_leader(c, keys))
        kill_node(_pid(c, keys, killed[0]))

    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4"],
        8,
        tiny_profile(tmp_path / "p.json"),
        rdzv="lease_ttl=30,settle=0.2,last_call_timeout=1",
        killed_by_test=1,
        during=lambda proc: when(etcd_server.endpoint, proc, lambda c: _step(c, keys) >= 3, kill_leader),
    )
    events = _events(etcd_server.endpoint, keys)
    revoked = [e for e in events if e.kind == "lost" and "revoked its lease" in e.detail]
    assert [e.node for e in revoked] == killed, [e.line() for e in events]
    leaders = [e.node for e in events if e.kind == "leader"]
    assert leaders[0] == killed[0] and len(leaders) == 2, [e.line() for e in events]
    assert [e.node for e in events if e.kind == "plan" and e.generation == 2] == [leaders[1]]
    assert_same(job, ref)


def test_kill_during_reconfiguration(tmp_path: Path, etcd_server, run_id) -> None:
    """A node dies at step 3; the moment generation 2 is published, its former pipeline partner
    dies too, while every survivor is still entering generation 2 (each waits 5 s before it
    connects: OOBLECK_SLOW_ENTRY). The survivors stalled in generation 2's rendezvous find it out,
    enter generation 3 on the two nodes of the intact pipeline, which still hold every layer, and
    finish with the reference weights without a checkpoint restore."""
    from launcher.faults import kill_node
    from oobleck_elastic.records.keys import Keys

    keys = Keys("/oobleck", run_id)
    victims: list[str] = []

    def first_kill(c) -> None:
        plan = _plan(c, keys)
        leader = _leader(c, keys)
        pipe = next(p for p in plan.pipelines if leader not in {s.node for s in p.stages})
        victims.extend(s.node for s in pipe.stages)
        kill_node(_pid(c, keys, victims[0]))

    def chain(proc) -> None:
        when(etcd_server.endpoint, proc, lambda c: _step(c, keys) >= 3, first_kill)
        when(
            etcd_server.endpoint,
            proc,
            lambda c: _plan(c, keys).generation >= 2,
            lambda c: kill_node(_pid(c, keys, victims[1])),
            timeout=60,
        )

    # generation 2 is one 3-stage pipeline: had the second kill landed after every survivor had
    # entered it, its layers would be gone for real and the checkpoint restored; the slow entry
    # makes the kill land before (the checkpoint is there for that case, which must not happen)
    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4"],
        10,
        tiny_profile(tmp_path / "p.json"),
        extra=["checkpoint.interval_steps=2"],
        killed_by_test=2,
        during=chain,
        env={"OOBLECK_SLOW_ENTRY": "*@2:5"},
    )
    final = _plan_of_run(etcd_server.endpoint, keys)
    assert final.generation == 3 and not set(victims) & set(final.nodes), out[-4000:]
    # nobody entered generation 2 and no layer was lost: the survivors came from generation 1
    assert "entered from generation 2" not in out and "entered from generation 1" in out, out[-4000:]
    assert "no surviving copy" not in out and "restored checkpoint" not in out, out[-4000:]
    assert_same(job, ref)


def test_a_kill_during_a_drains_hand_over_loses_no_layer(tmp_path: Path, etcd_server, run_id) -> None:
    """A node is drained (SIGTERM to its agent) at step 3; the moment the plan without it is
    published and the survivors have begun to enter it, the node holding the other copy of its
    layers dies, before the drained node could hand them over (every worker waits 5 s before it
    connects to generation 2; steps take 0.5 s). The drained
    node, alive and still holding the committed layers, does not leave: the next plan names it a
    donor again, it hands them over there, and the job ends with the reference weights, with no
    checkpoint on disk."""
    import os
    import signal
    import time

    from launcher.faults import kill_node
    from oobleck_elastic.records.keys import Keys

    keys = Keys("/oobleck", run_id)
    drained: list[str] = []

    def drain(c) -> None:
        plan, leader = _plan(c, keys), _leader(c, keys)
        mine = next(p for p in plan.pipelines if leader in {s.node for s in p.stages})
        other = next(p for p in plan.pipelines if p is not mine)
        j = next(i for i, s in enumerate(mine.stages) if s.node != leader)  # a stage the leader does not hold
        drained.extend([mine.stages[j].node, other.stages[j].node])  # its two holders: both not the leader
        os.kill(_pid(c, keys, drained[0]), signal.SIGTERM)

    def chain(proc) -> None:
        when(etcd_server.endpoint, proc, lambda c: _step(c, keys) >= 3, drain)
        when(
            etcd_server.endpoint,
            proc,
            lambda c: _plan(c, keys).generation >= 2,
            lambda c: (time.sleep(2.0), kill_node(_pid(c, keys, drained[1]))),  # once the survivors finished step 3
            timeout=60,
        )

    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4", "--min-nodes", "2"],
        10,
        tiny_profile(tmp_path / "p.json"),
        killed_by_test=1,
        during=chain,
        env={"OOBLECK_SLOW_ENTRY": "*@2:5", **paced(1, 10, 0.5)},  # steps long enough to drain at a boundary
    )
    assert "handing layers over to generation 2 failed" in out, out[-4000:]
    assert f"node {drained[0]} was drained; its layers were handed over to generation 3" in out, out[-4000:]
    assert "no surviving copy" not in out and "restored checkpoint" not in out, out[-4000:]
    final = _plan_of_run(etcd_server.endpoint, keys)
    assert final.generation == 3 and not set(drained) & set(final.nodes), out[-4000:]
    assert_same(job, ref)


def _plan_of_run(endpoint: str, keys):
    from oobleck_elastic.etcd import EtcdSettings, connect

    client = connect(EtcdSettings(endpoint=endpoint))
    try:
        return _plan(client, keys)
    finally:
        client.close()


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
def test_kill_a_node_while_another_joins(tmp_path: Path, etcd_server, run_id) -> None:
    """A fifth node joins at step 1; the moment the plan that adds it is published (it is about to
    receive its layers), a node that is not the leader dies. The job ends on the four live nodes,
    the newcomer included, with the reference weights."""
    from launcher.faults import kill_node
    from oobleck_elastic.records.keys import Keys

    keys = Keys("/oobleck", run_id)
    victims: list[str] = []

    def joined(c) -> bool:
        plan = _plan(c, keys)
        return plan is not None and "node4" in plan.nodes

    def kill_one(c) -> None:
        plan, leader = _plan(c, keys), _leader(c, keys)
        victims.append(next(n for n in plan.nodes if n not in (leader, "node4")))
        kill_node(_pid(c, keys, victims[0]))

    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4", "--join", "1"],
        40,
        tiny_profile(tmp_path / "p.json"),
        killed_by_test=1,
        during=lambda proc: when(etcd_server.endpoint, proc, joined, kill_one),
        env=paced(1, 40, 1.5),  # 58 s or more: the joiner is admitted long before the last step
    )
    final = _plan_of_run(etcd_server.endpoint, keys)
    assert "node4" in final.nodes and victims[0] not in final.nodes and len(final.nodes) == 4, out[-4000:]
    assert_same(job, ref)


def test_two_simultaneous_failures_with_f2(tmp_path: Path, etcd_server, run_id) -> None:
    """f=2 on six nodes: three 2-stage pipelines. The first-stage nodes of two pipelines die at the
    same moment; the third pipeline still holds every layer, so the four survivors re-plan into
    two pipelines and copy what they miss from it (no checkpoint restore)."""
    from launcher.faults import kill_node
    from oobleck_elastic.records.keys import Keys

    keys = Keys("/oobleck", run_id)
    victims: list[str] = []

    def kill_two(c) -> None:
        plan, leader = _plan(c, keys), _leader(c, keys)
        assert len(plan.pipelines) == 3, plan.to_json()
        victims.extend([p.stages[0].node for p in plan.pipelines if p.stages[0].node != leader][:2])
        pids = [_pid(c, keys, v) for v in victims]
        for pid in pids:
            kill_node(pid)

    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "6"],
        10,
        tiny_profile(tmp_path / "p.json"),
        extra=["fault_tolerance.f=2"],
        killed_by_test=2,
        during=lambda proc: when(etcd_server.endpoint, proc, lambda c: _step(c, keys) >= 3, kill_two),
    )
    final = _plan_of_run(etcd_server.endpoint, keys)
    assert len(final.nodes) == 4 and not set(victims) & set(final.nodes), out[-4000:]
    assert "restored checkpoint" not in out and "layer bytes moved" in out
    assert_same(job, ref)


def seed_002_profile(path: Path) -> Path:
    """6 layers, at most 2 per device (n0 = 3), the outer ones 3x slower: 8 nodes run as two
    4-stage pipelines, 6 nodes as two 3-stage ones, a size the 8-node plan never used."""
    from oobleck_elastic.planning import LayerProfile, ModelProfile

    b, w = int(0.1 * 1024**3), [3, 1, 1, 1, 1, 3]
    ModelProfile(
        layers=[
            LayerProfile(
                name=f"l{i}",
                forward_s=0.01 * w[i],
                backward_s=0.02 * w[i],
                param_bytes=b,
                grad_bytes=b,
                optimizer_bytes=2 * b,
                activation_bytes=0,
            )
            for i in range(6)
        ]
    ).save(path)
    return path


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
def test_eight_nodes_become_six(tmp_path: Path, etcd_server, run_id) -> None:
    """Seed 002's case: 8 nodes (two 4-stage pipelines) lose two at once (the first stage of one
    pipeline, the last of the other, so every layer keeps a copy); no template of the old size
    covers 6 nodes, and the global re-plan runs two 3-stage pipelines."""
    from launcher.faults import kill_node
    from oobleck_elastic.records.keys import Keys

    keys = Keys("/oobleck", run_id)
    victims: list[str] = []

    def kill_two(c) -> None:
        plan = _plan(c, keys)
        assert [len(p.stages) for p in plan.pipelines] == [4, 4], plan.to_json()
        victims.extend([plan.pipelines[0].stages[0].node, plan.pipelines[1].stages[-1].node])
        pids = [_pid(c, keys, v) for v in victims]
        for pid in pids:
            kill_node(pid)

    profile = seed_002_profile(tmp_path / "p.json")
    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "8"],
        8,
        profile,
        extra=["planning.device_memory_gb=0.85"],
        killed_by_test=2,
        during=lambda proc: when(etcd_server.endpoint, proc, lambda c: _step(c, keys) >= 3, kill_two),
    )
    final = _plan_of_run(etcd_server.endpoint, keys)
    assert [len(p.stages) for p in final.pipelines] == [3, 3] and not set(victims) & set(final.nodes), out[-4000:]
    assert "restored checkpoint" not in out
    assert_same(job, ref)


def test_a_kill_and_a_false_death_lose_nothing(tmp_path: Path, etcd_server, run_id) -> None:
    """At step 3 node a is killed and the agent of node b, which holds the same layers, is stopped
    (SIGSTOP; its workers run on) until its lease expired: the leader re-plans without a at once
    and, once b's record is gone, holds the re-plan that would lose the layers only b holds. b's
    agent, continued, comes back `returned` (fenced, same node id), the leader names it a donor,
    and the job finishes with the reference weights: no layer lost, no checkpoint restored."""
    import os
    import signal
    import time

    from launcher.faults import kill_node
    from oobleck_elastic.planning.plan.plan import device_holders
    from oobleck_elastic.records.keys import Keys

    keys = Keys("/oobleck", run_id)
    stopped: list[int] = []
    pair: list[str] = []

    def strike(c) -> None:
        leader = _leader(c, keys)
        holders = next(h for h in device_holders(_plan(c, keys)) if len(h) == 2 and leader not in h)
        pair.extend(sorted(holders))  # a, b
        stopped.append(_pid(c, keys, pair[1]))
        os.kill(stopped[0], signal.SIGSTOP)  # the agent alone: torchrun's workers live in their own sessions
        kill_node(_pid(c, keys, pair[0]))

    def resume(_c) -> None:
        time.sleep(0.5)  # its lease expired for sure: the agent finds it gone at its next refresh
        os.kill(stopped[0], signal.SIGCONT)

    def chain(proc) -> None:
        try:
            when(etcd_server.endpoint, proc, lambda c: _step(c, keys) >= 3, strike)
            when(etcd_server.endpoint, proc, lambda c: c.get_json(keys.node(pair[1]))[0] is None, resume, timeout=60)
        finally:
            if stopped:
                os.kill(stopped[0], signal.SIGCONT)

    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4"],
        12,
        tiny_profile(tmp_path / "p.json"),
        rdzv="lease_ttl=4,settle=0.2,last_call_timeout=1",
        killed_by_test=1,
        during=chain,
        env=paced(3, 12, 1.0),
    )
    events = _events(etcd_server.endpoint, keys)
    lines = [e.line() for e in events]
    assert any(e.kind == "renew" and e.node == pair[1] and "returned" in e.detail for e in events), lines
    assert "have no copy left but on" in out, out[-4000:]
    donors = [line for line in out.splitlines() if "handed layers" in line and "as a donor" in line]
    assert donors and f"node {pair[1]}" in donors[0], out[-4000:]
    assert re.search(r"layers by source: \d+ from replicas \(.*\), [1-9]\d* from returned nodes", out), out[-4000:]
    assert "no surviving copy" not in out and "restored checkpoint" not in out, out[-4000:]
    assert_same(job, ref)
