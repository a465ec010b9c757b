"""Fast failure detection: the leader's roll call and the deputy that replaces a dead leader.

Invariant: nobody waits for a lease to expire when the evidence is already there, and silence
right after an etcd outage proves nothing. The story: docs/liveness.md.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Protocol

from ..logs import JobLog
from ..etcd.client import warn_once
from ..etcd.protocols import KVReader, KVStore
from ..planning import Plan
from .decide import Detector
from ..records.keys import Keys
from .liveness import LIVENESS_LOST, LivenessMonitor, evidence
from .membership import goodbye_of, live_nodes, put_event
from ..records.control import AnsweredRecord, Checkin, CheckinKind, FenceRecord, NodeRecord, Ping, Roster
from ..records.job import Event, EventKind
from ..records.read import read_answered, read_leader

log = JobLog(logging.getLogger(__name__))

STALL_RECHECK_S = 1.0  # a stall-only roll call whose suspects all answered is repeated after this
ROLL_CALL_LOST = "a peer saw its connections break and its agent did not answer a ping"
PING_FLOOR_S = 0.3
"""The shortest wait for a pong (`ping_timeout`)."""
PING_CEILING_S = 2.5
"""The longest wait for a pong (`ping_timeout`): with a long lease the deputy still deposes a dead
leader within 5 s, not the lease's TTL."""


def ping_timeout(lease_ttl_s: float) -> float:
    """How long the roll call waits for a live node's pong: half its lease TTL, between
    `PING_FLOOR_S` and `PING_CEILING_S`; the deputy waits twice this (a TTL, or 5 s) for the
    leader's. A live agent answers from a thread of its own, but on a loaded machine the answer (an
    etcd watch event, the thread's turn, a write) can take most of a second: a fixed 0.3 s (the
    deputy's 0.6 s) deposed a live leader at a job's start beside busy loops, and with f = 1 the
    next kill lost layers. The lease gives a node a TTL to prove it lives; a ping asks for no less
    than half of that. Only a node slow to answer waits longer: a dead agent's closed socket or
    vanished record is a verdict at once (docs/liveness.md)."""
    return min(PING_CEILING_S, max(PING_FLOOR_S, lease_ttl_s / 2))


LOST_BECAUSE = {Detector.LIVENESS: LIVENESS_LOST, Detector.ROLL_CALL: ROLL_CALL_LOST}
"""The `lost` event's detail for a node found dead by each detector (`why_lost` adds the time)."""

Clock = Callable[[], float]


def left_cleanly(client: KVReader, keys: Keys, nodes: Iterable[str], *, me: str) -> set[str]:
    """Those of `nodes` whose agents said goodbye (`goodbye/<node>`, read from etcd itself: a
    mirror may lag behind the socket that closed). Their refused sockets are leaves, not deaths."""
    left = {node for node in nodes if goodbye_of(client, keys, node) is not None}
    for node in sorted(left):
        log.at(node=me).info("node %s's agent said goodbye: it left, it did not die", node)
    return left


def checkins(reader: KVReader, keys: Keys, generation: int) -> dict[tuple[str, int], CheckinKind]:
    """(node, local rank) -> kind (`failure` or `stall`) of every roll-call check-in of
    `generation` (a key that is not a check-in is logged once and ignored)."""
    out = {}
    for key, value in reader.get_prefix_json(keys.rollcall(generation)):
        try:
            worker = keys.checkin_of(key)
        except ValueError as err:
            warn_once(key, None, f"ignoring roll-call key: {err}")
            continue
        out[worker] = Checkin.parse(value).kind
    return out


class _Pinger:
    """Pings nodes through etcd and collects the answers (one nonce per round)."""

    def __init__(self, client: KVStore, keys: Keys, reader: KVReader, clock: Clock) -> None:
        self.client, self.keys, self.reader, self.clock = client, keys, reader, clock
        self.ping_value = Ping.new()
        self.sent: dict[str, float] = {}
        self.alive: set[str] = set()

    def ping(self, node: str) -> None:
        if node not in self.sent:
            self.client.put(self.keys.ping(node), self.ping_value.encode())
            self.sent[node] = self.clock()

    def answered(self, node: str) -> bool:
        if node not in self.alive:
            kv = self.reader.get(self.keys.pong(node))
            if self.ping_value.answered_by(kv.value if kv is not None else None):
                self.alive.add(node)
        return node in self.alive

    def waited(self, node: str) -> float:
        return self.clock() - self.sent[node]


class RollCall:
    """The leader's side; `check()` once per leader tick."""

    def __init__(
        self,
        client: KVStore,
        keys: Keys,
        *,
        node_id: str,
        ping_timeout_s: float,
        reader: Optional[KVReader] = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.client, self.keys, self.node_id = client, keys, node_id
        self.reader: KVReader = reader if reader is not None else client
        self.ping_timeout_s = ping_timeout_s
        self.clock = clock
        self._round: Optional[tuple[int, _Pinger, float]] = None  # generation, pinger, started
        self._why: dict[str, str] = {}  # node -> the evidence of the last verdict

    def reset(self) -> None:
        self._round = None

    def why(self, node: str) -> str:
        """The evidence against `node` of the last verdict, and its silence."""
        return self._why.get(node, ROLL_CALL_LOST)

    @property
    def open(self) -> bool:
        """Whether a roll call is under way (it waits on the clock for pongs)."""
        return self._round is not None

    def check(self, plan: Plan, records: list[NodeRecord]) -> Optional[list[str]]:
        """None while no roll call is open, or it is still waiting for pongs, or everyone is
        alive and only slow; otherwise the nodes to re-plan without (possibly none)."""
        entries = checkins(self.reader, self.keys, plan.generation)
        if not entries:
            return None
        now = self.clock()
        if self._round is None or self._round[0] != plan.generation:
            self._round = (plan.generation, _Pinger(self.client, self.keys, self.reader, self.clock), now)
            kinds = sorted(set(entries.values()))
            log.at(node=self.node_id).info(
                "roll call for generation %d (%d worker(s) checked in: %s)",
                plan.generation,
                len(entries),
                "/".join(kinds),
            )
        _, pinger, started = self._round
        live = {r.node_id for r in records}
        workers = {(s.node, s.local_rank) for p in plan.pipelines for s in p.stages}
        # the leader's own node is alive (and the deputy alone pings it: one pinger per ping key)
        suspects = {node for node, lr in workers if (node, lr) not in entries} - {self.node_id}
        for node in suspects & live:
            pinger.ping(node)
        waiting = [n for n in suspects & live if not pinger.answered(n) and pinger.waited(n) < self.ping_timeout_s]
        if waiting:
            return None
        dead = sorted(n for n in suspects if n not in live or not pinger.answered(n))
        self._why = {
            n: f"{ROLL_CALL_LOST}: no sign of life in the {pinger.waited(n):.1f}s since"
            if n in live
            else "a peer saw its connections break and its record is gone (lease expired or revoked); "
            "last sign of life not known to the roll call"
            for n in dead
        }
        if not dead and all(kind == CheckinKind.STALL for kind in entries.values()):
            if now - started >= STALL_RECHECK_S:
                self._round = None  # ask again: a node may have died since it answered
            return None
        return dead


@dataclass
class _DeputyRound:
    """The deputy's ping of one leader during one generation's roll call."""

    generation: int
    leader: str
    pinger: _Pinger
    done: bool = False
    """The leader's lease was revoked (once per round)."""


class Deputy:
    """A non-leader agent's side; `check()` once per election tick."""

    def __init__(
        self,
        client: KVStore,
        keys: Keys,
        *,
        node_id: str,
        ping_timeout_s: float,
        reader: Optional[KVReader] = None,
        outage_grace_s: float = 0.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.client, self.keys, self.node_id = client, keys, node_id
        self.reader: KVReader = reader if reader is not None else client
        self.ping_timeout_s = ping_timeout_s
        self.outage_grace_s = outage_grace_s
        self.clock = clock
        self._round: Optional[_DeputyRound] = None

    @property
    def pending(self) -> bool:
        """Whether this deputy is timing a ping of the leader (its caller must look again soon)."""
        return self._round is not None and not self._round.done

    def check(self, plan: Optional[Plan | Roster]) -> bool:
        """Whether this call revoked a dead leader's lease (the caller should campaign now)."""
        if plan is None:
            return False
        entries = checkins(self.reader, self.keys, plan.generation)
        if not entries:  # no roll call (the common case: return before looking at 1,000 names)
            self._round = None
            return False
        leader = read_leader(self.reader, self.keys)
        leader_node = leader.node_id if leader is not None else None
        checked_in = [n for n in plan.nodes if n != leader_node and any(node == n for node, _ in entries)]
        leader_heard = any(node == leader_node for node, _ in entries)  # its workers live: so does it, likely
        if not entries or not leader_node or leader_heard or not checked_in or checked_in[0] != self.node_id:
            self._round = None
            return False
        w = self._round
        if w is None or w.generation != plan.generation or w.leader != leader_node:
            self._round = _DeputyRound(
                plan.generation, leader_node, _Pinger(self.client, self.keys, self.reader, self.clock)
            )
            self._round.pinger.ping(leader_node)
            return False
        # twice the roll call's patience: deposing a live leader costs a node (it is fenced)
        if w.done or w.pinger.answered(leader_node) or w.pinger.waited(leader_node) < 2 * self.ping_timeout_s:
            return False
        if self.outage_grace_s and self.client.outage_within(self.outage_grace_s):
            return False  # the leader could not answer while etcd was away: ask it again later
        w.done = True
        data, _ = self.client.get_json(self.keys.node(leader_node))  # not mirrored by non-leaders
        rec = NodeRecord.parse(data, key=self.keys.node(leader_node)) if data is not None else None
        detail = (
            f"leader {leader_node} did not answer a ping during the roll call of generation "
            f"{plan.generation} (no sign of life in the {w.pinger.waited(leader_node):.1f}s since); revoked its lease"
        )
        if not left_cleanly(self.client, self.keys, [leader_node], me=self.node_id):  # a leaving leader is no loss
            log.at(node=self.node_id).warning("%s", detail)
            put_event(
                self.client,
                self.keys,
                Event(
                    time=time.time(), kind=EventKind.LOST, node=leader_node, generation=plan.generation, detail=detail
                ),
            )
            # fenced like any node that misses a ping, before its lease is revoked: a deposed leader that was
            # only slow must not take the lost lease for etcd's fault and campaign again; it comes back `returned`
            fence = FenceRecord(time=time.time(), generation=plan.generation).to_json()
            self.client.put_if_absent(self.keys.fence(leader_node), json.dumps(fence))
        if rec is not None:  # no record: its lease, which also holds the leader key, is gone already
            self.client.revoke_lease(rec.lease_id)
        return True


class Monitor(Protocol):
    """What `LeaderWatch` uses of a `LivenessMonitor` (tests pass a fake)."""

    def watch(self, targets: dict[str, str]) -> None: ...

    def take_dead(self) -> set[str]: ...

    def closed_ago(self, node: str) -> Optional[float]: ...

    def sync(self, timeout_s: float = 0.5) -> bool: ...

    def close(self) -> None: ...


LEADER_WATCHERS = 3
"""How many agents watch the leader's liveness socket (the roster's first nodes other than the
leader's): a leader that dies with up to LEADER_WATCHERS - 1 of them is still found by its socket."""


class LeaderWatch:
    """The deputies' fast path (`rendezvous.liveness`): the roster's first `LEADER_WATCHERS` nodes other
    than the leader hold a liveness connection to the leader's agent; the first that finds the
    agent gone revokes the leader's lease at once (the leader key and its node record go with
    it), and campaigns.

    It holds one to every other node of the roster as well. A refused connection proves a death
    only at an address that answered before (a wrong `--local-addr` is refused too), and a new
    leader has answered nobody yet: when the leader dies with other nodes (a rack, a spot wave),
    the deputy that takes over knows at once which of them are dead as well (`hand_over`) instead
    of waiting for their leases."""

    def __init__(
        self,
        client: KVStore,
        keys: Keys,
        *,
        node_id: str,
        reader: KVReader,
        on_dead: Optional[Callable[[str], None]] = None,
        monitor: Optional[Monitor] = None,
    ) -> None:
        self.client, self.keys, self.node_id, self.reader = client, keys, node_id, reader
        self.on_dead = on_dead
        self.monitor: Optional[Monitor] = monitor  # a LivenessMonitor, made when first needed
        # ((roster generation, leader), the leader's record, the other roster nodes' records), cached
        self._record: Optional[tuple[tuple[int, str], Optional[NodeRecord], dict[str, NodeRecord]]] = None
        self._others_dead: set[str] = set()  # roster nodes other than the leader found dead

    def watch(self, leader: Optional[NodeRecord], others: Optional[dict[str, str]] = None) -> None:
        """Hold liveness connections to `leader`'s agent and to `others` (node -> address);
        None: to nobody."""
        if leader is None or not leader.liveness:
            if self.monitor is not None:
                self.monitor.watch({})
            self._others_dead.clear()
            return
        if self.monitor is None:
            self.monitor = LivenessMonitor(name=f"node {self.node_id}", on_dead=self.on_dead)
        targets = {**(others or {}), leader.node_id: leader.liveness}
        self.monitor.watch(targets)
        self._others_dead &= set(targets)

    def check(self, roster: Optional[Roster]) -> bool:
        """Whether the leader's agent was found dead (then its lease was revoked here)."""
        leader = read_leader(self.reader, self.keys)
        node = leader.node_id if leader is not None else None
        if roster is None or (node is None and self._record is None):
            self.watch(None)
            return False
        if node is None:  # between a revoked leader and the next: keep watching, act on no one
            assert self._record is not None
            self._watch_cached()
            return False
        if self.node_id not in [n for n in roster.nodes if n != node][:LEADER_WATCHERS]:
            self.watch(None)
            self._record = None
            return False
        if self._record is None or self._record[0] != (roster.generation, node):
            # once per generation and leader (not mirrored here): the records give the addresses
            records = {r.node_id: r for r in live_nodes(self.client, self.keys)}
            others = {n: r for n, r in records.items() if n in roster.nodes and n not in (node, self.node_id)}
            self._record = ((roster.generation, node), records.get(node), others)
        _, known, others = self._record
        self._watch_cached()
        if known is None or self.monitor is None:
            return False
        dead = self.monitor.take_dead()
        if node in dead:  # who died with it: every connection that closed by now has its verdict
            self.monitor.sync()
            dead |= self.monitor.take_dead()
        dead -= left_cleanly(self.client, self.keys, dead, me=self.node_id)  # refused, but said goodbye
        self._others_dead |= dead - {node}
        if node not in dead:
            return False
        # the nodes that died with it first: their records are gone before the election that the
        # leader's revoked lease starts, so whoever leads next leaves them out at once
        for other in sorted(self._others_dead & set(others)):
            detail = f"{evidence(self.monitor.closed_ago(other))} (with leader {node}); the deputy revoked its lease"
            self._revoke(others[other], detail, roster.generation)
        self._revoke(
            known, f"leader {node}: {evidence(self.monitor.closed_ago(node))}; revoked its lease", roster.generation
        )
        return True

    def _watch_cached(self) -> None:
        """Watch the leader and the other roster nodes of the cached records."""
        assert self._record is not None
        _, known, others = self._record
        self.watch(known, {n: r.liveness for n, r in others.items() if r.liveness})

    def _revoke(self, record: NodeRecord, detail: str, generation: int) -> None:
        """Fence a node found dead, revoke its lease, and say so in a `lost` event. Several
        deputies may find the same death: the one whose fence record is the first writes the
        event (the others' revocations change nothing)."""
        fence = FenceRecord(time=time.time(), generation=generation).to_json()
        first = self.client.put_if_absent(self.keys.fence(record.node_id), json.dumps(fence))
        self.client.revoke_lease(record.lease_id)  # a lease already gone is no error
        if not first:
            log.at(node=self.node_id).info("node %s was found dead by another agent too", record.node_id)
            return
        log.at(node=self.node_id).warning("node %s: %s", record.node_id, detail)
        put_event(
            self.client, self.keys, Event(time=time.time(), kind=EventKind.LOST, node=record.node_id, detail=detail)
        )

    def hand_over(self) -> tuple[Optional[Monitor], set[str]]:
        """For the leader this agent becomes: the monitor, whose connections are the proof that a
        refused address is a dead agent, and the other nodes it found dead (not acted on yet).
        This watch holds nothing afterwards."""
        monitor, dead = self.monitor, set(self._others_dead)
        self.monitor, self._record = None, None
        self._others_dead.clear()
        return monitor, dead

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()


class LeaderLiveness:
    """The leader's fast path while it leads (`rendezvous.liveness`): a connection to every other agent of
    the plan; a node found dead is pending until `decide` acts on it (`acted`). A new leader has
    reached nobody yet, so it starts from what it can trust: the monitor of its `LeaderWatch` when
    it was a deputy (with the nodes found dead with the old leader), and the addresses the last
    leader reached (`liveness_answered`), taken as answered; and it records those it reaches."""

    def __init__(
        self, client: KVStore, keys: Keys, *, node_id: str, watch: LeaderWatch, on_dead: Callable[[str], None]
    ) -> None:
        self.client, self.keys, self.node_id = client, keys, node_id
        monitor, dead = watch.hand_over()
        name = f"leader {node_id}"
        if not isinstance(monitor, LivenessMonitor):
            if monitor is not None:
                monitor.close()
            monitor = LivenessMonitor(name=name, on_dead=on_dead)
        monitor.name, monitor.on_dead = name, on_dead
        self.monitor = monitor
        now = time.monotonic()
        dead -= left_cleanly(client, keys, dead, me=node_id)
        self._pending = {node: now for node in dead}  # found dead -> when (monotonic)
        answered = read_answered(client, keys)  # what the last leader reached
        if answered is not None:
            monitor.vouch(answered.addresses)
        self._written: Optional[tuple[int, dict[str, str]]] = None  # last (generation, addresses) recorded
        self._synced = False

    def found_dead(self, plan: Plan, records: list[NodeRecord]) -> dict[str, float]:
        """Nodes of `plan` found dead and not acted on yet -> since when (monotonic). The first
        call waits for the verdicts at the vouched addresses (`LivenessMonitor.sync`)."""
        self.monitor.watch(
            {
                r.node_id: r.liveness
                for r in records
                if r.node_id in plan.nodes and r.node_id != self.node_id and r.liveness
            }
        )
        if not self._synced:
            self._synced = True
            self.monitor.sync()
        self._record_answered(plan, records)
        now = time.monotonic()
        dead = self.monitor.take_dead() & set(plan.nodes)
        for node in dead - left_cleanly(self.client, self.keys, dead, me=self.node_id):
            self._pending.setdefault(node, now)
        self._pending = {node: at for node, at in self._pending.items() if node in plan.nodes}
        return dict(self._pending)

    def why(self, node: str) -> str:
        """The evidence against `node` found dead, and how long ago it was last alive."""
        return evidence(self.monitor.closed_ago(node))

    def acted(self) -> None:
        """The pending deaths are acted on (a re-plan without them): the next ones start afresh."""
        self._pending.clear()

    def close(self) -> None:
        self.monitor.close()
        self._pending.clear()

    def _record_answered(self, plan: Plan, records: list[NodeRecord]) -> None:
        """Keep `liveness_answered` to the plan's addresses this leader reached (a few writes per
        generation: when the set grows), for the next leader."""
        reached = self.monitor.answered() & set(plan.nodes)
        addresses = {r.node_id: r.liveness for r in records if r.node_id in reached and r.liveness}
        if not addresses or self._written == (plan.generation, addresses):
            return
        self.client.put_json(self.keys.liveness_answered, AnsweredRecord(plan.generation, addresses).to_json())
        self._written = (plan.generation, addresses)


def why_lost(detector: Detector, node: str, liveness: Optional[LeaderLiveness], rollcall: RollCall) -> str:
    """The detail of the `lost` event of `node`, found dead by `detector`: the evidence, and the
    seconds since its last sign of life (or that the detector cannot know them)."""
    if detector == Detector.LIVENESS and liveness is not None:
        return liveness.why(node)
    if detector == Detector.ROLL_CALL:
        return rollcall.why(node)
    return LOST_BECAUSE[detector]
