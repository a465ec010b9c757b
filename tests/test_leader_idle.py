"""A non-leader agent costs nothing between changes (rendezvous/leader.py): its loop sleeps on
its mirror until something it reads changes, instead of waking 5 times a second (1,000 agents
woke 5,000 times a second and starved a 2-core machine), and it reads the roster's 1,000 names
once per revision, not once per tick."""

from __future__ import annotations

import time

from oobleck_elastic.etcd import connect
from oobleck_elastic.etcd.memory import MemoryKV
from oobleck_elastic.etcd.mirror import Mirror
from oobleck_elastic.planning import PlanningError
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.rendezvous.leader import Leader
from oobleck_elastic.records.plans import RosterReader
from oobleck_elastic.rendezvous.membership import Member
from oobleck_elastic.records.control import Roster

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
