"""Closing the job as failed, the leader's last word: the `closed` record and its event.

`close_failed` writes both (workers and agents leave with the reason, no plan can follow);
`restarts_exhausted` is the restart bound's verdict (`rendezvous.restart_loop`) read from etcd,
the job's last error stored when it says stop. docs/recovery.md.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from ..etcd import EtcdClient
from ..logs import JobLog
from ..planning import Plan
from ..records.job import ClosedRecord, Event, EventKind
from ..records.keys import Keys
from .membership import put_event
from .restart_loop import read_attempts, restart_verdict

log = JobLog(logging.getLogger(__name__))


def close_failed(client: EtcdClient, keys: Keys, node: str, reason: str, *, known_error: bool = False) -> None:
    """Close the job as failed with `reason`, written by leader `node`; `known_error`: a setting to
    change (`ClosedRecord.known_error`, agents exit 2)."""
    log.at(node=node).error("%s", reason)
    closed = ClosedRecord(time=time.time(), reason=reason, failed=True, known_error=known_error)
    client.put_json(keys.closed, closed.to_json())
    put_event(client, keys, Event(time=time.time(), kind=EventKind.CLOSED, node=node, detail=reason))


def restarts_exhausted(
    client: EtcdClient, keys: Keys, plan: Plan, nodes: tuple[str, ...], max_restarts: int
) -> Optional[str]:
    """Why a restart on `nodes` after `plan` is one too many without progress, the job's last error
    stored; None while the restart may go on (or `nodes` differ: no restart, nothing to read)."""
    if tuple(nodes) != plan.nodes:
        return None
    attempts, progress = read_attempts(client, keys, plan, max_restarts)
    verdict = restart_verdict(attempts, next_nodes=nodes, progress=progress, bound=max_restarts)
    if verdict is None:
        return None
    if verdict.record is not None:
        client.put_json(keys.errors, verdict.record.to_json())
    return verdict.reason
