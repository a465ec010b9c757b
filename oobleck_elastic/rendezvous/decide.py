"""The leader's decisions, as a pure function of what it sees and the time.

`decide(view, clocks, now, rules)` says what the leader does this tick; the loop around it does
the I/O. `Clocks` is the only memory between ticks, so every rule is tested on made-up views.
The rules: docs/recovery.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Collection, Mapping, Optional, Sequence

from ..planning import Plan
from ..planning.plan.rebalance import mitigate
from ..records.control import NodeState, StrEnum
from ..records.job import Event, EventKind


RECORD_GONE = "record gone (lease expired or revoked), no goodbye; last sign of life not known to the leader"
"""The detail of a `lost` event whose node's record vanished with no detector's verdict."""


class Detector(StrEnum):
    """How a node of the plan was found dead (`rendezvous.detect`, `rendezvous.liveness`)."""

    LIVENESS = "liveness"
    """The leader's liveness connection to its agent closed and a new one was refused."""
    ROLL_CALL = "roll_call"
    """Workers checked in at the roll call, and its agent did not answer a ping."""


class LeaderAction(StrEnum):
    NONE = "none"
    """Nothing to do and nothing pending: the leader may sleep until the next change."""
    WAIT = "wait"
    """A change is pending on the clock (last call, settle window, outage grace): tick soon."""
    FIRST_PLAN = "first_plan"
    """Plan generation 1 on `nodes` (or admit them first while the profile is measured)."""
    REPLAN = "replan"
    """Publish the next generation on `nodes`."""
    REBALANCE = "rebalance"
    """Publish `plan`: the same nodes and stages, the microbatches re-split around a straggler."""
    WAIT_FOR_NODES = "wait_for_nodes"
    """A re-plan would use exactly the nodes the planner refused (fewer than n0): only a change
    (a node arriving or leaving, the job closing) can help, so the leader sleeps until one."""
    STOP = "stop"
    """Every node of the plan is draining and no other node is up (a preemption notice to every
    agent, e.g. the scheduler ending the job): ask the job to stop at its next step boundary, with
    a checkpoint, instead of waiting for nodes while the notices' grace runs out."""


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
    liveness_batch_s: float = 0.05
    """After a liveness verdict, how long to wait for more deaths, so that they share one re-plan."""
    rebalance: bool = False
    """Re-split the microbatches at the pipelines' measured speeds when the workers name a
    straggler (fault_tolerance.straggler_rebalance)."""


@dataclass(frozen=True)
class Detection:
    """Nodes of the plan a detector found dead (the leader gathers them between re-plans)."""

    by: Detector
    nodes: tuple[str, ...]
    """The dead nodes, sorted; empty for a roll call whose suspects all answered (the workers saw
    a failure, so the generation restarts)."""
    since: float = 0.0
    """When the first of them was found (monotonic seconds; the liveness batch runs from it)."""


@dataclass(frozen=True)
class LeaderView:
    up: tuple[str, ...]
    """Nodes whose record says `up` (not draining), by index."""
    draining: tuple[str, ...] = ()
    """Nodes whose record says `draining`."""
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
    dead: Optional[Detection] = None
    """Nodes of the plan found dead since the last re-plan, if any."""
    speeds: tuple[float, ...] = ()
    """Each pipeline's measured seconds per microbatch, reported for the current generation while
    the workers name a straggler (`engine.resilience.straggler`); empty otherwise."""
    slow: tuple[str, ...] = ()
    """The nodes the workers named stragglers (with `speeds`)."""
    without: Optional[Plan] = None
    """The planner's plan for the plan's nodes without `slow` (None: none could be made)."""
    refused: tuple[str, ...] = ()
    """The nodes the planner could not plan the next generation on (too few for one replica;
    before the first plan: generation 1); empty when it refused nothing since the current plan."""


@dataclass(frozen=True)
class Clocks:
    first_quorum: Optional[float] = None
    """When MIN nodes were first seen up before the first plan (monotonic seconds)."""
    change_seen: Optional[float] = None
    """When the desired node set first differed from the plan's."""


@dataclass(frozen=True)
class Decision:
    action: LeaderAction
    nodes: tuple[str, ...] = ()
    """The nodes of the plan to publish (FIRST_PLAN, REPLAN)."""
    admit: tuple[str, ...] = ()
    """Nodes to admit now (their agents start their workers)."""
    clocks: Clocks = field(default_factory=Clocks)
    """The clocks for the next tick."""
    held: tuple[str, ...] = ()
    """Nodes a re-plan would drop, held because etcd was away a moment ago."""
    lost: tuple[str, ...] = ()
    """Nodes to declare lost before publishing (REPLAN after a detection)."""
    detection: Optional[Detector] = None
    """The detector this decision acts on (REPLAN: the loop then closes the roll call and forgets
    the liveness verdicts; WAIT: the verdict is held or batched)."""
    recheck_s: Optional[float] = None
    """Look again after this long instead of the loop's usual pause (0: at once)."""
    plan: Optional[Plan] = None
    """The plan to publish as it is (REBALANCE)."""
    leave_out: tuple[str, ...] = ()
    """Stragglers to leave out of this and later plans (REPLAN chosen by `mitigate`)."""
    why: str = ""
    """What a straggler remedy compared (REBALANCE, or REPLAN with `leave_out`)."""


def decide(view: LeaderView, clocks: Clocks, now: float, rules: Rules) -> Decision:
    """What the leader does now (docs/recovery.md)."""
    if view.plan is None:
        first = _before_first_plan(view, clocks, now, rules)
        if first.action == LeaderAction.FIRST_PLAN and view.refused and first.nodes == view.refused:
            return replace(first, action=LeaderAction.WAIT_FOR_NODES, nodes=())  # admissions still happen
        return first
    if view.dead is not None:
        decision = _after_detection(view, view.plan, view.dead, clocks, now, rules)
        if not _refused(view, decision):
            return decision
        # the dead were declared lost with the attempt the planner refused: carry on as usual
        # (admitting arrivals), which waits for a change
    return _while_running(view, view.plan, clocks, now, rules)


def _refused(view: LeaderView, decision: Decision) -> bool:
    """Whether `decision` re-plans on exactly the nodes the planner refused last."""
    return decision.action == LeaderAction.REPLAN and bool(view.refused) and decision.nodes == view.refused


def _while_running(view: LeaderView, plan: Plan, clocks: Clocks, now: float, rules: Rules) -> Decision:
    alive = [n for n in view.up if n not in view.fenced]
    if not alive and set(plan.nodes) <= set(view.draining):
        return Decision(LeaderAction.STOP, clocks=replace(clocks, change_seen=None))
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
        return Decision(LeaderAction.WAIT, admit=tuple(admit), clocks=replace(clocks, change_seen=None), held=dropped)
    if view.refused and tuple(desired) == view.refused:  # asking the planner again cannot help
        return Decision(LeaderAction.WAIT_FOR_NODES, admit=tuple(admit), clocks=replace(clocks, change_seen=None))
    if desired == list(plan.nodes):
        remedy = mitigate(plan, view.speeds, view.slow, view.without) if rules.rebalance and view.speeds else None
        clear = replace(clocks, change_seen=None)
        if remedy is not None and remedy.plan is not None:
            return Decision(
                LeaderAction.REBALANCE, admit=tuple(admit), plan=remedy.plan, clocks=clear, why=remedy.describe()
            )
        if remedy is not None and remedy.leave_out:
            return Decision(
                LeaderAction.REPLAN,
                nodes=tuple(n for n in desired if n not in remedy.leave_out),
                admit=tuple(admit),
                clocks=clear,
                leave_out=remedy.leave_out,
                why=remedy.describe(),
            )
        return Decision(LeaderAction.NONE, admit=tuple(admit), clocks=clear)
    change_seen = clocks.change_seen if clocks.change_seen is not None else now
    if now - change_seen >= rules.settle_s:
        return Decision(
            LeaderAction.REPLAN, nodes=tuple(desired), admit=tuple(admit), clocks=replace(clocks, change_seen=None)
        )
    return Decision(LeaderAction.WAIT, admit=tuple(admit), clocks=replace(clocks, change_seen=change_seen))


def closes_on_stop(view: LeaderView, decision: Decision) -> bool:
    """Whether a request to stop the job must close it now, because no worker steps to stop at a
    boundary: no plan yet, or the plan lost a node (neither up nor draining) and `decision` waits
    for nodes. Otherwise the workers stop at their next boundary, with a checkpoint."""
    if view.plan is None:
        return True
    gone = any(n not in view.up and n not in view.draining for n in view.plan.nodes)
    return gone and decision.action == LeaderAction.WAIT_FOR_NODES


def desired_nodes(plan: Plan, up: Sequence[str], exclude: Collection[str], max_nodes: int) -> list[str]:
    """The next plan's nodes: the plan's nodes still up, in plan order, then other nodes up by
    index, leaving out `exclude`, up to `max_nodes`."""
    usable = [n for n in up if n not in exclude]
    return ([n for n in plan.nodes if n in usable] + [n for n in usable if n not in plan.nodes])[:max_nodes]


def _after_detection(
    view: LeaderView, plan: Plan, dead: Detection, clocks: Clocks, now: float, rules: Rules
) -> Decision:
    """Re-plan at once without the nodes a detector found dead (docs/recovery.md)."""
    if dead.by == Detector.LIVENESS:
        if now - dead.since < rules.liveness_batch_s:  # nodes that die together go in one re-plan
            return Decision(LeaderAction.WAIT, clocks=Clocks(), detection=dead.by, recheck_s=rules.liveness_batch_s / 2)
    elif dead.nodes and view.outage_recent:  # silence proves nothing right after an etcd outage
        return Decision(LeaderAction.WAIT, clocks=clocks, held=dead.nodes, detection=dead.by)
    # not-ready nodes stay out too: a spare still importing torch, a node restarting a hung worker
    exclude = view.fenced | set(dead.nodes) | view.not_ready
    return Decision(
        LeaderAction.REPLAN,
        nodes=tuple(desired_nodes(plan, view.up, exclude, rules.max_nodes)),
        lost=dead.nodes,
        detection=dead.by,
        clocks=Clocks(),
        recheck_s=0.0,
    )


def _before_first_plan(view: LeaderView, clocks: Clocks, now: float, rules: Rules) -> Decision:
    candidates = [n for n in view.up if n not in view.fenced]
    first = [n for n in candidates if n in view.admitted]
    if first:  # nodes were admitted (their workers measure the profile): plan them, plus arrivals
        admit = [n for n in candidates if n not in view.admitted][: max(0, rules.max_nodes - len(first))]
        return Decision(
            LeaderAction.FIRST_PLAN, nodes=tuple(first + admit)[: rules.max_nodes], admit=tuple(admit), clocks=clocks
        )
    if len(view.up) < rules.min_nodes:
        return Decision(LeaderAction.NONE, clocks=replace(clocks, first_quorum=None))
    quorum = clocks.first_quorum if clocks.first_quorum is not None else now
    if len(view.up) >= rules.max_nodes or now - quorum >= rules.last_call_s:
        return Decision(
            LeaderAction.FIRST_PLAN,
            nodes=tuple(view.up[: rules.max_nodes]),
            clocks=replace(clocks, first_quorum=quorum),
        )
    return Decision(LeaderAction.WAIT, clocks=replace(clocks, first_quorum=quorum))


def plan_events(
    plan: Plan,
    old: Optional[Plan],
    states: Mapping[str, NodeState],
    lost: Mapping[str, str],
    *,
    leader: str,
    now: float,
    left: Mapping[str, str] = {},
) -> list[Event]:
    """The events that go with publishing `plan` after `old`: one per node it leaves out (`lost`
    with how it was found dead, `drain`, `leave` (`left`: its agent said goodbye, and why), or
    `lost` when its record vanished; `states`: the state of every node with a record), then the
    `plan` event that sums up the change. A goodbye makes a leave of any death but a drain."""
    before = list(old.nodes) if old else []
    added = [n for n in plan.nodes if n not in before]
    removed = [n for n in before if n not in plan.nodes]
    events = []
    for n in removed:
        if n in lost and n not in left:
            kind, detail = EventKind.LOST, lost[n]
        elif states.get(n) == NodeState.DRAINING:
            kind = EventKind.DRAIN
            detail = "drained at a step boundary" + ("; hands its layers over in the entry" if n in plan.donors else "")
        elif n in left:
            kind, detail = EventKind.LEAVE, f"said goodbye ({left[n] or 'left cleanly'})"
        elif n in states:
            kind, detail = EventKind.LEAVE, "left the plan"
        else:
            kind, detail = EventKind.LOST, RECORD_GONE
        events.append(Event(time=now, kind=kind, node=n, generation=plan.generation, detail=detail))
    causes = sorted({e.kind for e in events} | ({"join"} if added and old else set())) or (
        ["rebalance"] if plan.rebalanced else ["restart"] if old else ["initial"]
    )
    events.append(
        Event(
            time=now,
            kind=EventKind.PLAN,
            node=leader,
            generation=plan.generation,
            detail=f"{len(plan.nodes)} node(s), {len(plan.pipelines)} pipeline(s), "
            f"{plan.world_size} worker(s) ({'/'.join(causes)}"
            f"{': +' + ','.join(added) if added and old else ''}"
            f"{' -' + ','.join(removed) if removed else ''})",
        )
    )
    return events


def strict_refusal(plan: Plan, *, first: bool, strict: bool) -> Optional[str]:
    """Why the job fails instead of training on `plan` (`fault_tolerance.strict`: its first plan
    gives less than the config asks, as `plan.warnings` say), or None. A plan after losses is
    never refused: it trains with its warnings, the job's best under what is left."""
    if not (strict and first and plan.warnings):
        return None
    return (
        f"fault_tolerance.strict: generation {plan.generation} gives less than the config asks: "
        + "; ".join(plan.warnings)
        + "; change the keys named, start more nodes, or set fault_tolerance.strict=false to train with less"
    )


def shortfall_line(plan: Plan) -> Optional[str]:
    """The leader's one WARNING line for a plan that gives less than the config asks, or None."""
    if not plan.warnings:
        return None
    return f"generation {plan.generation} gives less than the config asks: " + "; ".join(plan.warnings)
