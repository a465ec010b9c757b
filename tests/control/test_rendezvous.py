"""Rendezvous handler, leader and cluster ops against a real etcd, with several simulated nodes
(handlers) in this process. A crash is simulated by stopping a node's lease refresh without
revoking it, exactly what etcd sees when an agent is SIGKILLed; test_torchrun.py does the same
with real torchrun processes."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Optional

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from oobleck_elastic import cluster_ops
from oobleck_elastic.etcd import EtcdError, EtcdSettings, connect
from helpers import TINY_PROFILE_OVERRIDES, eventually, tiny_profile
from oobleck_elastic.planning import Plan
from oobleck_elastic.rendezvous.handler import OobleckRendezvousHandler
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.records.control import AnsweredRecord, Checkin, CheckinKind, ReadyRecord, Roster
from oobleck_elastic.records.read import read_answered
from oobleck_elastic.rendezvous import detect
from oobleck_elastic.rendezvous.liveness import LIVENESS_LOST
from oobleck_elastic.rendezvous.membership import read_events

SOCKET_LOST = re.escape(LIVENESS_LOST) + r"; last sign of life \d+\.\ds earlier \(its connection closed then\)"
"""A `lost` event's detail by a liveness socket whose connection the detector held."""

ROOT = Path(__file__).resolve().parents[2]
TTL = 1.0


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    return tiny_profile(tmp_path / "profile.json")  # n0 = 2 nodes


class Cluster:
    """Simulated nodes: one handler each, rendezvous run in threads."""

    def __init__(
        self, endpoint: str, run_id: str, profile: Path, *, min_nodes: int, max_nodes: int, **conf: str
    ) -> None:
        self.endpoint, self.run_id, self.profile = endpoint, run_id, profile
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.conf = {"lease_ttl": str(TTL), "settle": "0.1", "last_call_timeout": "0.3", **conf}
        self.handlers: list[OobleckRendezvousHandler] = []
        self.client = connect(EtcdSettings(endpoint=endpoint))
        self.keys = Keys("/oobleck", run_id)

    def handler(self) -> OobleckRendezvousHandler:
        params = RendezvousParameters(
            backend="oobleck",
            endpoint=self.endpoint,
            run_id=self.run_id,
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            **self.conf,
        )
        argv = [
            "torchrun",
            "--nproc-per-node=1",
            "train.py",
            "--config",
            str(ROOT / "configs/gpt2-tiny.yaml"),
            f"planning.profile_path={self.profile}",
            *TINY_PROFILE_OVERRIDES,
        ]
        h = OobleckRendezvousHandler(params, argv=argv)
        self.handlers.append(h)
        return h

    def start(self, n: int) -> list[dict]:
        """Start n nodes; each result dict gets 'info' (or 'error') when its rendezvous returns."""
        results = []
        for _ in range(n):
            h, box = self.handler(), {}
            box["handler"] = h

            def run(h=h, box=box):
                try:
                    box["info"] = h.next_rendezvous()
                    # what the node's (single) worker does once it has started: report ready
                    self.client.put_json(
                        self.keys.ready_worker(h.member.node_id, 0), ReadyRecord(time=time.time()).to_json()
                    )
                except Exception as err:  # noqa: BLE001 - the test inspects it
                    box["error"] = err

            box["thread"] = threading.Thread(target=run, daemon=True)
            box["thread"].start()
            results.append(box)
        return results

    def plan(self) -> Optional[Plan]:
        data, _ = self.client.get_json(self.keys.plan)
        return Plan.from_json(data) if data is not None else None

    def wait_plan(self, check, timeout: float = 10.0) -> Plan:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            plan = self.plan()
            if plan is not None and check(plan):
                return plan
            time.sleep(0.05)
        raise AssertionError(
            f"no plan matching the check within {timeout}s; last: {self.plan() and self.plan().to_json()}"
        )

    def crash(self, h: OobleckRendezvousHandler) -> None:
        """What a SIGKILL looks like to etcd: the lease is no longer refreshed, nothing is revoked."""
        h.leader.stop()
        h.member.close(revoke=False)
        h._stopping.set()  # a dead agent answers no pings either
        h.view.close()

    def events(self) -> list:
        return [ev for _, ev in read_events(self.client, self.keys)]

    def close(self) -> None:
        for h in self.handlers:
            if h.member is not None and not h.member._stop.is_set():
                h.shutdown()
        self.client.close()


@pytest.fixture
def cluster_factory(etcd_server, run_id, profile_path):
    saved = dict(os.environ)  # handlers export OOBLECK_* for their workers: keep them out of later tests
    made = []

    def make(**kw) -> Cluster:
        c = Cluster(etcd_server.endpoint, run_id, profile_path, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
    os.environ.clear()
    os.environ.update(saved)


def leading(boxes: list[dict]) -> OobleckRendezvousHandler:
    """The handler whose agent leads."""
    return next(b["handler"] for b in boxes if b["handler"].leader.is_leader.is_set())


def join_all(boxes: list[dict], timeout: float = 10.0) -> None:
    for box in boxes:
        box["thread"].join(timeout)
        assert "info" in box, box.get("error", "rendezvous did not return")


def test_nodes_rendezvous_then_a_late_node_is_admitted(cluster_factory) -> None:
    c = cluster_factory(min_nodes=2, max_nodes=4)
    first = c.start(3)
    join_all(first)
    plan = c.plan()
    assert plan.generation == 1 and plan.nodes == ("node0", "node1", "node2")
    for box in first:
        info = box["info"]
        assert (info.rank, info.world_size) == (0, 1)
        assert box["handler"].num_nodes_waiting() == 0
    late = c.start(1)
    join_all(late)  # admitted at once; planned when its worker is ready
    plan = c.wait_plan(lambda p: p.generation == 2)
    assert set(plan.nodes) == {"node0", "node1", "node2", "node3"}
    assert all(b["handler"].num_nodes_waiting() == 0 for b in first + late)
    kinds = [(e.kind, e.node) for e in c.events()]
    assert kinds.count(("plan", kinds[-1][1])) >= 1
    assert [e.generation for e in c.events() if e.kind == "plan"] == [1, 2]
    assert "join: +node3" in [e for e in c.events() if e.kind == "plan"][-1].detail


def test_crashed_node_vanishes_within_ttl_and_is_replanned(cluster_factory) -> None:
    c = cluster_factory(min_nodes=3, max_nodes=3)
    boxes = c.start(3)
    join_all(boxes)
    leader = leading(boxes)
    victim = next(b["handler"] for b in boxes if b["handler"] is not leader)
    gone = victim.member.node_id
    t0 = time.monotonic()
    c.crash(victim)
    while c.client.get_json(c.keys.node(gone))[0] is not None:
        time.sleep(0.02)
        assert time.monotonic() - t0 < TTL + 1.0, "record did not vanish within TTL + 1 s"
    plan = c.wait_plan(lambda p: gone not in p.nodes, timeout=TTL + 2)
    assert plan.generation == 2 and len(plan.nodes) == 2
    lost = [e for e in c.events() if e.kind == "lost"]
    assert [(e.node, e.generation) for e in lost] == [(gone, 2)]


def test_leader_death_elects_a_new_leader_that_publishes(cluster_factory) -> None:
    c = cluster_factory(min_nodes=3, max_nodes=3)
    boxes = c.start(3)
    join_all(boxes)
    old = leading(boxes)
    dead = old.member.node_id
    c.crash(old)
    plan = c.wait_plan(lambda p: dead not in p.nodes, timeout=TTL + 3)
    new_leaders = [b["handler"] for b in boxes if b["handler"] is not old and b["handler"].leader.is_leader.is_set()]
    assert len(new_leaders) == 1
    leader_events = [e.node for e in c.events() if e.kind == "leader"]
    assert leader_events == [dead, new_leaders[0].member.node_id]
    plan_by = [e.node for e in c.events() if e.kind == "plan" and e.generation == plan.generation]
    assert plan_by == [new_leaders[0].member.node_id]


def checkin(c: Cluster, plan: Plan, node: str, kind: str) -> None:
    """What a worker of `node` writes when it sees a failure (or stalls joining `plan`)."""
    c.client.put_json(
        c.keys.checkin(plan.generation, node, 0), Checkin(time=time.time(), kind=CheckinKind(kind)).to_json()
    )


def three_nodes_up(cluster_factory) -> tuple:
    """Three agents whose leases run for a minute, joined: (cluster, boxes, plan, leading handler)."""
    c = cluster_factory(min_nodes=3, max_nodes=3, lease_ttl="60")
    boxes = c.start(3)
    join_all(boxes)
    return c, boxes, c.plan(), leading(boxes)


def test_dead_leader_is_replaced_by_a_deputy_without_waiting_for_its_lease(cluster_factory) -> None:
    """Workers saw the leader's node fail: the first node that checked in pings the leader, finds
    it silent, revokes its lease; the election and the roll call follow at once (the TTL here is
    a minute, so waiting for it would fail the test)."""
    c, boxes, plan, old = three_nodes_up(cluster_factory)
    dead = old.member.node_id
    c.crash(old)
    survivors = [n for n in plan.nodes if n != dead]
    for node in survivors:
        checkin(c, plan, node, "failure")
    new = c.wait_plan(lambda p: p.generation == 2, timeout=10)
    assert new.nodes == tuple(survivors)
    deputy_events = [e for e in c.events() if e.kind == "lost" and "revoked its lease" in e.detail]
    assert [(e.node, e.generation) for e in deputy_events] == [(dead, 1)]
    assert re.fullmatch(
        rf"leader {dead} did not answer a ping during the roll call of generation 1 "
        r"\(no sign of life in the \d+\.\ds since\); revoked its lease",
        deputy_events[0].detail,
    ), deputy_events[0].detail
    assert c.client.get_json(c.keys.node(dead))[0] is None
    leaders = [e.node for e in c.events() if e.kind == "leader"]
    assert leaders[0] == dead and len(leaders) == 2 and leaders[1] in survivors


def test_a_stalled_join_replans_only_when_a_silent_node_is_found(cluster_factory) -> None:
    """`stall` check-ins (workers waiting long for peers while joining) re-plan nothing while
    every suspect answers its ping; once a node dies (its lease still valid for a minute), the
    next round finds it silent and the leader re-plans without it."""
    c, boxes, plan, leader = three_nodes_up(cluster_factory)
    others = [b["handler"] for b in boxes if b["handler"] is not leader]
    checkin(c, plan, leader.member.node_id, "stall")
    time.sleep(1.5)  # pinged, both answered: only slow
    assert c.plan().generation == 1
    victim = others[0]
    c.crash(victim)
    new = c.wait_plan(lambda p: p.generation == 2, timeout=10)
    assert victim.member.node_id not in new.nodes and len(new.nodes) == 2
    lost = [e for e in c.events() if e.kind == "lost"]
    assert [e.node for e in lost] == [victim.member.node_id]
    assert "did not answer a ping" in lost[0].detail


def test_a_dead_agent_is_replanned_at_once_by_its_liveness_socket(cluster_factory) -> None:
    """An agent dies (its liveness socket closes, as its kernel does at a SIGKILL) while its lease
    has a minute to run and no worker has checked in: the leader finds the socket refusing
    connections and re-plans without the node at once."""
    c, boxes, _, leader = three_nodes_up(cluster_factory)
    victim = next(b["handler"] for b in boxes if b["handler"] is not leader)
    gone = victim.member.node_id
    assert c.client.get_json(c.keys.node(gone))[0]["liveness"] == victim.liveness.address
    eventually(lambda: gone in leader.leader.liveness.monitor.answered())
    c.crash(victim)
    victim.liveness.close(goodbye=False)  # killed: its kernel closes the sockets
    new = c.wait_plan(lambda p: p.generation == 2, timeout=10)
    assert gone not in new.nodes and len(new.nodes) == 2
    lost = [e for e in c.events() if e.kind == "lost"]
    assert [(e.node, e.generation) for e in lost] == [(gone, 2)]
    assert re.fullmatch(SOCKET_LOST, lost[0].detail), lost[0].detail
    assert c.client.get_json(c.keys.fence(gone))[0] is not None


def test_an_agent_that_shuts_down_is_a_leave_even_where_its_bye_is_missed(cluster_factory) -> None:
    """A clean shutdown whose `BYE` the leader's monitor misses (as a connection reset in a slow
    accepting thread's backlog: here no `BYE` at all, only refused connections) is no death: its
    goodbye is on record before the socket closes. The node leaves the next plan as a `leave`,
    unfenced, and no `lost` event is written."""
    c, _, _, leader = three_nodes_up(cluster_factory)
    victim = next(h for h in c.handlers if h is not leader)
    gone = victim.member.node_id
    eventually(lambda: gone in leader.leader.liveness.monitor.answered())
    server = victim.liveness
    victim.liveness.close = lambda goodbye=True: type(server).close(server, goodbye=False)  # type: ignore[method-assign]
    assert victim.shutdown() is True
    new = c.wait_plan(lambda p: p.generation == 2, timeout=10)
    assert gone not in new.nodes and len(new.nodes) == 2
    events = c.events()
    assert [(e.kind, e.detail) for e in events if e.node == gone and e.generation == 2] == [
        ("leave", "said goodbye (agent shut down)")
    ], [e.line() for e in events]
    assert not [e for e in events if e.kind == "lost"] and c.client.get_json(c.keys.fence(gone))[0] is None


def test_a_dead_leader_is_replaced_at_once_by_its_liveness_socket(cluster_factory) -> None:
    """The leader's agent dies (lease valid for a minute, no worker checked in): the roster's
    first other node finds its liveness socket refusing connections, revokes its lease, and a
    new leader re-plans without it."""
    c, boxes, plan, old = three_nodes_up(cluster_factory)
    dead = old.member.node_id
    deputy = next(
        b["handler"] for b in boxes if b["handler"].member.node_id == next(n for n in plan.nodes if n != dead)
    )
    eventually(
        lambda: deputy.leader.leader_watch.monitor is not None and dead in deputy.leader.leader_watch.monitor.answered()
    )
    c.crash(old)
    old.liveness.close(goodbye=False)
    new = c.wait_plan(lambda p: p.generation == 2, timeout=10)
    assert dead not in new.nodes and len(new.nodes) == 2
    lost = [e for e in c.events() if e.kind == "lost" and e.node == dead]
    assert lost and re.fullmatch(rf"leader {dead}: {SOCKET_LOST}; revoked its lease", lost[0].detail), [
        e.line() for e in lost
    ]
    leaders = [e.node for e in c.events() if e.kind == "leader"]
    assert leaders[0] == dead and len(leaders) == 2


def test_a_leader_dead_with_another_node_is_replaced_and_both_are_left_out_at_once(cluster_factory) -> None:
    """The leader's agent and another one die together (leases valid for a minute, no worker
    checked in): the deputy watched both, so the leader it becomes knows the other refused
    address for a death too, and the first re-plan leaves both out (not one now and the other
    when its lease expires)."""
    c = cluster_factory(min_nodes=2, max_nodes=4, lease_ttl="60")
    boxes = c.start(4)
    join_all(boxes)
    plan, old = c.plan(), leading(boxes)
    handlers = {b["handler"].member.node_id: b["handler"] for b in boxes}
    roster = Roster.parse(c.client.get_json(c.keys.roster)[0])
    deputy_id = next(n for n in roster.nodes if n != old.member.node_id)
    layers = {s.node: tuple(s.layers()) for p in plan.pipelines for s in p.stages}
    # dies with the leader and leaves a copy of every layer: a holder of the other layers
    other = handlers[
        next(
            n
            for n in plan.nodes
            if n not in (old.member.node_id, deputy_id) and layers[n] != layers[old.member.node_id]
        )
    ]
    deputy = handlers[deputy_id]
    gone = {old.member.node_id, other.member.node_id}
    eventually(
        lambda: deputy.leader.leader_watch.monitor is not None and gone <= deputy.leader.leader_watch.monitor.answered()
    )
    # killed at the same moment: both stop acting, then their kernels close the sockets (closing
    # them first would let a victim still running act on the other's death: campaign, depose)
    for victim in (old, other):
        c.crash(victim)
    for victim in (old, other):
        victim.liveness.close(goodbye=False)
    new = c.wait_plan(lambda p: p.generation == 2, timeout=10)
    assert set(new.nodes) == set(plan.nodes) - gone, "\n".join(e.line() for e in c.events())
    lost: dict[str, str] = {}
    for e in c.events():
        if e.kind == "lost":
            lost.setdefault(e.node, e.detail)  # the first (the new leader's re-plan repeats them)
    assert set(lost) == {old.member.node_id, other.member.node_id}, lost
    assert re.fullmatch(rf"leader {old.member.node_id}: {SOCKET_LOST}; revoked its lease", lost[old.member.node_id])
    assert re.fullmatch(
        rf"{SOCKET_LOST} \(with leader {old.member.node_id}\); the deputy revoked its lease", lost[other.member.node_id]
    ), lost
    leaders = [e.node for e in c.events() if e.kind == "leader"]
    assert leaders[0] == old.member.node_id and len(leaders) == 2 and leaders[1] in new.nodes


def test_a_new_leader_takes_the_addresses_its_predecessor_reached_as_proof(cluster_factory, monkeypatch) -> None:
    """No agent watches the leader's socket here (its death is found by the deputy's ping), so
    only the old leader's `liveness_answered` tells the new one that the refused address of a
    node that died with it is a dead agent, not a wrong --local-addr: the node is left out as
    found dead by its socket, in the same re-plan as the leader."""
    monkeypatch.setattr(detect, "LEADER_WATCHERS", 0)
    c = cluster_factory(min_nodes=2, max_nodes=4, lease_ttl="60")
    boxes = c.start(4)
    join_all(boxes)
    plan, old = c.plan(), leading(boxes)
    handlers = {b["handler"].member.node_id: b["handler"] for b in boxes}
    layers = {s.node: tuple(s.layers()) for p in plan.pipelines for s in p.stages}
    me = old.member.node_id
    other = handlers[next(n for n in plan.nodes if n != me and layers[n] != layers[me])]
    others = set(plan.nodes) - {me}
    eventually(lambda: set((read_answered(c.client, c.keys) or AnsweredRecord(0, {})).addresses) == others)
    assert read_answered(c.client, c.keys).addresses[other.member.node_id] == other.liveness.address
    for victim in (old, other):  # killed together: both stop acting, then their sockets close
        c.crash(victim)
    for victim in (old, other):
        victim.liveness.close(goodbye=False)
    for node in others - {other.member.node_id}:
        checkin(c, plan, node, "failure")
    new = c.wait_plan(lambda p: p.generation == 2, timeout=10)
    assert set(new.nodes) == others - {other.member.node_id}, "\n".join(e.line() for e in c.events())
    lost = [e for e in c.events() if e.kind == "lost" and e.node == other.member.node_id]
    assert lost[0].detail == f"{LIVENESS_LOST}; last sign of life not known here (it answered the last leader)"


def test_a_roll_call_right_after_an_etcd_outage_holds_its_verdict(cluster_factory) -> None:
    """Silence right after an etcd outage proves nothing (records expired, agents' watches were
    down): a roll call then waits until the outage is a lease TTL + settle past before it drops a
    silent node; a node that is really dead is dropped after that."""
    c, boxes, plan, leader = three_nodes_up(cluster_factory)
    victim = next(b["handler"] for b in boxes if b["handler"] is not leader)
    c.crash(victim)
    grace = 60 + 0.1  # lease TTL + settle of this cluster
    now = time.monotonic()
    leader.client.last_outage = (now - grace + 1.5, now - grace + 1.5)  # etcd came back "just now"
    for node in plan.nodes:
        if node != victim.member.node_id:
            checkin(c, plan, node, "failure")
    time.sleep(1.0)  # without the hold: pinged, silent for 0.3 s, re-planned
    assert c.plan().generation == 1
    new = c.wait_plan(lambda p: p.generation == 2, timeout=5)
    assert time.monotonic() - now >= 1.4
    assert victim.member.node_id not in new.nodes
    lost = [e for e in c.events() if e.kind == "lost"]
    assert [e.node for e in lost] == [victim.member.node_id] and "did not answer a ping" in lost[0].detail


def test_a_worker_withdraws_its_stall_checkin_once_it_entered(etcd_server, run_id) -> None:
    from oobleck_elastic.rendezvous.worker import WorkerContext

    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    keys = Keys("/oobleck", run_id)
    ctx = WorkerContext(client=client, keys=keys, node_id="node3", local_rank=1)
    try:
        ctx.report_failure(4, kind="stall")
        ctx.report_failure(5)
        assert client.count(keys.rollcall(4)) == 1
        ctx.entered(4)
        ctx.entered(5)  # a failure check-in stays: the leader's roll call needs it
        assert client.count(keys.rollcall(4)) == 0 and client.count(keys.rollcall(5)) == 1
    finally:
        client.delete_prefix(keys.rollcall(4))
        client.delete_prefix(keys.rollcall(5))
        client.close()


def test_kill_agent_drains_a_node(cluster_factory) -> None:
    c = cluster_factory(min_nodes=3, max_nodes=3)
    join_all(c.start(3))
    message = cluster_ops.kill_agent(c.client, c.keys, 2)
    assert message.startswith("node node2 (index 2, host ") and "is draining" in message
    assert any("draining" in line and "node2" in line for line in cluster_ops.agents(c.client, c.keys))
    plan = c.wait_plan(lambda p: "node2" not in p.nodes)
    assert plan.nodes == ("node0", "node1")
    # the roster agents read is written with the plan, in the same transaction
    from oobleck_elastic.records.control import Roster
    from oobleck_elastic.records.read import read_roster

    assert read_roster(c.client, c.keys) == Roster(plan.generation, plan.nodes)
    drain = [e for e in c.events() if e.kind == "drain" and e.generation == plan.generation]
    assert [e.node for e in drain] == ["node2"]
    with pytest.raises(cluster_ops.OpsError, match=r"no live node with index 7 in run '.*' \(live: 0, 1, 2\)"):
        cluster_ops.kill_agent(c.client, c.keys, 7)


def test_nodes_beyond_max_wait_as_spares(cluster_factory) -> None:
    c = cluster_factory(min_nodes=2, max_nodes=2)
    boxes = c.start(2)
    join_all(boxes)
    spare = c.start(1)[0]
    time.sleep(1.0)
    assert "info" not in spare and c.plan().nodes == ("node0", "node1")
    c.crash(boxes[0]["handler"] if not boxes[0]["handler"].leader.is_leader.is_set() else boxes[1]["handler"])
    spare["thread"].join(TTL + 5)
    assert "info" in spare
    c.wait_plan(lambda p: "node2" in p.nodes)


def test_below_n0_waits_with_one_log_line(cluster_factory, caplog) -> None:
    c = cluster_factory(min_nodes=1, max_nodes=4)
    caplog.set_level(logging.WARNING, logger="oobleck_elastic.rendezvous.leader")
    first = c.start(1)
    time.sleep(1.0)
    assert "info" not in first[0] and c.plan() is None
    waiting = [r for r in caplog.records if "cannot plan generation 1 with 1 node(s)" in r.getMessage()]
    assert len(waiting) == 1
    assert "at least n0=2" in waiting[0].getMessage()
    assert [e.kind for e in c.events()].count("waiting") == 1
    second = c.start(1)
    join_all(first + second)
    assert c.plan().nodes == ("node0", "node1")


def test_malformed_values_are_ignored_with_a_warning(cluster_factory, caplog) -> None:
    c = cluster_factory(min_nodes=2, max_nodes=4)
    caplog.set_level(logging.WARNING)
    c.client.put(c.keys.node("node99"), b"{not json")
    c.client.put(c.keys.node("node98"), json.dumps({"schema_version": 1, "node_id": "node98"}))
    join_all(c.start(2))
    assert c.plan().nodes == ("node0", "node1")
    text = caplog.text
    assert "ignoring malformed JSON in etcd key /oobleck/" in text and "node99" in text
    assert "ignoring malformed node record /oobleck/" in text and "node98" in text
    agents = cluster_ops.agents(c.client, c.keys)
    assert all("node99" not in line and "node98" not in line for line in agents), agents
    assert sum("node0" in line or "node1" in line for line in agents) == 2, agents


def test_status_and_events_commands(cluster_factory) -> None:
    c = cluster_factory(min_nodes=2, max_nodes=2)
    join_all(c.start(2))
    c.client.put_json(c.keys.progress, {"generation": 1, "step": 7, "time": time.time()})
    lines = cluster_ops.status(c.client, c.keys)
    assert lines[0].startswith(f"run {c.run_id}: 2 live node(s), leader node")
    assert lines[1].startswith("generation 1: 2 node(s), ")
    assert lines[-1].startswith("step 7 (generation 1, ")
    out: list[str] = []
    cluster_ops.events(c.client, c.keys, out=out.append)
    kinds = [line.split()[1] for line in out]
    assert sorted(kinds[:3]) == ["join", "join", "leader"] and kinds[3:] == ["plan"]
    assert "generation 1: 2 node(s), 1 pipeline(s)" in out[-1] or "generation 1: 2 node(s), 2 pipeline(s)" in out[-1]


def test_connection_errors_are_clear(etcd_server, run_id, tmp_path) -> None:
    with pytest.raises(EtcdError, match="^etcd TLS setting cacert=/nope.pem: file does not exist$"):
        connect(EtcdSettings(endpoint=etcd_server.endpoint, cacert="/nope.pem"))
    with pytest.raises(EtcdError, match="^etcd TLS settings cert and key must be given together"):
        connect(EtcdSettings(endpoint=etcd_server.endpoint, cacert=__file__, cert=__file__))
    import argparse

    args = argparse.Namespace(
        endpoint=etcd_server.endpoint,
        run_id="no-such-run",
        key_prefix="/oobleck",
        cacert=None,
        cert=None,
        key=None,
        user=None,
        password=None,
    )
    with pytest.raises(cluster_ops.OpsError, match="^run 'no-such-run' not found at 127.0.0.1:"):
        cluster_ops.open_run(args)


def test_unknown_rdzv_conf_option_is_refused(etcd_server, run_id, profile_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_ELASTIC_WORKER_IDENTICAL", "0")
    params = RendezvousParameters(
        backend="oobleck", endpoint=etcd_server.endpoint, run_id=run_id, min_nodes=1, max_nodes=1, lease_tll="3"
    )
    with pytest.raises(ValueError, match=r"unknown --rdzv-conf option\(s\) \['lease_tll'\]"):
        OobleckRendezvousHandler(
            params, argv=["torchrun", "train.py", "--config", str(ROOT / "configs/gpt2-tiny.yaml")]
        )


def test_a_malformed_plan_value_never_sends_generations_back(cluster_factory, caplog) -> None:
    """Garbage in the `plan` key: the leader goes on from the newest plan of the history, so the
    next plan is generation 2 (not 1) and the history is not overwritten; the bad value is
    logged once, not on every poll."""
    c = cluster_factory(min_nodes=2, max_nodes=4)
    join_all(c.start(2))
    c.wait_plan(lambda p: p.generation == 1)
    first = c.client.get_json(c.keys.plan_at(1))[0]
    with caplog.at_level(logging.WARNING):
        c.client.put(c.keys.plan, "not a plan {")
        time.sleep(1.0)  # the leader polls many times meanwhile
        join_all(c.start(1))  # a membership change: the leader re-plans
        plan = c.wait_plan(lambda p: p.generation >= 2)
    assert plan.generation == 2 and len(plan.nodes) == 3
    assert c.client.get_json(c.keys.plan_at(1))[0] == first
    bad = [r for r in caplog.records if "not a plan {" in r.getMessage()]
    assert len(bad) == 1, [r.getMessage() for r in bad]


def test_garbage_in_the_leader_key_does_not_block_the_election(cluster_factory, caplog) -> None:
    """A `leader` value no agent wrote (not a leader record, no lease: it would never expire) is
    removed by the campaigning agents, so one of them is elected and plans."""
    c = cluster_factory(min_nodes=2, max_nodes=2)
    c.client.put(c.keys.leader, "garbage")
    with caplog.at_level(logging.WARNING):
        join_all(c.start(2))
        plan = c.wait_plan(lambda p: p.generation == 1)
    assert len(plan.nodes) == 2
    leader = c.client.get_json(c.keys.leader)[0]
    assert isinstance(leader, dict) and leader["node_id"] in plan.nodes
    assert len([r for r in caplog.records if "removing a bogus value" in r.getMessage()]) == 1


@pytest.mark.parametrize(
    "option, value, bound", [("lease_ttl", "abc", ">"), ("settle", "-1", ">="), ("etcd_outage", "0", ">")]
)
def test_a_bad_rdzv_conf_value_names_the_option(etcd_server, run_id, monkeypatch, option, value, bound) -> None:
    monkeypatch.setenv("TORCH_ELASTIC_WORKER_IDENTICAL", "0")
    params = RendezvousParameters(
        backend="oobleck", endpoint=etcd_server.endpoint, run_id=run_id, min_nodes=1, max_nodes=1, **{option: value}
    )
    with pytest.raises(ValueError, match=rf"--rdzv-conf {option}={value}: give a number of seconds {bound} 0"):
        OobleckRendezvousHandler(
            params, argv=["torchrun", "train.py", "--config", str(ROOT / "configs/gpt2-tiny.yaml")]
        )
