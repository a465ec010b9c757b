"""Node membership: one record per node, bound to an etcd lease the node keeps alive.

Invariant: a node whose lease expired through its own fault (or that the leader declared lost)
is fenced and never trains again: it comes back only as `returned`, to hand its layers over; one
whose lease etcd let expire renews its membership. The story: docs/liveness.md, docs/recovery.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
from typing import Callable, Iterator, Optional

from ..logs import JobLog
from ..etcd import EtcdClient, EtcdError
from ..etcd.client import warn_once
from ..etcd.protocols import KVReader, KVStore
from ..records.keys import Keys
from ..records.control import FenceRecord, Goodbye, NodeRecord, NodeState
from ..records.job import Event, EventKind
from ..records.read import is_fenced, read_admitted

log = JobLog(logging.getLogger(__name__))


def live_nodes(reader: KVReader, keys: Keys) -> list[NodeRecord]:
    """Every valid node record, by index (malformed ones are logged and skipped)."""
    out = []
    for key, data in reader.get_prefix_json(keys.nodes):
        rec = NodeRecord.parse(data, key=key)
        if rec is not None:
            out.append(rec)
    return sorted(out, key=lambda r: r.index)


def _counter(value: bytes) -> Optional[int]:
    """A non-negative integer counter stored as JSON, or None when the value is anything else."""
    try:
        n = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def put_event(client: KVStore, keys: Keys, event: Event) -> None:
    client.put_json(keys.event(event.node), event.to_json())


def say_goodbye(client: KVStore, keys: Keys, node: str, detail: str) -> None:
    """Record that `node`'s agent leaves cleanly (`goodbye/<node>`, under no lease: it must outlive
    the node's record). Before its liveness socket closes, so that no watcher can take the leave
    for a death, however slowly it reads its sockets."""
    client.put_json(keys.goodbye(node), Goodbye(time=time.time(), detail=detail).to_json())


def goodbye_of(reader: KVReader, keys: Keys, node: str) -> Optional[Goodbye]:
    """`node`'s goodbye, or None when it said none. Read it from etcd, not from a mirror that may
    lag behind the socket that closed. A malformed value still counts (its presence is the signal)."""
    data, revision = reader.get_json(keys.goodbye(node))
    if revision is None:
        return None
    try:
        return Goodbye.parse(data)
    except (AttributeError, ValueError):
        return Goodbye(time=0.0)


def mark_draining(client: EtcdClient, keys: Keys, rec: NodeRecord, detail: str) -> bool:
    """Set node `rec`'s record to `draining` (a compare-and-swap on its revision, under its own
    lease) and record a `drain` event with `detail`; False when the record changed meanwhile or is
    gone. The leader then re-plans without the node at the next step boundary."""
    key = keys.node(rec.node_id)
    kv = client.get(key)
    draining = dataclasses.replace(rec, state=NodeState.DRAINING)
    if kv is None or not client.put_if_revision(
        key, json.dumps(draining.to_json()), kv.mod_revision, lease=rec.lease_id
    ):
        return False
    put_event(client, keys, Event(time=time.time(), kind=EventKind.DRAIN, node=rec.node_id, detail=detail))
    return True


def read_events(client: EtcdClient, keys: Keys) -> Iterator[tuple[str, Event]]:
    for key, data in client.get_prefix_json(keys.events):
        ev = Event.parse(data, key=key)
        if ev is not None:
            yield key, ev


class Member:
    """This node's membership record and lease."""

    def __init__(
        self,
        client: EtcdClient,
        keys: Keys,
        *,
        devices: int,
        lease_ttl_s: float,
        host: Optional[str] = None,
        on_fenced: Optional[Callable[[], None]] = None,
        on_renewed: Optional[Callable[[], None]] = None,
        liveness: str = "",
        device_class: str = "",
    ) -> None:
        self.client = client
        self.device_class = device_class
        self.keys = keys
        self.devices = devices
        self.lease_ttl_s = lease_ttl_s
        self.host = host or socket.gethostname()
        self.on_fenced = on_fenced
        self.on_renewed = on_renewed
        self.liveness = liveness
        self.lease: Optional[int] = None
        """The id of the lease this node's keys are bound to (a new one after a renewal)."""
        self.renewals = 0
        """How many times the lease was renewed after etcd let it expire."""
        self.returned = False
        """Fenced while its process lived, and back under a new lease (`_come_back`)."""
        self._lease_lock = threading.Lock()
        self.fence_reason = ""
        self.refreshed_at = time.monotonic()
        """When the last refresh that found the lease alive was sent (monotonic): until a TTL after
        it the lease is alive in etcd whatever this process's stalls (`lease_fresh`)."""
        self.record: Optional[NodeRecord] = None
        self.fenced = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def node_id(self) -> str:
        assert self.record is not None, "register() first"
        return self.record.node_id

    def register(self) -> NodeRecord:
        index = self._next_index()
        self.refreshed_at = time.monotonic()
        self.lease = self.client.grant_lease(self.lease_ttl_s)
        self.record = NodeRecord(
            node_id=f"node{index}",
            index=index,
            host=self.host,
            devices=self.devices,
            agent_pid=os.getpid(),
            state=NodeState.UP,
            since=time.time(),
            lease_id=self.lease,
            liveness=self.liveness,
            device_class=self.device_class,
        )
        self.client.put_json(self.keys.node(self.record.node_id), self.record.to_json(), lease=self.lease)
        put_event(
            self.client,
            self.keys,
            Event(
                time=time.time(),
                kind=EventKind.JOIN,
                node=self.record.node_id,
                detail=f"host {self.host}, {self.devices} device(s), agent pid {os.getpid()}",
            ),
        )
        self._thread = threading.Thread(target=self._keepalive, name="oobleck-lease", daemon=True)
        self._thread.start()
        log.info(
            "node %s registered (index %d, lease %x, ttl %.1fs)",
            self.record.node_id,
            index,
            self.lease,
            self.lease_ttl_s,
        )
        return self.record

    def _next_index(self) -> int:
        key = self.keys.next_index
        while True:
            kv = self.client.get(key)
            current = _counter(kv.value) if kv is not None else 0
            if current is None:  # not a counter: never reuse an id that is live, fenced or admitted
                assert kv is not None
                current = self._first_unused_index()
                warn_once(
                    key,
                    kv.mod_revision,
                    f"node {self.keys.run_id}: ignoring malformed value of {key} "
                    f"({kv.value[:40]!r}); continuing from index {current}",
                )
            if self.client.put_if_revision(key, json.dumps(current + 1), kv.mod_revision if kv else None):
                return current

    def _first_unused_index(self) -> int:
        """One more than any node index in use: live records, fenced and admitted nodes."""
        used = [r.index for r in live_nodes(self.client, self.keys)]
        fenced = {self.keys.node_of(k) for k, _ in self.client.get_prefix_json(self.keys.fenced)}
        for name in fenced | read_admitted(self.client, self.keys):
            if name.startswith("node") and name[4:].isdigit():
                used.append(int(name[4:]))
        return max(used, default=-1) + 1

    def _keepalive(self) -> None:
        interval = max(0.05, self.lease_ttl_s / 3)
        # when etcd last answered a refresh that found the lease alive: time spent waiting for
        # etcd's answer is etcd's slowness, not this node's, and must not count against it
        last_ok = time.monotonic()
        while not self._stop.wait(interval):
            sent = time.monotonic()
            try:
                assert self.lease is not None, "the keep-alive runs only while registered"
                ttl = self.client.refresh_lease(self.lease)
            except EtcdError as err:  # unreachable for longer than the outage bound
                self._fence(f"etcd stayed unreachable: {err}")
                return
            except Exception as err:  # noqa: BLE001 - an unexpected answer: try again next tick
                log.at(node=self.node_id).warning("lease refresh failed (%s); retrying", err)
                continue
            if ttl > 0:
                self.refreshed_at, last_ok = sent, time.monotonic()
                continue
            if not self.fenced.is_set():
                if sent - last_ok > self.lease_ttl_s:
                    self._fence(
                        f"lease expired: this node sent no refresh for {sent - last_ok:.1f}s after etcd last "
                        f"answered one (more than the {self.lease_ttl_s:.1f}s TTL); the job may go on without it"
                    )
                elif is_fenced(self.client, self.keys, self.node_id):
                    self._fence("the lease expired while etcd was unreachable, and the leader declared this node lost")
            renewed_at = time.monotonic()
            try:
                with self._lease_lock:
                    if self.fenced.is_set():
                        self._come_back()
                    else:
                        self._renew()
            except Exception as err:  # noqa: BLE001 - the lease is still gone at the next tick: again then
                log.at(node=self.node_id).warning("could not put the record back under a new lease (%s)", err)
                continue
            self.refreshed_at, last_ok = renewed_at, time.monotonic()

    def lease_fresh(self) -> bool:
        """Whether this node's lease is surely alive now: its last successful refresh was sent less
        than a TTL ago. After a stall of this process (SIGSTOP, a thread holding the GIL) it may have
        expired, and what this agent saw before the stall may be stale (the leader steps down)."""
        return not self.fenced.is_set() and time.monotonic() - self.refreshed_at < self.lease_ttl_s

    def _new_lease(self, state: NodeState) -> int:
        """Put this node's record back under a new lease (the old one expired); returns the old lease."""
        assert self.record is not None and self.lease is not None
        old = self.lease
        self.lease = self.client.grant_lease(self.lease_ttl_s)
        self.record = dataclasses.replace(self.record, lease_id=self.lease, state=state)
        self.client.put_json(self.keys.node(self.node_id), self.record.to_json(), lease=self.lease)
        return old

    def _renew(self) -> None:
        """etcd let the lease expire although it was refreshed on time (and the leader did not
        declare this node lost): take a new lease and put the same record under it."""
        # the record went with the old lease: put this node's copy back (a drain requested with
        # `kill-agent` went with it too, and must be asked again)
        old = self._new_lease(NodeState.UP)
        self.renewals += 1
        log.at(node=self.node_id).warning(
            "etcd let lease %x expire although it was refreshed on time (etcd stalled, restarted or "
            "was cut off); membership renewed under lease %x",
            old,
            self.lease,
        )
        put_event(
            self.client,
            self.keys,
            Event(
                time=time.time(),
                kind=EventKind.RENEW,
                node=self.node_id,
                detail=f"lease renewed after etcd let it expire ({old:x} -> {self.lease:x})",
            ),
        )
        if self.on_renewed is not None:
            self.on_renewed()

    def _come_back(self) -> None:
        """This node was fenced while its process lives: it comes back `returned` (same node id,
        a new lease), fenced for good (it never trains again), so that the layers its workers hold
        at the committed step can be handed over if the next plan has no other copy
        (docs/recovery.md, "A false death loses nothing")."""
        first = not self.returned
        old = self._new_lease(NodeState.RETURNED)
        self.returned = True
        # fenced in every reader's eyes, also before the leader published the plan without it
        # (after the record: a worker that sees the fence with no record leaves)
        self.client.put_if_absent(
            self.keys.fence(self.node_id), json.dumps(FenceRecord(time=time.time(), generation=0).to_json())
        )
        if first:
            log.at(node=self.node_id).warning(
                "came back under lease %x as `returned`: fenced, its layers can still be handed over", self.lease
            )
            put_event(
                self.client,
                self.keys,
                Event(
                    time=time.time(),
                    kind=EventKind.RENEW,
                    node=self.node_id,
                    detail=f"returned after it was declared lost ({old:x} -> {self.lease:x}): fenced, "
                    "its layers count until the next plan",
                ),
            )

    def check_declared_lost(self) -> None:
        """The leader may have declared this node lost while its lease lives (a ping it answered
        too late): then fence it and come back `returned` now (a roll call's ping prompts this)."""
        if self.fenced.is_set() or self.record is None or not is_fenced(self.client, self.keys, self.node_id):
            return
        with self._lease_lock:  # not while the keep-alive puts the record back too
            if not self.fenced.is_set():
                self._fence("the leader declared this node lost (it answered a ping too late)")
                self._come_back()

    def _fence(self, reason: str) -> None:
        log.at(node=self.node_id).error("%s; the node is fenced", reason)
        self.fence_reason = reason
        self.fenced.set()
        if self.on_fenced:
            self.on_fenced()

    def current_record(self) -> Optional[NodeRecord]:
        """This node's record as stored now (the CLI may have set it to draining)."""
        data, _ = self.client.get_json(self.keys.node(self.node_id))
        return NodeRecord.parse(data, key=self.keys.node(self.node_id)) if data is not None else None

    def close(self, *, revoke: bool = True) -> None:
        """Stop refreshing; with revoke the record disappears now, without it at lease expiry."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if revoke and self.lease is not None and (self.returned or not self.fenced.is_set()):
            try:
                self.client.revoke_lease(self.lease)
            except (EtcdError, Exception) as err:  # noqa: BLE001 - best effort on the way out
                log.at(node=self.record and self.record.node_id).warning("could not revoke lease: %s", err)
