"""A leader whose agent stalled for a lease TTL stops acting (rendezvous/leader.py): after the
stall its lease may be gone and what it saw before is stale, so it acts on nothing (no admission,
no fence, no plan) until its keep-alive finds the lease alive; then, the `leader` key still its
own, it leads on without a new election."""

from __future__ import annotations

import time

from oobleck_elastic.etcd import connect
from oobleck_elastic.etcd.mirror import Mirror
from oobleck_elastic.planning import PlanningError
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.records.read import read_leader
from oobleck_elastic.rendezvous.leader import Leader
from oobleck_elastic.rendezvous.membership import Member, read_events

from helpers import eventually


def _refuse(nodes: list[str], generation: int, previous: object) -> object:
    raise PlanningError("this test publishes no plan")


def test_a_stalled_leader_acts_on_nothing_until_its_lease_is_known_alive(etcd_settings, run_id) -> None:
    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    member = Member(client, keys, devices=1, lease_ttl_s=2, host="test")
    member.register()
    view = Mirror(client, keys.agent_watched(member.node_id), name=member.node_id).start()
    leader = Leader(
        client, keys, member, planner=_refuse, min_nodes=1, max_nodes=1, last_call_s=0.1, settle_s=0.1, view=view
    )
    acted: list[float] = []
    act = leader._act
    leader._act = lambda *args: (acted.append(time.monotonic()), act(*args))[1]
    try:
        assert member.lease_fresh()
        leader.start()
        eventually(lambda: leader.is_leader.is_set() and acted)
        fresh = member.lease_fresh
        member.lease_fresh = lambda: False  # as after a stall longer than the TTL
        eventually(lambda: not leader.is_leader.is_set())
        stepped_down = time.monotonic()
        time.sleep(0.5)
        assert not [t for t in acted if t > stepped_down]  # nothing done on a stale view
        member.lease_fresh = fresh  # the keep-alive found the lease alive: it leads again
        eventually(lambda: leader.is_leader.is_set() and acted[-1] > stepped_down)
        assert read_leader(client, keys).node_id == member.node_id
        elected = [ev for _, ev in read_events(client, keys) if ev.kind == "leader"]
        assert len(elected) == 1  # no second election
    finally:
        leader.stop()
        view.close()
        member.close()
        client.close()
