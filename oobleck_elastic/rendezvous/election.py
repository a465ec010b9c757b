"""Leader election: the `leader` key, put if absent under the agent's lease.

Invariant: an agent campaigns only while its lease is surely alive (`Member.lease_fresh`), so an
agent back from a stall never takes the key on a stale view; a value no agent can have written is
cleared so that it cannot block every election. The story: docs/liveness.md.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable, Optional

from ..etcd import EtcdClient, EtcdError
from ..etcd.client import KV, warn_once
from ..etcd.mirror import Mirror
from ..etcd.protocols import KVReader
from ..logs import JobLog
from ..records.control import LeaderRecord
from ..records.job import Event, EventKind
from ..records.keys import Keys
from .membership import Member, put_event

log = JobLog(logging.getLogger(__name__))


def caught_up(view: KVReader, key: str, done: Callable[[Optional[KV]], bool]) -> None:
    """After a write: wait (briefly) until a mirror shows it (the next tick acts on it)."""
    if isinstance(view, Mirror):
        view.wait_for(lambda v: done(v.get(key)), timeout=2.0)


class Election:
    """This agent's campaign for the `leader` key; `value` is its record once it won."""

    def __init__(self, client: EtcdClient, keys: Keys, member: Member, view: KVReader) -> None:
        self.client, self.keys, self.member, self.view = client, keys, member, view
        self.value = b""

    def campaign(self) -> bool:
        """Whether this agent leads: its own key is there, or it just won the empty one."""
        if not self.member.lease_fresh():
            return False  # after a stall its lease may be gone: its keep-alive says (or fences it)
        current = self.view.get(self.keys.leader)
        if current is not None and self.value and current.value == self.value:
            return True  # its own key, its lease alive (its loop had failed): it leads on
        if current is not None and isinstance(self.view, Mirror):  # someone leads: no request needed
            self._clear_bogus(current)
            return False
        value = LeaderRecord(node_id=self.member.node_id, since=time.time()).encode()
        try:
            won = self.client.put_if_absent(self.keys.leader, value, lease=self.member.lease)
        except EtcdError:
            raise
        except Exception as err:  # noqa: BLE001 - the lease expired (etcd stalled): the member renews it
            log.at(node=self.member.node_id).info(
                "cannot campaign yet (%s); the lease is being renewed", type(err).__name__
            )
            return False
        if won:
            self.value = value
            caught_up(self.view, self.keys.leader, lambda kv: kv is not None and kv.value == value)
            log.at(node=self.member.node_id).info("elected leader")
            put_event(
                self.client,
                self.keys,
                Event(time=time.time(), kind=EventKind.LEADER, node=self.member.node_id, detail="elected leader"),
            )
        else:
            self._clear_bogus(self.view.get(self.keys.leader))
        return bool(won)

    def _clear_bogus(self, kv: Optional[KV]) -> None:
        """A `leader` value that no agent can have written (not a {node_id, since} record, or not
        bound to a lease, so it would never expire) would block every election for good: delete
        it, if it is still the same revision, so the next campaign can win."""
        if kv is None:
            return
        try:
            LeaderRecord.parse(json.loads(kv.value))
            bogus = not kv.lease
        except (ValueError, UnicodeDecodeError):
            bogus = True
        if bogus:
            warn_once(
                self.keys.leader,
                kv.mod_revision,
                f"node {self.member.node_id}: removing a bogus value of {self.keys.leader} ({kv.value[:60]!r}): "
                "not an agent's leader record bound to a lease",
            )
            self.client.delete(self.keys.leader, revision=kv.mod_revision)

    def held(self) -> bool:
        """Whether the `leader` key (as the view shows it) is still this agent's."""
        kv = self.view.get(self.keys.leader)
        return kv is not None and kv.value == self.value
