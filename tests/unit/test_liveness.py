"""Liveness sockets (rendezvous/liveness.py): a dead agent is found the moment its socket closes
and refuses a new connection; a live one, a reset connection or a wrong address is no death."""

from __future__ import annotations

import socket
import threading
import time

from oobleck_elastic.etcd.memory import MemoryKV
from oobleck_elastic.records.control import NodeRecord, NodeState
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.rendezvous import liveness
from oobleck_elastic.rendezvous.detect import LeaderLiveness, LeaderWatch
from oobleck_elastic.rendezvous.liveness import LivenessMonitor, LivenessServer, parse_address
from oobleck_elastic.rendezvous.membership import live_nodes, say_goodbye

from helpers import eventually, layout_plan


def test_addresses_are_parsed_or_refused() -> None:
    assert parse_address("127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_address("[::1]:9") == ("::1", 9)
    assert [parse_address(a) for a in ("", "host", "host:", ":80", "h:0", "h:70000", "h:x")] == [None] * 7


def test_a_closed_agent_is_found_dead_at_once_and_a_live_one_is_not() -> None:
    live, doomed = LivenessServer("127.0.0.1"), LivenessServer("127.0.0.1")
    woke: list[str] = []
    monitor = LivenessMonitor(on_dead=woke.append)
    try:
        monitor.watch({"a": live.address, "b": doomed.address})
        eventually(lambda: len(monitor.answered()) == 2)
        doomed.close(goodbye=False)  # what the kernel does to a SIGKILLed agent's sockets
        eventually(lambda: woke == ["b"], timeout=5)
        assert monitor.take_dead() == {"b"} and monitor.take_dead() == set()  # reported once
        time.sleep(0.3)
        assert woke == ["b"]
    finally:
        monitor.close()
        live.close()


def test_a_reset_connection_to_a_live_agent_is_no_death() -> None:
    server = LivenessServer("127.0.0.1")
    monitor = LivenessMonitor()
    try:
        monitor.watch({"a": server.address})
        eventually(lambda: "a" in monitor._socks)
        old = list(server._peers)
        for peer in old:  # the connection drops, the agent listens on
            peer.close()
        eventually(lambda: any(p not in old for p in server._peers))  # the monitor connected again
        assert monitor.take_dead() == set()
    finally:
        monitor.close()
        server.close()


def test_an_address_that_never_answered_proves_nothing() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monitor = LivenessMonitor(retry_s=0.1)
    try:
        monitor.watch({"a": f"127.0.0.1:{port}"})
        time.sleep(0.5)
        assert monitor.take_dead() == set()
    finally:
        monitor.close()


def test_an_agent_that_leaves_cleanly_is_no_death() -> None:
    server = LivenessServer("127.0.0.1")
    monitor = LivenessMonitor(retry_s=0.1)
    try:
        monitor.watch({"a": server.address})
        eventually(lambda: "a" in monitor._socks)
        server.close()  # a shutdown or a drain: it says goodbye first
        eventually(lambda: "a" in monitor._left)
        time.sleep(0.3)
        assert monitor.take_dead() == set() and "a" not in monitor._socks
    finally:
        monitor.close()


def test_a_goodbye_reaches_a_connection_the_slow_accepting_thread_never_took(monkeypatch) -> None:
    """On a loaded machine the accepting thread may not have taken the monitor's connection when
    the agent leaves: it waits in the kernel's backlog, and closing the listening socket would
    reset it unwarned (the monitor would reconnect, be refused and call it a death). Made
    deterministic here: the accepting thread does not run until the server is closed."""
    held = threading.Event()
    accept = LivenessServer._accept
    monkeypatch.setattr(LivenessServer, "_accept", lambda self: (held.wait(10), accept(self)))
    server = LivenessServer("127.0.0.1")
    woke: list[str] = []
    monitor = LivenessMonitor(on_dead=woke.append, retry_s=0.1)
    try:
        monitor.watch({"a": server.address})
        eventually(lambda: "a" in monitor._socks)  # connected: the kernel completed it, nobody accepted it
        assert server._peers == []
        server.close()
        eventually(lambda: "a" in monitor._left)
        time.sleep(0.3)
        assert monitor.take_dead() == set() and woke == []
    finally:
        held.set()
        monitor.close()


KEYS = Keys("/oobleck", "r")


def test_a_refused_agent_with_a_goodbye_on_record_is_no_death_to_the_leader() -> None:
    """Whatever the socket showed (here no goodbye at all: only refused), the leader reads etcd
    before it takes a refused connection for a death: a node that said goodbye left."""
    servers = {n: LivenessServer("127.0.0.1") for n in ("n1", "n2")}
    kv = MemoryKV()
    for i, node in enumerate(("n0", "n1", "n2")):
        address = servers[node].address if node in servers else ""
        record = NodeRecord(node, i, "h", 1, 1, NodeState.UP, 0.0, kv.grant_lease(9.0), liveness=address)
        kv.put_json(KEYS.node(node), record.to_json(), lease=record.lease_id)
    plan = layout_plan([[(0, 6)]] * 3, [2] * 3, generation=1)
    watch = LeaderWatch(kv, KEYS, node_id="n0", reader=kv)
    leader = LeaderLiveness(kv, KEYS, node_id="n0", watch=watch, on_dead=lambda _: None)
    try:
        eventually(lambda: leader.found_dead(plan, live_nodes(kv, KEYS)) == {} and len(leader.monitor.answered()) == 2)
        say_goodbye(kv, KEYS, "n1", "agent shut down")
        for server in servers.values():
            server.close(goodbye=False)  # what a connection reset in the backlog looks like
        eventually(lambda: leader.monitor._dead == {"n1", "n2"}, timeout=5)
        assert set(leader.found_dead(plan, live_nodes(kv, KEYS))) == {"n2"}
        assert "last sign of life" in leader.why("n2") and "s earlier (its connection closed then)" in leader.why("n2")
    finally:
        leader.close()


def test_a_refused_address_is_a_death_only_where_it_answered_or_was_vouched_for() -> None:
    """A new leader's monitor has reached nobody: the old leader's `liveness_answered` vouches for
    the addresses it reached, and only those then prove a death when they refuse."""
    vouched, unknown = LivenessServer("127.0.0.1"), LivenessServer("127.0.0.1")
    addresses = {"v": vouched.address, "u": unknown.address}
    vouched.close(goodbye=False)
    unknown.close(goodbye=False)  # both refuse from now on
    woke: list[str] = []
    monitor = LivenessMonitor(on_dead=woke.append, retry_s=0.05)
    try:
        monitor.vouch({"v": addresses["v"], "x": "not an address"})
        monitor.watch(addresses)
        monitor.sync()
        eventually(lambda: woke == ["v"], timeout=5)
        time.sleep(0.3)  # "u" was tried again several times meanwhile
        assert woke == ["v"] and monitor.take_dead() == {"v"} and monitor.answered() == {"v"}
    finally:
        monitor.close()


def test_sync_returns_once_the_closed_connections_have_their_verdicts(monkeypatch) -> None:
    """An idle monitor sleeps up to IDLE_S between polls (here a minute): `sync` must not wait for
    it, whether its thread was polling or busy when called, and the verdicts are in when it returns."""
    monkeypatch.setattr(liveness, "IDLE_S", 60.0)
    servers = {name: LivenessServer("127.0.0.1") for name in "abc"}
    monitor = LivenessMonitor()
    try:
        monitor.watch({name: server.address for name, server in servers.items()})
        eventually(lambda: len(monitor.answered()) == 3)
        assert monitor.sync(timeout_s=20)  # idle: its poll began before the call
        servers["b"].close(goodbye=False)
        servers["c"].close(goodbye=False)
        assert monitor.sync(timeout_s=20) and monitor.take_dead() == {"b", "c"}
        assert monitor.sync(timeout_s=20) and monitor.sync(timeout_s=20)  # again and again, nothing new
    finally:
        monitor.close()
        servers["a"].close()
    assert not monitor.sync(timeout_s=20)  # closed: nothing to wait for
