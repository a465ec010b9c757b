"""The failure detectors (rendezvous/detect.py) on made-up states: an in-memory store
(etcd/memory.py) stands for etcd, a made-up clock for time, a fake for the liveness monitor. No
etcd process, no threads."""

from __future__ import annotations

from oobleck_elastic.etcd.memory import MemoryKV
from oobleck_elastic.rendezvous.decide import Detector
from oobleck_elastic.rendezvous.detect import STALL_RECHECK_S, Deputy, LeaderWatch, RollCall, why_lost
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.records.read import is_fenced
from oobleck_elastic.rendezvous.membership import live_nodes, read_events, say_goodbye
from oobleck_elastic.records.control import Checkin, CheckinKind, LeaderRecord, NodeRecord, NodeState, Roster
from oobleck_elastic.records.job import EventKind

from helpers import layout_plan

KEYS = Keys("/oobleck", "r")
TIMEOUT = 0.25
EPS = 1 / 64  # times are sums of binary fractions: exact, so a deadline is met exactly


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def cluster(nodes: int, *, leader: str = "n0", liveness: str = "") -> MemoryKV:
    """n0..n{nodes-1} up, each record under its own lease; `leader` holds the leader key."""
    kv = MemoryKV()
    for i in range(nodes):
        lease = kv.grant_lease(1.0)
        rec = NodeRecord(
            node_id=f"n{i}",
            index=i,
            host="h",
            devices=1,
            agent_pid=1,
            state=NodeState.UP,
            since=0.0,
            lease_id=lease,
            liveness=liveness,
        )
        kv.put_json(KEYS.node(rec.node_id), rec.to_json(), lease=lease)
        if rec.node_id == leader:
            kv.put(KEYS.leader, LeaderRecord(node_id=leader, since=0.0).encode(), lease=lease)
    return kv


def check_in(kv: MemoryKV, generation: int, node: str, kind: CheckinKind = CheckinKind.FAILURE) -> None:
    kv.put_json(KEYS.checkin(generation, node, 0), Checkin(time=1.0, kind=kind).to_json())


def answer(kv: MemoryKV, node: str) -> None:
    """What `node`'s agent does when it sees a ping: copy the nonce to its pong (handler.py)."""
    kv.put(KEYS.pong(node), kv.get(KEYS.ping(node)).value)


def plan_of(nodes: int, generation: int = 3):
    return layout_plan([[(0, 6)]] * nodes, [2] * nodes, generation=generation)


# ---------------------------------------------------------------------- RollCall (the leader's)
def roll_call(kv: MemoryKV, clock: Clock) -> RollCall:
    return RollCall(kv, KEYS, node_id="n0", ping_timeout_s=TIMEOUT, clock=clock)


def test_no_checkin_no_roll_call() -> None:
    kv, plan = cluster(4), plan_of(4)
    rc = roll_call(kv, Clock())
    assert rc.check(plan, live_nodes(kv, KEYS)) is None and not rc.open
    assert kv.get(KEYS.ping("n1")) is None


def test_silent_suspects_are_dead_after_the_ping_timeout_and_answering_ones_are_not() -> None:
    kv, plan, clock = cluster(4), plan_of(4), Clock()
    check_in(kv, plan.generation, "n1")
    rc = roll_call(kv, clock)
    assert rc.check(plan, live_nodes(kv, KEYS)) is None and rc.open  # pings sent; waiting for pongs
    assert kv.get(KEYS.ping("n2")) is not None and kv.get(KEYS.ping("n3")) is not None
    assert kv.get(KEYS.ping("n0")) is None and kv.get(KEYS.ping("n1")) is None  # the leader; checked in
    answer(kv, "n2")
    clock.now += TIMEOUT - EPS
    assert rc.check(plan, live_nodes(kv, KEYS)) is None  # n3 still has time
    clock.now += EPS
    assert rc.check(plan, live_nodes(kv, KEYS)) == ["n3"]
    assert rc.why("n3").endswith("did not answer a ping: no sign of life in the 0.2s since")  # 0.25 s
    assert why_lost(Detector.ROLL_CALL, "n3", None, rc) == rc.why("n3")


def test_a_suspect_without_a_record_is_dead_without_a_ping() -> None:
    kv, plan = cluster(3), plan_of(3)
    kv.revoke_lease(live_nodes(kv, KEYS)[2].lease_id)  # n2's record expired
    check_in(kv, plan.generation, "n1")
    rc = roll_call(kv, Clock())
    assert rc.check(plan, live_nodes(kv, KEYS)) == ["n2"]
    assert kv.get(KEYS.ping("n2")) is None
    assert "record is gone" in rc.why("n2") and "last sign of life not known to the roll call" in rc.why("n2")


def test_a_stale_pong_answers_nothing() -> None:
    kv, plan, clock = cluster(2), plan_of(2), Clock()
    kv.put(KEYS.pong("n1"), "an earlier nonce")
    check_in(kv, plan.generation, "n0")
    rc = roll_call(kv, clock)
    assert rc.check(plan, live_nodes(kv, KEYS)) is None
    clock.now += TIMEOUT
    assert rc.check(plan, live_nodes(kv, KEYS)) == ["n1"]


def test_a_failure_where_everyone_answers_asks_for_a_restart() -> None:
    kv, plan = cluster(3), plan_of(3)
    check_in(kv, plan.generation, "n1")
    rc = roll_call(kv, Clock())
    rc.check(plan, live_nodes(kv, KEYS))
    answer(kv, "n2")
    assert rc.check(plan, live_nodes(kv, KEYS)) == []  # re-plan on the same nodes


def test_stalls_alone_where_everyone_answers_are_asked_again_later() -> None:
    kv, plan, clock = cluster(3), plan_of(3), Clock()
    check_in(kv, plan.generation, "n1", CheckinKind.STALL)
    rc = roll_call(kv, clock)
    rc.check(plan, live_nodes(kv, KEYS))
    answer(kv, "n2")
    assert rc.check(plan, live_nodes(kv, KEYS)) is None and rc.open  # only slow
    clock.now += STALL_RECHECK_S
    assert rc.check(plan, live_nodes(kv, KEYS)) is None and not rc.open  # the next check pings anew
    first = kv.get(KEYS.ping("n2")).mod_revision
    rc.check(plan, live_nodes(kv, KEYS))
    assert kv.get(KEYS.ping("n2")).mod_revision > first


def test_a_checkin_of_another_generation_or_a_malformed_key_is_ignored() -> None:
    kv, plan = cluster(3), plan_of(3)
    check_in(kv, plan.generation - 1, "n1")
    kv.put_json(KEYS.rollcall(plan.generation) + "n1/not-a-rank", {"time": 1.0, "kind": "failure"})
    assert roll_call(kv, Clock()).check(plan, live_nodes(kv, KEYS)) is None


# ---------------------------------------------------------------------- Deputy (about the leader)
def deputy(kv: MemoryKV, clock: Clock, node: str = "n1") -> Deputy:
    return Deputy(kv, KEYS, node_id=node, ping_timeout_s=TIMEOUT, clock=clock, outage_grace_s=5.0)


def test_the_deputy_revokes_the_lease_of_a_leader_that_does_not_answer() -> None:
    kv, roster, clock = cluster(4), Roster(3, ("n0", "n1", "n2", "n3")), Clock()
    check_in(kv, 3, "n1")
    check_in(kv, 3, "n2")
    d = deputy(kv, clock)
    assert not d.pending  # nothing timed yet: its agent may sleep until a change
    assert not d.check(roster) and kv.get(KEYS.ping("n0")) is not None  # pinged
    assert d.pending  # timing the ping: its agent must look again before a change comes
    clock.now += 2 * TIMEOUT - EPS  # twice the roll call's patience
    assert not d.check(roster)
    kv.outage = True  # etcd was away: the leader may not have seen the ping
    clock.now += EPS
    assert not d.check(roster)
    kv.outage = False
    assert d.check(roster)
    assert kv.get(KEYS.leader) is None and kv.get(KEYS.node("n0")) is None  # its lease is gone
    assert is_fenced(kv, KEYS, "n0")  # a leader that was only slow must not renew and campaign again
    events = [ev for _, ev in read_events(kv, KEYS)]
    assert [(ev.kind, ev.node, ev.generation) for ev in events] == [(EventKind.LOST, "n0", 3)]
    assert "no sign of life in the 0.5s since" in events[0].detail  # twice the roll call's patience
    assert not d.pending
    assert not d.check(roster)  # once per round


def test_a_silent_leader_that_said_goodbye_is_deposed_without_a_lost_event() -> None:
    kv, roster, clock = cluster(3), Roster(3, ("n0", "n1", "n2")), Clock()
    check_in(kv, 3, "n1")
    say_goodbye(kv, KEYS, "n0", "agent shut down")  # shutting down: it answers no pings any more
    d = deputy(kv, clock)
    assert not d.check(roster)
    clock.now += 2 * TIMEOUT
    assert d.check(roster) and kv.get(KEYS.leader) is None  # the election need not wait for its exit
    assert list(read_events(kv, KEYS)) == []


def test_a_leader_that_answers_keeps_its_lease() -> None:
    kv, roster, clock = cluster(3), Roster(3, ("n0", "n1", "n2")), Clock()
    check_in(kv, 3, "n1")
    d = deputy(kv, clock)
    d.check(roster)
    answer(kv, "n0")
    clock.now += 10 * TIMEOUT
    assert not d.check(roster) and kv.get(KEYS.leader) is not None
    kv.delete(KEYS.checkin(3, "n1", 0))  # the roll call is over: nothing left to time
    assert not d.check(roster) and not d.pending


def test_only_the_first_node_that_checked_in_pings_and_not_when_the_leader_is_heard() -> None:
    kv, roster, clock = cluster(4), Roster(3, ("n0", "n1", "n2", "n3")), Clock()
    check_in(kv, 3, "n2")
    assert not deputy(kv, clock, "n1").check(roster)  # n1 did not check in: n2 is the deputy
    assert kv.get(KEYS.ping("n0")) is None
    check_in(kv, 3, "n0")
    assert not deputy(kv, clock, "n2").check(roster)  # the leader's own workers checked in: it lives
    assert kv.get(KEYS.ping("n0")) is None


# ---------------------------------------------------------------------- LeaderWatch (liveness)
class FakeMonitor:
    """A `LivenessMonitor` whose verdicts the test makes up."""

    def __init__(self) -> None:
        self.targets: dict[str, str] = {}
        self.dead: set[str] = set()
        self.closed: dict[str, float] = {}  # node -> seconds since its connection closed

    def closed_ago(self, node: str) -> float | None:
        return self.closed.get(node)

    def watch(self, targets: dict[str, str]) -> None:
        self.targets = dict(targets)

    def take_dead(self) -> set[str]:
        dead, self.dead = self.dead & set(self.targets), set()
        return dead

    def sync(self, timeout_s: float = 0.5) -> bool:
        return True

    def close(self) -> None:
        pass


def test_the_leader_watch_revokes_a_dead_leaders_lease_at_once() -> None:
    kv, monitor = cluster(3, liveness="h:1"), FakeMonitor()
    watch = LeaderWatch(kv, KEYS, node_id="n1", reader=kv, monitor=monitor)
    roster = Roster(3, ("n0", "n1", "n2"))
    assert not watch.check(roster) and monitor.targets == {"n0": "h:1", "n2": "h:1"}
    monitor.dead, monitor.closed = {"n0"}, {"n0": 0.5}
    assert watch.check(roster)
    assert kv.get(KEYS.leader) is None and kv.get(KEYS.node("n0")) is None
    events = [ev for _, ev in read_events(kv, KEYS)]
    assert [ev.kind for ev in events] == [EventKind.LOST]
    assert "refused a new connection" in events[0].detail and "last sign of life 0.5s earlier" in events[0].detail


def test_the_leader_watch_watches_the_roster_and_revokes_those_dead_with_the_leader_first() -> None:
    kv, monitor = cluster(4, liveness="h:1"), FakeMonitor()
    watch = LeaderWatch(kv, KEYS, node_id="n1", reader=kv, monitor=monitor)
    roster = Roster(3, ("n0", "n1", "n2", "n3"))
    assert not watch.check(roster) and monitor.targets == {"n0": "h:1", "n2": "h:1", "n3": "h:1"}
    monitor.dead = {"n2"}  # not acted on while the leader lives: the leader does
    assert not watch.check(roster) and kv.get(KEYS.node("n2")) is not None
    monitor.dead = {"n0"}
    assert watch.check(roster)
    assert [kv.get(KEYS.node(n)) is None for n in ("n0", "n2", "n3")] == [True, True, False]
    events = [ev for _, ev in read_events(kv, KEYS)]
    assert [(ev.kind, ev.node) for ev in events] == [(EventKind.LOST, "n2"), (EventKind.LOST, "n0")]
    assert all("last sign of life not known here" in ev.detail for ev in events)  # the fake timed nothing
    # no leader yet: the watch goes on (a node that died with the old one has a verdict for the next)
    assert not watch.check(roster) and set(monitor.targets) == {"n0", "n2", "n3"}
    assert watch.hand_over() == (monitor, {"n2"}) and watch.monitor is None


def test_only_the_rosters_first_three_other_nodes_watch_the_leader() -> None:
    kv, monitor = cluster(5, liveness="h:1"), FakeMonitor()
    watch = LeaderWatch(kv, KEYS, node_id="n4", reader=kv, monitor=monitor)
    monitor.dead = {"n0"}
    assert not watch.check(Roster(3, ("n0", "n1", "n2", "n3", "n4"))) and monitor.targets == {}
    assert kv.get(KEYS.leader) is not None
    third = LeaderWatch(kv, KEYS, node_id="n3", reader=kv, monitor=FakeMonitor())
    assert not third.check(Roster(3, ("n0", "n1", "n2", "n3", "n4")))
    assert third.monitor is not None and set(third.monitor.targets) == {"n0", "n1", "n2", "n4"}


def test_a_leader_without_a_liveness_address_is_not_watched() -> None:
    kv = cluster(3)
    watch = LeaderWatch(kv, KEYS, node_id="n1", reader=kv)
    assert not watch.check(Roster(3, ("n0", "n1", "n2"))) and watch.monitor is None  # no socket opened


def test_a_refused_socket_of_an_agent_that_said_goodbye_is_a_leave_not_a_death() -> None:
    """A goodbye read too late from the socket (a slow reader sees only a refused connection) is
    found in etcd: the leader keeps its lease, nobody is fenced, no `lost` event is written."""
    kv, monitor = cluster(4, liveness="h:1"), FakeMonitor()
    watch = LeaderWatch(kv, KEYS, node_id="n1", reader=kv, monitor=monitor)
    roster = Roster(3, ("n0", "n1", "n2", "n3"))
    assert not watch.check(roster)
    say_goodbye(kv, KEYS, "n0", "agent shut down")
    say_goodbye(kv, KEYS, "n3", "agent shut down")
    monitor.dead = {"n0", "n2", "n3"}  # all three refuse; n2 alone said no goodbye
    assert not watch.check(roster)
    assert kv.get(KEYS.leader) is not None and all(kv.get(KEYS.node(n)) is not None for n in ("n0", "n2", "n3"))
    assert list(read_events(kv, KEYS)) == [] and kv.get(KEYS.fence("n3")) is None
    assert watch.hand_over() == (monitor, {"n2"})  # the next leader acts on n2 only


def test_the_ping_timeout_is_half_a_lease_ttl_with_a_floor() -> None:
    """A live node has a TTL to refresh its lease; a ping asks for no less than half of it (a fixed
    0.3 s deposed a live leader on a loaded machine), within a floor and a ceiling (a deputy must
    still depose a dead leader long before a minute-long lease would)."""
    from oobleck_elastic.rendezvous.detect import PING_CEILING_S, PING_FLOOR_S, ping_timeout

    assert [ping_timeout(ttl) for ttl in (2.0, 5.0, 0.4, 60.0)] == [1.0, 2.5, PING_FLOOR_S, PING_CEILING_S]
