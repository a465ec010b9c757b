"""Node membership: one record per node, bound to an etcd lease the node keeps alive.

`Member.register()` takes the next node index with a compare-and-swap on `next_index`, grants
a lease of `lease_ttl_s`, and writes `nodes/<node_id>` under it. A daemon thread refreshes the
lease every TTL/3. When the node dies (SIGKILL, power loss), nobody refreshes the lease and etcd
deletes the record within the TTL; when it leaves cleanly (`close()`), the lease is revoked and
the record disappears at once. If a refresh finds the lease already gone (the node was frozen or
cut off for longer than the TTL), the node is *fenced*: the rest of the job has moved on without
it, so `fenced` is set and the callback runs; the node must not keep training on alone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Iterator, Optional

from ..etcd import EtcdClient, EtcdError
from ..etcd.client import warn_once
from .keys import Event, Keys, NodeRecord

log = logging.getLogger(__name__)


def live_nodes(client: EtcdClient, keys: Keys) -> list[NodeRecord]:
    """Every valid node record, by index (malformed ones are logged and skipped)."""
    out = []
    for key, data in client.get_prefix_json(keys.nodes):
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


def put_event(client: EtcdClient, keys: Keys, event: Event) -> None:
    client.put_json(keys.event(event.node), event.to_json())


def read_events(client: EtcdClient, keys: Keys) -> Iterator[tuple[str, Event]]:
    for key, data in client.get_prefix_json(keys.events):
        ev = Event.parse(data, key=key)
        if ev is not None:
            yield key, ev


class Member:
    """This node's membership record and lease."""

    def __init__(self, client: EtcdClient, keys: Keys, *, devices: int, lease_ttl_s: float,
                 host: Optional[str] = None, on_fenced: Optional[Callable[[], None]] = None) -> None:
        self.client = client
        self.keys = keys
        self.devices = devices
        self.lease_ttl_s = lease_ttl_s
        self.host = host or socket.gethostname()
        self.on_fenced = on_fenced
        self.lease: Any = None
        self.record: Optional[NodeRecord] = None
        self.fenced = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def node_id(self) -> str:
        assert self.record is not None, "register() first"
        return self.record.node_id

    def register(self) -> NodeRecord:
        raw = self.client.raw
        index = self._next_index()
        self.lease = self.client._call(raw.lease, max(1, int(round(self.lease_ttl_s))))
        self.record = NodeRecord(node_id=f"node{index}", index=index, host=self.host, devices=self.devices,
                                 agent_pid=os.getpid(), state="up", since=time.time(), lease_id=self.lease.id)
        self.client.put_json(self.keys.node(self.record.node_id), self.record.to_json(), lease=self.lease)
        put_event(self.client, self.keys, Event(time=time.time(), kind="join", node=self.record.node_id,
                                                detail=f"host {self.host}, {self.devices} device(s), "
                                                       f"agent pid {os.getpid()}"))
        self._thread = threading.Thread(target=self._keepalive, name="oobleck-lease", daemon=True)
        self._thread.start()
        log.info("node %s registered (index %d, lease %x, ttl %.1fs)", self.record.node_id, index,
                 self.lease.id, self.lease_ttl_s)
        return self.record

    def _next_index(self) -> int:
        raw, key = self.client.raw, self.keys.next_index
        tx = raw.transactions
        while True:
            value, meta = self.client._call(raw.get, key)
            current = _counter(value) if value is not None else 0
            if current is None:  # not a counter: never reuse an id that is live, fenced or admitted
                current = self._first_unused_index()
                warn_once(key, meta.mod_revision, f"node {self.keys.run_id}: ignoring malformed value of {key} "
                                                  f"({value[:40]!r}); continuing from index {current}")
            compare = [tx.create(key) == 0] if value is None else [tx.mod(key) == meta.mod_revision]
            ok, _ = self.client._call(raw.transaction, compare=compare,
                                      success=[tx.put(key, json.dumps(current + 1))], failure=[])
            if ok:
                return current

    def _first_unused_index(self) -> int:
        """One more than any node index in use: live records, fenced and admitted nodes."""
        used = [r.index for r in live_nodes(self.client, self.keys)]
        for prefix in (self.keys.fenced, self.keys.admitted("")):
            for k, _ in self.client.get_prefix_json(prefix):
                name = k.rsplit("/", 1)[-1]
                if name.startswith("node") and name[4:].isdigit():
                    used.append(int(name[4:]))
        return max(used, default=-1) + 1

    def _keepalive(self) -> None:
        interval = max(0.05, self.lease_ttl_s / 3)
        while not self._stop.wait(interval):
            try:
                responses = list(self.client.raw.refresh_lease(self.lease.id))
                ttl = responses[0].TTL if responses else 0
            except Exception as err:  # noqa: BLE001 - etcd briefly unreachable: try again
                log.warning("node %s: lease refresh failed (%s); retrying", self.node_id, err)
                continue
            if ttl <= 0:
                log.error("node %s: lease expired (the node was unreachable for longer than %.1fs); "
                          "the job has moved on without this node, which is now fenced", self.node_id,
                          self.lease_ttl_s)
                self.fenced.set()
                if self.on_fenced:
                    self.on_fenced()
                return

    def current_record(self) -> Optional[NodeRecord]:
        """This node's record as stored now (the CLI may have set it to draining)."""
        data, _ = self.client.get_json(self.keys.node(self.node_id))
        return NodeRecord.parse(data, key=self.keys.node(self.node_id)) if data is not None else None

    def close(self, *, revoke: bool = True) -> None:
        """Stop refreshing; with revoke the record disappears now, without it at lease expiry."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if revoke and self.lease is not None and not self.fenced.is_set():
            try:
                self.client.raw.revoke_lease(self.lease.id)
            except (EtcdError, Exception) as err:  # noqa: BLE001 - best effort on the way out
                log.warning("node %s: could not revoke lease: %s", self.record and self.record.node_id, err)
