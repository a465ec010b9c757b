"""Who is to blame when a lease is found gone (rendezvous/membership.py), against a real etcd:
etcd let it expire although it was refreshed on time -> the node renews its membership (new
lease, same node id and record); the leader declared the node lost meanwhile -> it is fenced; the
node itself did not refresh for longer than the TTL -> it is fenced."""

from __future__ import annotations

import threading
import time

from oobleck_elastic.etcd import connect
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.records.control import FenceRecord, NodeState
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


def test_a_node_the_leader_declared_lost_does_not_come_back(etcd_settings, run_id) -> None:
    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    member = Member(client, keys, devices=1, lease_ttl_s=3)
    try:
        rec = member.register()
        client.put_json(keys.fence(rec.node_id), FenceRecord(time=time.time(), generation=2).to_json())
        client.revoke_lease(member.lease)
        eventually(member.fenced.is_set)
        assert "the leader declared this node lost" in member.fence_reason
        assert live_nodes(client, keys) == []
    finally:
        member.close()
        client.close()


def test_a_node_that_did_not_refresh_for_a_ttl_is_fenced(etcd_settings, run_id) -> None:
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
        member.register()
        member._stop = Frozen()  # read by the keep-alive loop at every turn
        assert member.lease_fresh()
        eventually(member.fenced.is_set)
        assert "did not refresh it for" in member.fence_reason and member.renewals == 0
        assert not member.lease_fresh()  # its leader loop, if it leads, steps down
    finally:
        member.close()
        client.close()
