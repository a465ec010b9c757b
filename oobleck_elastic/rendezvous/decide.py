"""The leader's decisions, as a pure function of what it sees and the time.

Each tick the leader (leader.py) reads its mirror into a `LeaderView` (plain data: the nodes that
are up, the current plan, fenced / admitted / not-ready nodes, whether etcd was away a moment
ago) and asks `decide(view, clocks, now, rules)` what to do; the loop around it does the I/O
(admissions, the planner, the publishing transaction). The roll call, which needs pings, runs
before it. `Clocks` is the only memory between ticks (when a quorum or a change was first seen),
so every rule is tested on made-up views (tests/test_decide.py) without etcd or threads:

- **before the first plan**: once nodes are admitted (the profile is being measured), plan those
  still up plus new arrivals up to `max_nodes`; otherwise wait for `min_nodes` up, then a
  last-call window of `last_call_s` for more (no wait once `max_nodes` are up);
- **while the job runs**: late nodes are admitted (their agents start workers) while the plan has
  room; the desired node set is the plan's nodes still up and not fenced, then admitted nodes
  whose workers are all ready, up to `max_nodes`; a difference from the plan is published once it
  has lasted `settle_s` (simultaneous failures and joins batch into one re-plan);
- **after an etcd outage** (within a lease TTL + settle of its end): a re-plan that drops nodes is
  held, since a stalled etcd expires every lease at once and the nodes renew theirs within a TTL
  (membership.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Collection, Optional, Sequence

from ..planning import Plan
from .records import StrEnum


class Action(StrEnum):
    NONE = "none"
    """Nothing to do and nothing pending: the leader may sleep until the next change."""
    WAIT = "wait"
    """A change is pending on the clock (last call, settle window, outage grace): tick soon."""
    FIRST_PLAN = "first_plan"
    """Plan generation 1 on `nodes` (or admit them first while the profile is measured)."""
    REPLAN = "replan"
    """Publish the next generation on `nodes`."""


@dataclass(frozen=True)
class Rules:
    min_nodes: int
    """--nnodes MIN: nodes needed before the first plan."""
    max_nodes: int
    """--nnodes MAX: nodes in a plan at most (others wait as spares)."""
    last_call_s: float
    """After MIN nodes are up, how long to wait for more before the first plan."""
    settle_s: float
    """How long a membership change must last before it is re-planned."""


@dataclass(frozen=True)
class LeaderView:
    up: tuple[str, ...]
    """Nodes whose record says `up` (not draining), by index."""
    plan: Optional[Plan] = None
    """The current plan (None before the first one)."""
    fenced: frozenset[str] = frozenset()
    """Nodes declared lost that still have a record."""
    admitted: frozenset[str] = frozenset()
    """Nodes the leader admitted (their agents started workers)."""
    not_ready: frozenset[str] = frozenset()
    """Nodes outside the plan whose workers have not all reported ready."""
    outage_recent: bool = False
    """etcd was unreachable (or stalled) within a lease TTL + settle of now."""


@dataclass(frozen=True)
class Clocks:
    first_quorum: Optional[float] = None
    """When MIN nodes were first seen up before the first plan (monotonic seconds)."""
    change_seen: Optional[float] = None
    """When the desired node set first differed from the plan's."""


@dataclass(frozen=True)
class Decision:
    action: Action
    nodes: tuple[str, ...] = ()
    """The nodes of the plan to publish (FIRST_PLAN, REPLAN)."""
    admit: tuple[str, ...] = ()
    """Nodes to admit now (their agents start their workers)."""
    clocks: Clocks = field(default_factory=Clocks)
    """The clocks for the next tick."""
    held: tuple[str, ...] = ()
    """Nodes a re-plan would drop, held because etcd was away a moment ago."""


def decide(view: LeaderView, clocks: Clocks, now: float, rules: Rules) -> Decision:
    """What the leader does now (see the module docstring)."""
    if view.plan is None:
        return _before_first_plan(view, clocks, now, rules)
    plan = view.plan
    alive = [n for n in view.up if n not in view.fenced]
    members = sum(1 for n in plan.nodes if n in alive)
    admit = []
    for node in alive:
        if node in plan.nodes:
            continue
        if node in view.admitted:
            members += 1
        elif members < rules.max_nodes:
            admit.append(node)
            members += 1
    desired = desired_nodes(plan, view.up, view.fenced | view.not_ready, rules.max_nodes)
    dropped = tuple(n for n in plan.nodes if n not in desired)
    if dropped and view.outage_recent:
        return Decision(Action.WAIT, admit=tuple(admit), clocks=replace(clocks, change_seen=None), held=dropped)
    if desired == list(plan.nodes):
        return Decision(Action.NONE, admit=tuple(admit), clocks=replace(clocks, change_seen=None))
    seen = clocks.change_seen if clocks.change_seen is not None else now
    if now - seen >= rules.settle_s:
        return Decision(Action.REPLAN, nodes=tuple(desired), admit=tuple(admit),
                        clocks=replace(clocks, change_seen=None))
    return Decision(Action.WAIT, admit=tuple(admit), clocks=replace(clocks, change_seen=seen))


def desired_nodes(plan: Plan, up: Sequence[str], exclude: Collection[str], max_nodes: int) -> list[str]:
    """The next plan's nodes: the plan's nodes still up, in plan order, then other nodes up by
    index, leaving out `exclude`, up to `max_nodes`."""
    usable = [n for n in up if n not in exclude]
    return ([n for n in plan.nodes if n in usable] + [n for n in usable if n not in plan.nodes])[:max_nodes]


def _before_first_plan(view: LeaderView, clocks: Clocks, now: float, rules: Rules) -> Decision:
    candidates = [n for n in view.up if n not in view.fenced]
    first = [n for n in candidates if n in view.admitted]
    if first:  # nodes were admitted (their workers measure the profile): plan them, plus arrivals
        admit = [n for n in candidates if n not in view.admitted][: max(0, rules.max_nodes - len(first))]
        return Decision(Action.FIRST_PLAN, nodes=tuple(first + admit)[: rules.max_nodes], admit=tuple(admit),
                        clocks=clocks)
    if len(view.up) < rules.min_nodes:
        return Decision(Action.NONE, clocks=replace(clocks, first_quorum=None))
    quorum = clocks.first_quorum if clocks.first_quorum is not None else now
    if len(view.up) >= rules.max_nodes or now - quorum >= rules.last_call_s:
        return Decision(Action.FIRST_PLAN, nodes=tuple(view.up[: rules.max_nodes]),
                        clocks=replace(clocks, first_quorum=quorum))
    return Decision(Action.WAIT, clocks=replace(clocks, first_quorum=quorum))
