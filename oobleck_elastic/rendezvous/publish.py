"""Publishing a plan: what the leader writes to etcd when it moves the job to a new generation.

Invariant: one transaction, guarded by the plan's revision and the leader key, so a deposed or
partitioned leader can never overwrite a newer plan. The story: docs/recovery.md.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Mapping, Optional

from ..etcd import EtcdClient
from ..etcd.protocols import KVStore
from ..planning import Plan
from ..records.control import Event, EventKind, FenceRecord, NodeRecord, NodeState, Roster
from ..records.keys import Keys
from .decide import plan_events
from .membership import goodbye_of, put_event

TXN_EVENTS = 100
"""Events written in the plan's transaction at most (etcd allows 128 operations)."""


def declare_lost(client: KVStore, keys: Keys, node: str, generation: int) -> None:
    """`fenced/<node>`: excluded from plans; its workers stop, and its agent fences itself if it
    comes back (`rendezvous.membership`)."""
    client.put_json(keys.fence(node), FenceRecord(time=time.time(), generation=generation).to_json())


def donors(
    plan: Plan,
    old: Optional[Plan],
    records: list[NodeRecord],
    lost: Mapping[str, str],
    fenced: Callable[[str], bool],
    *,
    old_stepped: bool = True,
) -> tuple[str, ...]:
    """Nodes that are draining now, leave with `plan` and still hold layers: they join its entry
    to hand them over, then leave. Those that ran a stage of `old`, and, when `old` never
    completed a step (`old_stepped` False: its entry failed, say a node died during it), `old`'s
    own donors, whose hand-over then did not happen: their layers are still the committed ones."""
    if old is None:
        return ()
    draining = {r.node_id for r in records if r.state == NodeState.DRAINING}
    holders = [s.node for p in old.pipelines for s in p.stages]
    if not old_stepped:
        holders += list(old.donors)
    return tuple(
        n
        for n in dict.fromkeys([*old.nodes, *old.donors])
        if n in draining and n in holders and n not in plan.nodes and n not in lost and not fenced(n)
    )


def commit_plan(
    client: EtcdClient,
    keys: Keys,
    plan: Plan,
    old: Optional[Plan],
    records: list[NodeRecord],
    lost: Mapping[str, str],
    *,
    leader: str,
    leader_value: bytes,
    rev: Optional[int],
) -> Optional[list[Event]]:
    """Publish `plan` as the next generation with its events (docs/recovery.md); its events, or
    None when the transaction lost the race (the plan or the leadership changed). A node that
    leaves the plan after its agent said goodbye (read from etcd here) is a `leave`, not fenced."""
    generation = plan.generation
    gone = [n for n in (old.nodes if old else ()) if n not in plan.nodes]
    left = {n: said.detail for n in gone if (said := goodbye_of(client, keys, n)) is not None}
    states = {r.node_id: r.state for r in records}
    events = plan_events(plan, old, states, lost, leader=leader, now=time.time(), left=left)
    live = {r.node_id for r in records}
    for ev in events:
        if ev.kind == EventKind.LOST and ev.node not in live:
            declare_lost(client, keys, ev.node, generation)
    blob = json.dumps(plan.to_json(), sort_keys=True)
    later, inline = (events[:-1], events[-1:]) if len(events) > TXN_EVENTS else ([], events)
    puts = {
        keys.plan: blob,
        keys.plan_at(generation): blob,
        keys.roster: json.dumps(Roster(generation, plan.nodes).to_json()),
    }
    puts.update((keys.event(ev.node), json.dumps(ev.to_json())) for ev in inline)
    if not client.transact(values={keys.leader: leader_value}, revisions={keys.plan: rev}, puts=puts):
        return None
    for ev in later:
        put_event(client, keys, ev)
    return events
