"""Who is to blame when a lease is found gone (rendezvous/membership.py), against a real etcd:
etcd let it expire although it was refreshed on time -> the node renews its membership (new
lease, same node id and record); the leader declared the node lost meanwhile, or the node itself
did not refresh for longer than the TTL -> it is fenced, and comes back `returned` (same node id,
a new lease, fenced for good) so that its layers can still be handed over (docs/recovery.md)."""

from __future__ import annotations

import threading
import time

from oobleck_elastic.etcd import connect
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.records.control import FenceRecord, NodeRecord, NodeState
from oobleck_elastic.rendezvous.membership import Member, live_nodes, read_events

from helpers import eventually


def test_a_lease_etcd_dropped_is_renewed_under_the_same_node_id(etcd_settings, run_id) -> None:
    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    renewed = []
    member = Member(client, keys, devices=1, lease_ttl_s=3, on_renewed=lambda: renewed.append(1))
    try:
        rec = member.register()
        old = member.lease
        client.revoke_lease(old)  # what a stalled etcd does to a lease refreshed on time
        eventually(lambda: renewed)
        assert not member.fenced.is_set() and member.lease != old and member.renewals == 1
        now = live_nodes(client, keys)
        assert [(r.node_id, r.index, r.state, r.lease_id) for r in now] == [
            (rec.node_id, rec.index, NodeState.UP, member.lease)
        ]
        assert client.get(keys.node(rec.node_id)).lease == member.lease
        assert any(ev.kind == "renew" and ev.node == rec.node_id for _, ev in read_events(client, keys))
    finally:
        member.close()
        client.close()


def test_a_node_the_leader_declared_lost_comes_back_returned(etcd_settings, run_id) -> None:
    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    member = Member(client, keys, devices=1, lease_ttl_s=3)
    try:
        rec = member.register()
        old = member.lease
        client.put_json(keys.fence(rec.node_id), FenceRecord(time=time.time(), generation=2).to_json())
        client.revoke_lease(old)
        eventually(lambda: member.returned)
        assert member.fenced.is_set() and "the leader declared this node lost" in member.fence_reason
        assert [(r.node_id, r.state, r.lease_id) for r in live_nodes(client, keys)] == [
            (rec.node_id, NodeState.RETURNED, member.lease)
        ]
        assert member.lease != old and member.renewals == 0
        assert client.get_json(keys.fence(rec.node_id))[0]["generation"] == 2  # the leader's fence stays
        assert any(ev.kind == "renew" and "returned" in ev.detail for _, ev in read_events(client, keys))
        member.close()
        assert live_nodes(client, keys) == []  # closing revokes the new lease
    finally:
        member.close()
        client.close()


def test_a_refresh_etcd_answered_late_is_not_the_nodes_fault(etcd_settings, run_id) -> None:
    """A refresh that etcd answers only after more than a TTL (etcd slow on a loaded machine, its
    disk stalled) lets the lease expire while the node waited on time: the next refresh finds it
    gone, and the node renews (same node id, a `renew` event) instead of being fenced."""
    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    member = Member(client, keys, devices=1, lease_ttl_s=1)
    refresh, slowed = client.refresh_lease, threading.Event()

    def slow_answer(lease: int) -> int:
        ttl = refresh(lease)
        if not slowed.is_set():  # etcd refreshed it at once but its answer takes 2.5 TTLs
            slowed.set()
            time.sleep(2.5)
        return ttl

    try:
        member.register()
        client.refresh_lease = slow_answer  # type: ignore[method-assign]
        eventually(lambda: member.renewals == 1)
        assert not member.fenced.is_set(), member.fence_reason
        record = member.current_record()
        assert record is not None and record.node_id == member.node_id and record.lease_id == member.lease
    finally:
        member.close()
        client.close()


def test_a_node_that_did_not_refresh_for_a_ttl_is_fenced_and_comes_back_returned(etcd_settings, run_id) -> None:
    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    member = Member(client, keys, devices=1, lease_ttl_s=1)

    class Frozen(threading.Event):
        """The keep-alive thread's sleep, as if the process had been stopped for 2.5 TTLs once."""

        frozen = False

        def wait(self, timeout=None) -> bool:
            if not self.frozen:
                self.frozen = True
                time.sleep(2.5)
            return super().wait(timeout)

    try:
        rec = member.register()
        member._stop = Frozen()  # read by the keep-alive loop at every turn
        assert member.lease_fresh()
        eventually(lambda: member.returned)
        assert "sent no refresh for" in member.fence_reason and member.renewals == 0
        assert not member.lease_fresh()  # its leader loop, if it leads, steps down
        # fenced in every reader's eyes (no leader had fenced it yet), its record live again
        assert client.get_json(keys.fence(rec.node_id))[0] is not None
        assert [r.state for r in live_nodes(client, keys)] == [NodeState.RETURNED]
        time.sleep(2.0)  # the keep-alive goes on refreshing the new lease
        assert [r.state for r in live_nodes(client, keys)] == [NodeState.RETURNED]
    finally:
        member.close()
        client.close()


def test_a_returned_nodes_workers_wait_take_no_stage_and_donate_or_leave(etcd_settings, run_id) -> None:
    """The workers of a fenced node whose agent came back `returned` keep their layers while the
    newest plan still has the node (the re-plan without it is coming) or names it a donor, never
    take a stage, and leave once a plan moved on without it; with no record they leave at once."""
    from dataclasses import replace

    from oobleck_elastic.rendezvous.worker import WorkerContext
    from oobleck_elastic.testing import layout_plan

    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    ctx = WorkerContext(client=client, keys=keys, node_id="n1", local_rank=0)
    old = layout_plan([[(0, 3), (3, 6)]], [4], generation=1)  # n0, n1
    without = layout_plan([[(0, 6)]], [4], generation=2)  # n0 alone
    donor = replace(without, donors=("n1",), returned=("n1",))
    rec = NodeRecord(
        node_id="n1", index=1, host="h", devices=1, agent_pid=1, state=NodeState.RETURNED, since=0.0, lease_id=0
    )
    try:
        client.put_json(keys.fence("n1"), FenceRecord(time=time.time(), generation=1).to_json())
        assert ctx.should_leave(old) is not None  # fenced, no record: its agent is gone
        lease = client.grant_lease(30)
        client.put_json(keys.node("n1"), replace(rec, lease_id=lease).to_json(), lease=lease)
        assert ctx.should_leave(old) is None and ctx.should_leave(None) is None
        assert ctx.my_stage(old) is None  # a fenced node never trains again
        assert ctx.should_leave(donor) is None
        assert "fenced" in (ctx.should_leave(without) or "")
        client.revoke_lease(lease)
    finally:
        client.close()


def test_a_node_fenced_while_its_lease_lives_comes_back_at_its_ping_answer(etcd_settings, run_id) -> None:
    """A roll call declared the node lost (it answered a ping too late) while its lease lives: the
    keep-alive never finds the lease gone, so the agent checks its fence when it answers the ping."""
    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    member = Member(client, keys, devices=1, lease_ttl_s=3)
    try:
        rec = member.register()
        member.check_declared_lost()
        assert not member.fenced.is_set()  # not fenced: nothing happens
        client.put_json(keys.fence(rec.node_id), FenceRecord(time=time.time(), generation=2).to_json())
        member.check_declared_lost()
        assert member.fenced.is_set() and member.returned and "ping too late" in member.fence_reason
        assert [(r.node_id, r.state, r.lease_id) for r in live_nodes(client, keys)] == [
            (rec.node_id, NodeState.RETURNED, member.lease)
        ]
    finally:
        member.close()
        client.close()
