"""Publishing a plan: what the leader writes to etcd when it moves the job to a new generation.

Invariant: one transaction, guarded by the plan's revision and the leader key, so a deposed or
partitioned leader can never overwrite a newer plan. The story: docs/recovery.md.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Optional

from ..etcd import EtcdClient
from ..etcd.protocols import KVStore
from ..planning import Plan
from ..planning.plan.plan import device_holders
from ..records.control import FenceRecord, NodeRecord, NodeState, Roster, StrEnum
from ..records.job import Event, EventKind
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


class Source(StrEnum):
    """Where the next generation takes a layer from (`choose_sources`), best first."""

    REPLICA = "replica"
    """A node of the plan, or a draining donor, held it in the generation just left."""
    RETURNED = "returned"
    """Only a node declared lost whose process lived and came back (fenced, its record live) held
    it: that node joins the entry as a donor."""
    SHADOW = "shadow"
    """No device holder is left; a node of the entry keeps its host-memory shadow copy."""
    WAIT = "wait"
    """No source yet, but a holder was dropped without proof of death: wait for it to come back."""
    DISK = "disk"
    """Every copy is lost: the workers restore the newest checkpoint."""


@dataclass(frozen=True)
class SourceChoice:
    """Where each layer of the next generation comes from (`choose_sources`)."""

    sources: tuple[Source, ...]
    """Per layer."""
    returned: tuple[str, ...] = ()
    """Returned nodes the plan takes layers from: its extra donors."""
    awaited: tuple[str, ...] = ()
    """Nodes dropped without proof of death that held a layer with no other source."""

    def layers(self, source: Source) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.sources) if s == source)

    def describe_wait(self) -> str:
        """`layers [3, 4] have no copy left but on node2, which may come back`."""
        nodes = ", ".join(self.awaited)
        return f"layers {list(self.layers(Source.WAIT))} have no copy left but on {nodes}, which may come back"


def choose_sources(
    plan: Plan,
    old: Plan,
    *,
    donors: Collection[str] = (),
    returned: Collection[str] = (),
    maybe_alive: Collection[str] = (),
) -> SourceChoice:
    """Where each layer of `plan` comes from after `old` (docs/recovery.md, "A false death loses
    nothing"): a holder in `old` that is in `plan` or a `donors` (replica); else a `returned` node
    that held it (fenced, its process alive: it becomes a donor); else a keeper of its shadow in the
    entry; else, while a holder is `maybe_alive` (its record vanished, or it missed a ping, and no
    refused connection proved it dead), wait; else disk. Whether a copy is at the committed step
    is the entry's to check (a copy behind it counts as none)."""
    entry = set(plan.nodes) | set(donors)
    keepers = plan_shadow_keepers(old)
    sources: list[Source] = []
    used: set[str] = set()
    awaited: set[str] = set()
    for layer, holders in enumerate(device_holders(old)):
        back = sorted(n for n in holders if n in returned and n not in entry)
        if holders & entry:
            sources.append(Source.REPLICA)
        elif back:
            sources.append(Source.RETURNED)
            used.add(back[0])
        elif keepers.get(layer, frozenset()) & entry:
            sources.append(Source.SHADOW)
        elif holders & set(maybe_alive):
            sources.append(Source.WAIT)
            awaited |= holders & set(maybe_alive)
        else:
            sources.append(Source.DISK)
    return SourceChoice(tuple(sources), returned=tuple(sorted(used)), awaited=tuple(sorted(awaited)))


def plan_shadow_keepers(plan: Plan) -> dict[int, frozenset[str]]:
    """Layer -> the nodes keeping its host-memory shadow copy in `plan`."""
    if plan.shadows is None:
        return {}
    return {layer: frozenset(nodes) for layer, nodes in enumerate(plan.shadows.layers)}


def returned_nodes(old: Plan, records: list[NodeRecord]) -> tuple[str, ...]:
    """Nodes of `old` declared lost while their process lived that came back (`returned`,
    `rendezvous.membership`): they never train again, but may hand over their layers."""
    back = {r.node_id for r in records if r.state == NodeState.RETURNED}
    return tuple(n for n in old.nodes if n in back)


def maybe_alive(old: Plan, plan: Plan, records: list[NodeRecord], fenced: Callable[[str], bool]) -> tuple[str, ...]:
    """Nodes of `old` that `plan` drops whose record vanished although nobody declared them lost:
    their lease expired, perhaps under load, and they may still come back. (A node found dead by a
    detector is fenced: a refused liveness connection proves it; one that missed a ping comes
    back `returned` only if it answers before the re-plan, docs/recovery.md.)"""
    live = {r.node_id for r in records}
    return tuple(n for n in old.nodes if n not in plan.nodes and n not in live and not fenced(n))


def with_donors(
    plan: Plan,
    old: Optional[Plan],
    records: list[NodeRecord],
    lost: Mapping[str, str],
    fenced: Callable[[str], bool],
    old_stepped: bool = True,
) -> tuple[Plan, Optional[SourceChoice]]:
    """`plan` with its donors (draining nodes, `donors`, and returned nodes for the layers nobody
    else holds, `choose_sources`), and the source choice (None for the first plan)."""
    gone = donors(plan, old, records, lost, fenced, old_stepped=old_stepped)
    if old is None:
        return dataclasses.replace(plan, donors=gone), None
    alive = maybe_alive(old, plan, records, fenced)
    choice = choose_sources(plan, old, donors=gone, returned=returned_nodes(old, records), maybe_alive=alive)
    return dataclasses.replace(plan, donors=gone + choice.returned, returned=choice.returned), choice


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
