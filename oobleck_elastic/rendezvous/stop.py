"""A request to stop the job at its next step boundary, with a checkpoint: the `stop` record.

`oobleck stop`, the local launcher's Ctrl-C and the leader (every node of the plan draining, no
other node up: `decide` says STOP) write it once (`request_stop`). Workers read it between steps
and the step's commit makes them agree on the boundary (engine/step/commit.py): they save that
step and the worker holding rank 0 closes the job as stopped. When no worker steps (no plan yet,
or a lost node and too few left: `decide.closes_on_stop`) the leader closes it at once
(`close_if_stopped`). docs/operations.md.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Optional

from ..etcd import EtcdClient
from ..etcd.protocols import KVReader
from ..logs import JobLog
from ..planning import Plan
from ..records.job import ClosedRecord, Event, EventKind, StopRecord
from ..records.keys import Keys
from ..records.read import read_stop
from .membership import put_event

__all__ = ["EVERY_NODE_DRAINING", "close_if_stopped", "request_stop", "stop_when_drained"]

log = JobLog(logging.getLogger(__name__))

EVERY_NODE_DRAINING = "every node of the job is draining (preemption notices or oobleck kill-agent) and no other is up"
"""The leader's reason when `decide` says STOP."""


def request_stop(client: EtcdClient, keys: Keys, reason: str) -> bool:
    """Write the `stop` record unless one exists; whether this call wrote it."""
    return client.put_if_absent(keys.stop, json.dumps(StopRecord(time=time.time(), reason=reason).to_json()))


def stop_when_drained(client: EtcdClient, reader: KVReader, keys: Keys, *, node: str, plan: Optional[Plan]) -> None:
    """The leader, when every node of `plan` is draining (`decide` says STOP): ask once."""
    if read_stop(reader, keys) is None and request_stop(client, keys, EVERY_NODE_DRAINING):
        log.at(node=node).warning(
            "generation %s: %s: the job stops at its next step boundary, with a checkpoint",
            plan.generation if plan is not None else "none",
            EVERY_NODE_DRAINING,
        )


def close_if_stopped(client: EtcdClient, reader: KVReader, keys: Keys, *, node: str, plan: Optional[Plan]) -> None:
    """The leader, while no worker steps (`decide.closes_on_stop`): a stop asked closes the job now,
    not failed, with a `closed` event (nothing to save: the newest checkpoint stands)."""
    stop = read_stop(reader, keys)
    if stop is None:
        return
    where = f"generation {plan.generation} lost a node and waits for nodes" if plan else "before the first plan"
    reason = f"stopped on request ({stop.reason}) {where}: no step to save, the newest checkpoint stands"
    log.at(node=node).warning("%s", reason)
    client.put_json(keys.closed, ClosedRecord(time=time.time(), reason=reason, stopped=True).to_json())
    put_event(client, keys, Event(time=time.time(), kind=EventKind.CLOSED, node=node, detail=reason))
