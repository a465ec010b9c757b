"""A non-leader agent costs nothing between changes (rendezvous/leader.py): its loop sleeps on
its mirror until something it reads changes, instead of waking 5 times a second (1,000 agents
woke 5,000 times a second and starved a 2-core machine), and it reads the roster's 1,000 names
once per revision, not once per tick."""

from __future__ import annotations

import json
import time
from collections import Counter

from oobleck_elastic.etcd import connect
from oobleck_elastic.etcd.memory import MemoryKV
from oobleck_elastic.etcd.mirror import Mirror
from oobleck_elastic.planning import Plan, PlanningError
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.rendezvous.leader import Leader
from oobleck_elastic.records.plans import RosterReader
from oobleck_elastic.rendezvous.membership import Member
from oobleck_elastic.records.control import Checkin, CheckinKind, ReadyRecord, Roster
from oobleck_elastic.testing import layout_plan

from helpers import eventually


def test_the_roster_is_parsed_once_per_revision() -> None:
    keys = Keys("/oobleck", "r")
    kv = MemoryKV({keys.roster: Roster(1, ("n0", "n1")).to_json()})
    reader = RosterReader(keys)
    first = reader.read(kv)
    assert first == Roster(1, ("n0", "n1")) and reader.read(kv) is first  # the same object: not parsed again
    kv.put_json(keys.roster, Roster(2, ("n1",)).to_json())
    assert reader.read(kv) == Roster(2, ("n1",))
    kv.put(keys.roster, b"{not json")
    assert reader.read(kv) is None  # malformed: ignored (logged once)
    kv.delete(keys.roster)
    assert reader.read(kv) is None


def _count_calls(obj: object, names: tuple[str, ...]) -> Counter:
    """Count the calls of `obj`'s methods `names` from now on (they still run)."""
    calls: Counter = Counter()
    for name in names:
        real = getattr(obj, name)

        def counted(*args: object, _real=real, _name=name, **kwargs: object) -> object:
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(obj, name, counted)
    return calls


def _count_passes(leader: Leader) -> list[float]:
    """When the leader's loop read its view, from now on (one entry per pass)."""
    passes: list[float] = []
    read_view = leader._read_view

    def counted_view() -> object:
        passes.append(time.monotonic())
        return read_view()

    leader._read_view = counted_view
    return passes


def _refuse(nodes: list[str], generation: int, previous: object) -> object:
    raise PlanningError("this test publishes no plan")


def test_a_non_leader_sleeps_until_a_change(etcd_settings, run_id) -> None:
    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    client.put_json(keys.roster, Roster(1, ("node0", "node1")).to_json())
    agents = []
    try:
        for _ in range(2):
            member = Member(client, keys, devices=1, lease_ttl_s=5, host="test")
            member.register()
            view = Mirror(client, keys.agent_watched(member.node_id), name=member.node_id).start()
            leader = Leader(
                client, keys, member, planner=_refuse, min_nodes=9, max_nodes=9, last_call_s=1, settle_s=0.2, view=view
            )
            agents.append((member, view, leader))
        first, second = agents[0][2], agents[1][2]
        first.start()
        eventually(first.is_leader.is_set)
        seen: list[int] = []  # the generation of the roster at each pass of the non-leader's loop
        read = second._rosters.read

        def counted(reader: object) -> object:
            roster = read(reader)
            seen.append(roster.generation if roster is not None else 0)
            return roster

        second._rosters.read = counted
        second.start()
        eventually(lambda: seen)
        time.sleep(3.0)
        # 3 s without a change: a few passes (the 1 s idle timeout) where the 0.2 s tick made 15
        assert 1 <= len(seen) <= 5, seen
        client.put_json(keys.roster, Roster(2, ("node1",)).to_json())
        eventually(lambda: seen[-1] == 2, timeout=5.0)  # a change wakes it
        assert not second.is_leader.is_set()
    finally:
        for member, view, leader in agents:
            leader.stop()
            view.close()
            member.close()
        client.close()


def _plan_on(nodes: list[str]) -> Plan:
    """A 2-stage pipeline on `nodes` (two nodes of one device each), generation 1."""
    text = json.dumps(layout_plan([[(0, 3), (3, 6)]], [4], generation=1).to_json())
    for i, node in enumerate(nodes):
        text = text.replace(f'"n{i}"', json.dumps(node))
    return Plan.from_json(json.loads(text))


def test_a_lone_leader_below_n0_sleeps_until_a_node_arrives(etcd_settings, run_id) -> None:
    """One node of a 2-node pipeline died and its worker checked in at the roll call: the planner
    cannot plan the survivor alone. The leader declares the dead node lost and asks the planner
    once; then it sleeps (it used to ask again on every pass, writing the same fence thousands of
    times a second), and a node arriving wakes it to plan again."""
    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    members = [Member(client, keys, devices=1, lease_ttl_s=5, host="test") for _ in range(2)]
    for member in members:
        member.register()
    dead, survivor = members[0].node_id, members[1].node_id
    plan = _plan_on([dead, survivor])
    client.put_json(keys.plan, plan.to_json())
    client.put_json(keys.plan_at(1), plan.to_json())
    client.put_json(keys.roster, Roster(1, plan.nodes).to_json())
    members[0].close()
    client.put_json(keys.checkin(1, survivor, 0), Checkin(time=time.time(), kind=CheckinKind.FAILURE).to_json())
    asked: list[tuple[str, ...]] = []

    def planner(nodes: list[str], generation: int, previous: object) -> Plan:
        asked.append(tuple(nodes))
        raise PlanningError("at least n0=2 nodes are needed")

    writes = _count_calls(client, ("put", "put_json", "put_if_absent", "transact", "delete"))
    view = Mirror(client, keys.agent_watched(survivor), name=survivor).start()
    leader = Leader(
        client, keys, members[1], planner=planner, min_nodes=2, max_nodes=2, last_call_s=1, settle_s=0.2, view=view
    )
    passes = _count_passes(leader)
    newcomer = Member(client, keys, devices=1, lease_ttl_s=5, host="test")
    try:
        leader.start()
        eventually(lambda: asked == [(survivor,)])
        assert client.get(keys.fence(dead)) is not None  # declared lost with the refused attempt
        time.sleep(1.0)
        writes.clear()
        passes.clear()
        time.sleep(4.0)
        assert dict(writes) == {} and len(passes) <= 6, (dict(writes), len(passes))
        assert asked == [(survivor,)]
        newcomer.register()  # a change: the leader admits it, and plans again once it is ready
        eventually(lambda: client.get(keys.admitted(newcomer.node_id)) is not None, timeout=5.0)
        client.put_json(keys.ready_worker(newcomer.node_id, 0), ReadyRecord(time=time.time(), pid=1).to_json())
        eventually(lambda: len(asked) == 2, timeout=5.0)
        assert asked[1] == (survivor, newcomer.node_id)
    finally:
        leader.stop()
        view.close()
        for member in (*members[1:], newcomer):
            member.close()
        client.close()


def test_a_leader_waiting_for_the_profile_asks_etcd_nothing_until_one_is_published(
    etcd_settings, run_id, tmp_path
) -> None:
    """No `planning.profile_path`: the leader admits the first two nodes and waits for a worker to
    publish the profile. Meanwhile it reads nothing from etcd (its mirror holds the profile keys)
    and passes its loop about once a second (it used to read both profile keys 20 times a second);
    the profile's arrival wakes it, and generation 1 follows."""
    from oobleck_elastic.config import load_config
    from oobleck_elastic.rendezvous.planner import JobPlanner

    from helpers import ROOT, TINY_PROFILE_OVERRIDES, tiny_profile

    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", [*TINY_PROFILE_OVERRIDES, "planning.profile_path=null"])
    planner = JobPlanner(cfg, client, keys)
    members = [Member(client, keys, devices=1, lease_ttl_s=5, host="test") for _ in range(2)]
    for member in members:
        member.register()
    me = members[0].node_id
    view = Mirror(client, keys.agent_watched(me), name=me).start()
    leader = Leader(
        client,
        keys,
        members[0],
        planner=planner.plan_for,
        min_nodes=2,
        max_nodes=2,
        last_call_s=0.3,
        settle_s=0.1,
        profile_ready=planner.profile_ready,
        view=view,
    )
    passes = _count_passes(leader)
    try:
        leader.start()
        eventually(lambda: len(list(client.get_prefix_json(keys.admissions))) == 2, timeout=5.0)
        time.sleep(1.0)
        reads = _count_calls(client, ("get", "range", "get_json", "get_prefix_json", "count"))
        passes.clear()
        time.sleep(4.0)
        assert dict(reads) == {} and len(passes) <= 6, (dict(reads), len(passes))
        assert client.get(keys.plan) is None
        client.put(keys.device_profile("cpu Fake"), tiny_profile(tmp_path / "p.json").read_text())
        eventually(lambda: client.get(keys.plan) is not None, timeout=5.0)
        plan = Plan.from_json(client.get_json(keys.plan)[0])
        assert plan.generation == 1 and set(plan.nodes) == {m.node_id for m in members}
    finally:
        leader.stop()
        view.close()
        for member in members:
            member.close()
        client.close()


def test_a_lone_leader_below_n0_before_the_first_plan_sleeps_until_a_node_arrives(etcd_settings, run_id) -> None:
    """`--nnodes 1:2` and n0 = 2: the planner refuses the first plan on the one node up. The leader
    asks it once, then sleeps (it ticked 20 times a second); a second node wakes it to ask again."""
    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    member, newcomer = (Member(client, keys, devices=1, lease_ttl_s=5, host="test") for _ in range(2))
    member.register()
    asked: list[tuple[str, ...]] = []

    def planner(nodes: list[str], generation: int, previous: object) -> Plan:
        asked.append(tuple(nodes))
        raise PlanningError("at least n0=2 nodes are needed")

    view = Mirror(client, keys.agent_watched(member.node_id), name=member.node_id).start()
    leader = Leader(
        client, keys, member, planner=planner, min_nodes=1, max_nodes=2, last_call_s=0.2, settle_s=0.1, view=view
    )
    passes = _count_passes(leader)
    try:
        leader.start()
        eventually(lambda: asked == [(member.node_id,)])
        time.sleep(1.0)
        passes.clear()
        time.sleep(4.0)
        assert len(passes) <= 6 and asked == [(member.node_id,)], (len(passes), asked)
        newcomer.register()
        eventually(lambda: len(asked) == 2, timeout=5.0)
        assert asked[1] == (member.node_id, newcomer.node_id)
    finally:
        leader.stop()
        view.close()
        for m in (member, newcomer):
            m.close()
        client.close()
