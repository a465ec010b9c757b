"""The leader's decisions (rendezvous/decide.py) on made-up views: no etcd, no threads."""

from __future__ import annotations

from dataclasses import replace

from oobleck_elastic.rendezvous.decide import (
    LeaderAction,
    Clocks,
    Detection,
    Detector,
    LeaderView,
    Rules,
    decide,
    plan_events,
)
from oobleck_elastic.records.control import NodeState

from helpers import layout_plan

RULES = Rules(min_nodes=2, max_nodes=4, last_call_s=1.0, settle_s=0.5)


def plan_of(nodes: int):
    """A plan on n0..n{nodes-1} (one-stage pipelines of one node each)."""
    return layout_plan([[(0, 6)]] * nodes, [2] * nodes, generation=1)


def test_below_min_nodes_nothing_happens() -> None:
    d = decide(LeaderView(up=("n0",)), Clocks(first_quorum=3.0), 10.0, RULES)
    assert d.action == LeaderAction.NONE and d.clocks.first_quorum is None


def test_the_first_plan_waits_a_last_call_for_more_nodes() -> None:
    view = LeaderView(up=("n0", "n1"))
    d = decide(view, Clocks(), 10.0, RULES)
    assert d.action == LeaderAction.WAIT and d.clocks.first_quorum == 10.0
    d = decide(view, d.clocks, 10.9, RULES)
    assert d.action == LeaderAction.WAIT
    d = decide(view, d.clocks, 11.0, RULES)
    assert d.action == LeaderAction.FIRST_PLAN and d.nodes == ("n0", "n1")


def test_max_nodes_up_plans_at_once_and_leaves_the_rest_as_spares() -> None:
    d = decide(LeaderView(up=("n0", "n1", "n2", "n3", "n4")), Clocks(), 10.0, RULES)
    assert d.action == LeaderAction.FIRST_PLAN and d.nodes == ("n0", "n1", "n2", "n3")


def test_admitted_first_nodes_are_planned_with_new_arrivals_up_to_max() -> None:
    view = LeaderView(
        up=("n0", "n1", "n2", "n3", "n4", "n5"), admitted=frozenset({"n1", "n2"}), fenced=frozenset({"n0"})
    )
    d = decide(view, Clocks(), 10.0, RULES)
    assert d.action == LeaderAction.FIRST_PLAN and d.nodes == ("n1", "n2", "n3", "n4") and d.admit == ("n3", "n4")


def test_a_lost_node_is_replanned_after_the_settle_window() -> None:
    view = LeaderView(up=("n0", "n1", "n3"), plan=plan_of(4))
    d = decide(view, Clocks(), 10.0, RULES)
    assert d.action == LeaderAction.WAIT and d.clocks.change_seen == 10.0
    d = decide(view, d.clocks, 10.5, RULES)
    assert d.action == LeaderAction.REPLAN and d.nodes == ("n0", "n1", "n3") and d.clocks.change_seen is None


def test_a_change_that_reverts_within_the_settle_window_is_not_replanned() -> None:
    d = decide(LeaderView(up=("n0", "n1", "n3"), plan=plan_of(4)), Clocks(), 10.0, RULES)
    d = decide(LeaderView(up=("n0", "n1", "n2", "n3"), plan=plan_of(4)), d.clocks, 10.2, RULES)
    assert d.action == LeaderAction.NONE and d.clocks.change_seen is None


def test_right_after_an_etcd_outage_missing_nodes_are_held_not_replanned() -> None:
    view = LeaderView(up=("n0",), plan=plan_of(4), outage_recent=True)
    d = decide(view, Clocks(change_seen=1.0), 10.0, RULES)
    assert d.action == LeaderAction.WAIT and d.held == ("n1", "n2", "n3") and d.clocks.change_seen is None
    d = decide(LeaderView(up=("n0",), plan=plan_of(4)), d.clocks, 10.1, RULES)  # the grace is over
    assert d.action == LeaderAction.WAIT and d.clocks.change_seen == 10.1


def test_a_fenced_node_is_dropped_even_with_a_record() -> None:
    d = decide(
        LeaderView(up=("n0", "n1", "n2", "n3"), plan=plan_of(4), fenced=frozenset({"n2"})),
        Clocks(change_seen=9.0),
        10.0,
        RULES,
    )
    assert d.action == LeaderAction.REPLAN and d.nodes == ("n0", "n1", "n3")


def test_late_nodes_are_admitted_while_there_is_room_and_planned_once_ready() -> None:
    view = LeaderView(up=("n0", "n1", "n4", "n5", "n6"), plan=plan_of(2), not_ready=frozenset({"n4", "n5", "n6"}))
    d = decide(view, Clocks(), 10.0, RULES)
    assert d.action == LeaderAction.NONE and d.admit == ("n4", "n5")  # n6 would exceed max_nodes: a spare
    view = LeaderView(
        up=("n0", "n1", "n4", "n5", "n6"),
        plan=plan_of(2),
        admitted=frozenset({"n4", "n5"}),
        not_ready=frozenset({"n5", "n6"}),
    )
    d = decide(view, Clocks(change_seen=9.0), 10.0, RULES)
    assert d.action == LeaderAction.REPLAN and d.nodes == ("n0", "n1", "n4") and d.admit == ()


def liveness(*nodes: str, since: float) -> Detection:
    return Detection(Detector.LIVENESS, tuple(nodes), since=since)


def rollcall(*nodes: str) -> Detection:
    return Detection(Detector.ROLL_CALL, tuple(nodes))


def test_liveness_deaths_wait_a_batch_window_then_replan_at_once_without_them() -> None:
    view = LeaderView(up=("n0", "n1", "n2", "n3"), plan=plan_of(4), dead=liveness("n2", since=10.0))
    d = decide(view, Clocks(change_seen=9.0), 10.02, RULES)
    assert d.action == LeaderAction.WAIT and d.recheck_s == RULES.liveness_batch_s / 2 and d.clocks == Clocks()
    assert d.lost == () and d.admit == ()
    # a second death inside the window joins the same re-plan; no settle window after it
    view = LeaderView(up=("n0", "n1", "n2", "n3"), plan=plan_of(4), dead=liveness("n1", "n2", since=10.0))
    d = decide(view, Clocks(), 10.05, RULES)
    assert d.action == LeaderAction.REPLAN and d.nodes == ("n0", "n3") and d.lost == ("n1", "n2")
    assert d.detection == Detector.LIVENESS and d.recheck_s == 0.0 and d.clocks == Clocks()


def test_a_liveness_verdict_is_not_held_by_an_etcd_outage() -> None:
    view = LeaderView(up=("n0", "n1", "n3"), plan=plan_of(4), outage_recent=True, dead=liveness("n3", since=1.0))
    d = decide(view, Clocks(), 10.0, RULES)
    assert d.action == LeaderAction.REPLAN and d.nodes == ("n0", "n1") and d.held == ()


def test_a_liveness_replan_leaves_out_fenced_nodes_and_takes_spares() -> None:
    view = LeaderView(
        up=("n0", "n1", "n2", "n3", "n4"), plan=plan_of(4), fenced=frozenset({"n1"}), dead=liveness("n2", since=1.0)
    )
    d = decide(view, Clocks(), 10.0, RULES)
    assert d.action == LeaderAction.REPLAN and d.nodes == ("n0", "n3", "n4") and d.lost == ("n2",)


def test_a_liveness_replan_leaves_out_not_ready_nodes_too() -> None:
    """A spare whose workers still import torch, and a node of the plan restarting a hung worker
    (its readiness withdrawn), stay out of the re-plan after a death, as after a roll call."""
    view = LeaderView(
        up=("n0", "n1", "n2", "n3", "n4"),
        plan=plan_of(4),
        not_ready=frozenset({"n1", "n4"}),
        dead=liveness("n2", since=1.0),
    )
    d = decide(view, Clocks(), 10.0, RULES)
    assert d.action == LeaderAction.REPLAN and d.nodes == ("n0", "n3") and d.lost == ("n2",)


def test_a_roll_call_verdict_replans_at_once_without_the_dead_and_the_not_ready() -> None:
    view = LeaderView(
        up=("n0", "n1", "n2", "n3", "n4"),
        plan=plan_of(4),
        not_ready=frozenset({"n3", "n4"}),
        admitted=frozenset({"n4"}),
        dead=rollcall("n1"),
    )
    d = decide(view, Clocks(change_seen=9.9), 10.0, RULES)
    assert d.action == LeaderAction.REPLAN and d.nodes == ("n0", "n2") and d.lost == ("n1",)
    assert d.detection == Detector.ROLL_CALL and d.recheck_s == 0.0 and d.clocks == Clocks() and d.admit == ()


def test_a_roll_call_where_everyone_answered_restarts_the_generation_on_the_same_nodes() -> None:
    d = decide(LeaderView(up=("n0", "n1"), plan=plan_of(2), dead=rollcall()), Clocks(), 10.0, RULES)
    assert d.action == LeaderAction.REPLAN and d.nodes == ("n0", "n1") and d.lost == ()


def test_right_after_an_etcd_outage_a_roll_call_verdict_is_held() -> None:
    view = LeaderView(up=("n0", "n1"), plan=plan_of(4), outage_recent=True, dead=rollcall("n2", "n3"))
    d = decide(view, Clocks(change_seen=9.0), 10.0, RULES)
    assert d.action == LeaderAction.WAIT and d.held == ("n2", "n3") and d.detection == Detector.ROLL_CALL
    assert d.clocks == Clocks(change_seen=9.0) and d.lost == () and d.recheck_s is None
    # a restart (nobody dead) is not held: the workers' failure is real whatever etcd did
    d = decide(LeaderView(up=("n0", "n1"), plan=plan_of(2), outage_recent=True, dead=rollcall()), Clocks(), 10.0, RULES)
    assert d.action == LeaderAction.REPLAN and d.nodes == ("n0", "n1")


def test_below_n0_the_refused_nodes_are_not_replanned_again_until_a_change() -> None:
    dead = Detection(Detector.ROLL_CALL, ("n0",))
    view = LeaderView(up=("n1",), plan=plan_of(2), dead=dead)
    d = decide(view, Clocks(), 10.0, RULES)  # first time: re-plan (the planner then refuses)
    assert d.action == LeaderAction.REPLAN and d.nodes == ("n1",) and d.lost == ("n0",)
    refused = replace(view, refused=("n1",))
    d = decide(refused, Clocks(), 10.1, RULES)
    assert d.action == LeaderAction.WAIT_FOR_NODES and d.lost == () and d.recheck_s is None
    # the same without a detection (the settle rule), and not once the node set changes
    d = decide(replace(refused, dead=None), Clocks(change_seen=9.0), 10.1, RULES)
    assert d.action == LeaderAction.WAIT_FOR_NODES
    # an arrival is admitted meanwhile (detection or not); once it is ready, the set changes
    d = decide(replace(refused, up=("n1", "n2"), not_ready=frozenset({"n2"})), Clocks(), 10.1, RULES)
    assert d.action == LeaderAction.WAIT_FOR_NODES and d.admit == ("n2",)
    d = decide(replace(refused, up=("n1", "n2"), admitted=frozenset({"n2"})), Clocks(), 10.1, RULES)
    assert d.action == LeaderAction.REPLAN and d.nodes == ("n1", "n2")


def test_below_n0_before_the_first_plan_the_refused_nodes_are_not_planned_again_until_a_change() -> None:
    view = LeaderView(up=("n0", "n1"), refused=("n0", "n1"))  # the planner refused generation 1 on them
    d = decide(view, Clocks(first_quorum=1.0), 10.0, RULES)
    assert d.action == LeaderAction.WAIT_FOR_NODES and d.nodes == () and d.clocks.first_quorum == 1.0
    d = decide(replace(view, up=("n0", "n1", "n2")), Clocks(first_quorum=1.0), 10.0, RULES)
    assert d.action == LeaderAction.FIRST_PLAN and d.nodes == ("n0", "n1", "n2")
    # nodes admitted while the profile was measured: the same, and an arrival is admitted and planned
    admitted = replace(view, admitted=frozenset({"n0", "n1"}))
    d = decide(admitted, Clocks(), 10.0, RULES)
    assert d.action == LeaderAction.WAIT_FOR_NODES and d.admit == ()
    d = decide(replace(admitted, up=("n0", "n1", "n2")), Clocks(), 10.0, RULES)
    assert d.action == LeaderAction.FIRST_PLAN and d.nodes == ("n0", "n1", "n2") and d.admit == ("n2",)


def test_the_events_of_a_replan_say_why_each_node_left() -> None:
    from dataclasses import replace

    from oobleck_elastic.rendezvous.detect import LOST_BECAUSE

    old = plan_of(4)
    new = replace(layout_plan([[(0, 6)]], [2], generation=2), nodes=("n0",))
    states = {"n0": NodeState.UP, "n1": NodeState.DRAINING, "n2": NodeState.UP}  # n3: its record vanished
    events = plan_events(new, old, states, {"n2": LOST_BECAUSE[Detector.LIVENESS]}, leader="n0", now=5.0)
    assert [(e.kind, e.node) for e in events] == [("drain", "n1"), ("lost", "n2"), ("lost", "n3"), ("plan", "n0")]
    assert events[1].detail == LOST_BECAUSE[Detector.LIVENESS] and "lease expired" in events[2].detail
    assert events[-1].detail.endswith("(drain/lost -n1,n2,n3)") and {e.generation for e in events} == {2}
    restart = plan_events(old, old, {}, {}, leader="n0", now=5.0)
    assert [e.kind for e in restart] == ["plan"] and "(restart)" in restart[0].detail


def test_a_node_that_said_goodbye_leaves_and_every_death_names_its_evidence() -> None:
    """A goodbye on record makes a leave of a detector's verdict and of a vanished record (not of
    a drain); a `lost` event without a goodbye says what proved the death and when the node was
    last alive, or that the leader cannot know."""
    from oobleck_elastic.rendezvous.decide import RECORD_GONE
    from oobleck_elastic.rendezvous.liveness import evidence

    old = plan_of(6)
    new = replace(layout_plan([[(0, 6)]], [2], generation=2), nodes=("n0",))
    states = {"n0": NodeState.UP, "n1": NodeState.DRAINING, "n2": NodeState.UP}  # n3..n5: records vanished
    lost = {"n2": evidence(1.25), "n3": evidence(None)}
    left = {"n1": "agent shut down", "n2": "agent shut down", "n4": ""}
    events = plan_events(new, old, states, lost, leader="n0", now=5.0, left=left)
    assert [(e.kind, e.node) for e in events] == [
        ("drain", "n1"),
        ("leave", "n2"),
        ("lost", "n3"),
        ("leave", "n4"),
        ("lost", "n5"),
        ("plan", "n0"),
    ]
    details = [e.detail for e in events]
    assert details[1] == "said goodbye (agent shut down)" and details[3] == "said goodbye (left cleanly)"
    assert "refused a new connection" in details[2] and "last sign of life not known here" in details[2]
    assert details[4] == RECORD_GONE and "last sign of life not known to the leader" in RECORD_GONE
    assert "last sign of life 1.2s earlier (its connection closed then)" in evidence(1.25)


def test_records_parse_kinds_and_states_into_enums_and_refuse_unknown_ones() -> None:
    from oobleck_elastic.records.keys import Keys
    from oobleck_elastic.records.control import NodeRecord, NodeState
    from oobleck_elastic.records.job import Event, EventKind

    ev = Event.parse({"schema_version": 1, "time": 1.0, "kind": "renew", "node": "node3"})
    assert ev is not None and ev.kind is EventKind.RENEW and f"{ev.kind}" == "renew"
    assert Event.parse({"schema_version": 1, "time": 1.0, "kind": "reboot", "node": "node3"}) is None
    data = {
        "schema_version": 1,
        "node_id": "node2",
        "index": 2,
        "host": "h",
        "devices": 1,
        "agent_pid": 1,
        "state": "draining",
        "since": 1.0,
        "lease_id": 7,
    }
    rec = NodeRecord.parse(data, key="/oobleck/r/nodes/node2")
    assert rec is not None and rec.state is NodeState.DRAINING
    assert NodeRecord.parse({**data, "state": "asleep"}) is None
    keys = Keys("/oobleck", "r")
    assert keys.node_of(keys.fence("node4")) == "node4"


def test_a_roster_round_trips_and_a_malformed_one_is_refused() -> None:
    import pytest

    from oobleck_elastic.records.control import Roster

    roster = Roster(3, ("node0", "node2"))
    assert Roster.parse(roster.to_json()) == roster
    for bad in (
        {"schema_version": 1, "generation": 0, "nodes": []},
        {"schema_version": 2, "generation": 1, "nodes": []},
        {"schema_version": 1, "generation": 1, "nodes": [1]},
        [],
        "x",
    ):
        with pytest.raises(ValueError):
            Roster.parse(bad)


def test_a_drained_node_whose_hand_over_never_happened_is_named_a_donor_again() -> None:
    """A draining node hands its layers over in the entry of the plan that leaves it out. When that
    generation never completes a step (a node died during its entry), the next plan names it a
    donor again: it still holds the committed layers, possibly their last copy. Once a step was
    completed there it has nothing current left to give."""
    from oobleck_elastic.records.control import NodeRecord
    from oobleck_elastic.rendezvous.publish import donors

    def record(node: str, state: NodeState) -> NodeRecord:
        return NodeRecord(node, int(node[1:]), "h", 1, 1, state, 0.0, 1)

    first = plan_of(4)  # n0..n3, each a one-stage pipeline
    records = [record("n0", NodeState.UP), record("n1", NodeState.UP), record("n3", NodeState.DRAINING)]
    drained = layout_plan([[(0, 6)]] * 3, [2] * 3, generation=2)  # n0..n2: n3 drained
    assert donors(drained, first, records, {}, lambda n: False) == ("n3",)
    gen2 = replace(drained, donors=("n3",))
    gen3 = layout_plan([[(0, 6)]] * 2, [2] * 2, generation=3)  # n0, n1: n2 died entering gen2
    assert donors(gen3, gen2, records, {"n2": "lost"}, lambda n: False, old_stepped=False) == ("n3",)
    assert donors(gen3, gen2, records, {"n2": "lost"}, lambda n: False, old_stepped=True) == ()
    assert donors(gen3, gen2, records, {"n2": "lost"}, lambda n: n == "n3", old_stepped=False) == ()
    assert donors(gen3, gen2, records[:2], {"n2": "lost"}, lambda n: False, old_stepped=False) == ()  # gone


def test_every_node_of_the_plan_draining_with_none_up_stops_the_job() -> None:
    plan = plan_of(3)
    view = LeaderView(up=(), draining=("n0", "n1", "n2"), plan=plan)
    assert decide(view, Clocks(), 10.0, RULES).action == LeaderAction.STOP
    # one node still up: a re-plan (or waiting for nodes) as for any drain, never a stop
    some = decide(replace(view, up=("n2",), draining=("n0", "n1")), Clocks(), 10.0, RULES)
    assert some.action == LeaderAction.WAIT
    # a spare up while the plan's nodes drain: it takes over (admitted, then planned)
    spare = decide(replace(view, up=("n3",)), Clocks(), 10.0, RULES)
    assert spare.action != LeaderAction.STOP and spare.admit == ("n3",)
    # a plan node that is neither up nor draining (dead, not yet detected): no stop on a drain's account
    assert decide(replace(view, draining=("n0", "n1")), Clocks(), 10.0, RULES).action != LeaderAction.STOP


def test_a_stop_closes_the_job_at_once_only_when_no_worker_steps() -> None:
    from oobleck_elastic.rendezvous.decide import Decision, closes_on_stop

    waiting, replanning = Decision(LeaderAction.WAIT_FOR_NODES), Decision(LeaderAction.REPLAN, nodes=("n0", "n1"))
    assert closes_on_stop(LeaderView(up=("n0",)), Decision(LeaderAction.NONE))  # before the first plan
    lost = LeaderView(up=("n0",), plan=plan_of(2))  # n1 gone, below n0: the survivors wait for nodes
    assert closes_on_stop(lost, waiting)
    assert not closes_on_stop(lost, replanning)  # a plan comes: its workers stop at their first boundary
    # a drained node is still in the running plan: the workers step on, and stop with a checkpoint
    assert not closes_on_stop(replace(lost, draining=("n1",)), waiting)
    assert not closes_on_stop(LeaderView(up=("n0", "n1"), plan=plan_of(2)), Decision(LeaderAction.NONE))
