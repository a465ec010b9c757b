"""Leader election and plan publication.

Every agent runs a `Leader` thread. It campaigns by creating the `leader` key under its own
node lease (`put_if_not_exists`): exactly one agent holds it, and when that agent dies its lease
expires and another wins within the TTL plus one poll tick, or much sooner: the deputies (the
roster's first three other nodes) hold a liveness connection to the leader's agent and revoke
the lease the moment they find the agent gone (liveness.py), or one confirms by ping, once
workers saw the failure, that the leader is gone (detect.py). While leading, the leader holds a
liveness connection to every other agent of the plan and re-plans without a dead one at once;
it records the addresses that answered it (`liveness_answered`), and a new leader takes them as
answered (a refused connection there is a death), with the winning deputy's own connections.

The leader polls membership (node records) and, whenever the set of usable nodes differs from
the current plan's nodes for longer than the settle window (which batches simultaneous
failures and joins into one re-plan), computes the next plan with the planner (naming drained
nodes that ran a stage as the plan's donors: they hand their layers over in the next
generation's entry, then leave) and publishes it
as generation g+1 in one transaction that also checks that (a) the plan key is still at the
revision the leader read, and (b) the leader key still holds this leader's value. A deposed
or partitioned leader therefore can never overwrite a newer plan.

Before the first generation the leader waits until `min_nodes` are up, then a last-call window
for more (up to `max_nodes`). Nodes beyond `max_nodes` wait as spares and are admitted when a
member leaves. Below n0 (too few nodes for one replica) nothing is published: one log line and
a `waiting` event, and the plan follows as soon as enough nodes are back.

The first plan needs the profile, and the profile comes from the devices that train: a worker
measures it (`WorkerContext.share_profile`) and publishes it under `profiles/<device>`. So, unless
the profile is at hand already (`planning.profile_path`, or pinned in etcd), the leader first
*admits* the first nodes (`admitted/<node>`, the same key that lets a late node's agent start its
workers), their handlers return and their workers start and wait for a plan that gives them a
stage; once `profile_ready()` says a worker-measured profile is in etcd, the leader plans the
admitted nodes that are still up (and any admitted meanwhile, up to `max_nodes`) and publishes
generation 1. The wait costs nothing: the leader mirrors the profile keys (`Keys.leader_watched`),
asks the planner again only when they changed (the planner reads etcd), and otherwise sleeps until
a change or its next line. It logs one line about every 10 s; after `profile_timeout_s` without a profile
the job is closed as failed (`closed` with `failed`), with one error that says what to check.
With the profile at hand nothing changes: the first plan is published as soon as the nodes are
chosen, and their handlers return once it includes them. A planner error that no number of nodes
can cure (`JobUnplannable`: no device memory figure, a layer larger than a device) also closes
the job as failed, with that error, instead of waiting.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Callable, Mapping, Optional

from ..logs import JobLog
from ..etcd import EtcdClient, EtcdError
from ..etcd.client import KV, warn_once
from ..etcd.mirror import Mirror
from ..etcd.protocols import KVReader
from ..planning import Plan, PlanningError
from .decide import Action, Clocks, Decision, Detection, Detector, LeaderView, Rules, decide, plan_events
from .detect import LOST_BECAUSE, Deputy, LeaderWatch, RollCall
from ..records.keys import Keys
from .stragglers import LeaderStragglers
from .liveness import LivenessMonitor
from .membership import Member, live_nodes, put_event
from ..records.plans import PlanReader, RosterReader, newest_history_plan
from ..records.control import (
    Admission,
    AnsweredRecord,
    ClosedRecord,
    Event,
    EventKind,
    FenceRecord,
    LeaderRecord,
    NodeRecord,
    NodeState,
    Roster,
    is_fenced,
    read_admitted,
    read_closed,
    read_fences,
    read_ready,
    read_answered,
    readiness_withdrawn,
)

log = JobLog(logging.getLogger(__name__))

_FENCED_KEEP_S = 600.0
_TXN_EVENTS = 100  # events written in the plan's transaction at most (etcd allows 128 operations)
_IDLE_S = 1.0  # the leader's tick while nothing waits on the clock (a change wakes it at once)
Planner = Callable[[list[str], int, Optional[Plan]], Plan]  # (nodes, generation, previous plan)


class JobUnplannable(PlanningError):
    """No number of nodes can be planned with this config and profile (no device memory figure, a
    layer larger than a device): waiting for nodes cannot help, so the leader closes the job as
    failed with this error instead of waiting."""


class Leader:
    def __init__(
        self,
        client: EtcdClient,
        keys: Keys,
        member: Member,
        *,
        planner: Planner,
        min_nodes: int,
        max_nodes: int,
        last_call_s: float,
        settle_s: float,
        tick_s: float = 0.05,
        ping_timeout_s: float = 0.3,
        profile_ready: Callable[[], bool] | None = None,
        profile_timeout_s: float = 600.0,
        profile_log_s: float = 10.0,
        view: Optional[KVReader] = None,
        rebalance: bool = False,
    ) -> None:
        """`rebalance`: re-split the microbatches around stragglers the workers name (decide.py)."""
        self.client, self.keys, self.member = client, keys, member
        self.stragglers = LeaderStragglers(planner, enabled=rebalance)
        # what the leader reads: a Mirror of `Keys.agent_watched` (no etcd request per tick; a change
        # wakes the loop at once), or etcd itself when there is none (some tests)
        self.view: KVReader = view if view is not None else client
        self._version = 0
        self._plans = PlanReader(keys.plan)
        self._rosters = RosterReader(keys)
        self.planner = planner
        # whether the planner has its profile; before it has, the first nodes are admitted unplanned
        self.profile_ready: Callable[[], bool] = profile_ready or (lambda: True)
        self.profile_timeout_s, self.profile_log_s = profile_timeout_s, profile_log_s
        self._profile_wait: tuple[float, float] | None = None  # (since, next progress line), monotonic
        self._profile_known = False  # profile_ready() said yes (a profile never goes away once pinned)
        self._profile_seen: Optional[tuple[tuple[str, int], ...]] = None  # the profile keys when last asked
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.last_call_s, self.settle_s, self.tick_s = last_call_s, settle_s, tick_s
        self.is_leader = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._value = b""
        self._waiting_for: Optional[int] = None
        self._unplannable: Optional[tuple[tuple[str, ...], int]] = None
        self.liveness: Optional[LivenessMonitor] = None  # connections to the plan's agents while leading
        self._pending_dead: dict[str, float] = {}  # found dead by liveness -> when (monotonic)
        self._answered: Optional[tuple[int, dict[str, str]]] = None  # last written (generation, addresses)
        self._first_detect = True  # a new leader syncs its monitor before its first verdict
        self.rollcall = RollCall(client, keys, node_id=member.node_id, ping_timeout_s=ping_timeout_s, reader=self.view)
        self.deputy = Deputy(
            client,
            keys,
            node_id=member.node_id,
            ping_timeout_s=ping_timeout_s,
            reader=self.view,
            outage_grace_s=member.lease_ttl_s + settle_s,
        )
        self.leader_watch = LeaderWatch(client, keys, node_id=member.node_id, reader=self.view, on_dead=self._nudge)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="oobleck-leader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._nudge()  # an idle loop waits on its mirror: wake it to see the stop
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.leader_watch.close()

    # ------------------------------------------------------------------ election
    def _run(self) -> None:
        pause = self.tick_s * 4
        while not self._stop.is_set() and not self.member.fenced.is_set():
            try:
                if read_closed(self.view, self.keys) is not None:
                    pass  # the job is over: nothing to lead (agents leaving must not re-elect)
                elif self._campaign():
                    self._lead()
                else:
                    roster = self._rosters.read(self.view)
                    if self.leader_watch.check(roster) or self.deputy.check(roster):
                        continue  # the dead leader's lease is revoked: campaign at once
                    if self._idle():
                        pause = _IDLE_S
            except EtcdError as err:
                log.at(node=self.member.node_id).warning("leader loop: %s", err)
            except Exception:  # noqa: BLE001 - keep the agent alive; log the bug loudly
                log.at(node=self.member.node_id).exception("leader loop failed; retrying")
            self.is_leader.clear()
            self._pause(pause)
            pause = self.tick_s * 4

    def _idle(self) -> bool:
        """Whether this non-leader waits on nothing but news: someone leads (as its mirror shows)
        and its deputy is not timing a ping. Then only a change wakes it (a new leader key, a
        check-in, `closed`; a liveness verdict nudges the mirror), and 1,000 agents cost nothing
        between changes instead of waking 5 times a second each."""
        return isinstance(self.view, Mirror) and self.view.get(self.keys.leader) is not None and not self.deputy.pending

    def _nudge(self, _node: str = "") -> None:
        """Wake the loop now (a liveness verdict is news that does not come from etcd)."""
        if isinstance(self.view, Mirror):
            self.view.nudge()

    def _pause(self, timeout: float) -> None:
        """Wait `timeout`, or with a mirror until the next change it applies (whichever is first)."""
        if isinstance(self.view, Mirror):
            self._version = self.view.wait(self._version, timeout)
        else:
            self._stop.wait(timeout)

    def _caught_up(self, key: str, done: Callable[[Optional[KV]], bool]) -> None:
        """After a write: wait (briefly) until the mirror shows it, so the next tick does not act
        on the state before it."""
        if isinstance(self.view, Mirror):
            self.view.wait_for(lambda v: done(v.get(key)), timeout=2.0)

    def _campaign(self) -> bool:
        current = self.view.get(self.keys.leader)
        if current is not None and isinstance(self.view, Mirror):  # someone leads: no request needed
            self._clear_bogus_leader(current)
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
            self._value = value
            self._caught_up(self.keys.leader, lambda kv: kv is not None and kv.value == value)
            log.at(node=self.member.node_id).info("elected leader")
            put_event(
                self.client,
                self.keys,
                Event(time=time.time(), kind=EventKind.LEADER, node=self.member.node_id, detail="elected leader"),
            )
        else:
            self._clear_bogus_leader(self.view.get(self.keys.leader))
        return bool(won)

    def _clear_bogus_leader(self, kv: Optional[KV]) -> None:
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

    def _still_leader(self) -> bool:
        kv = self.view.get(self.keys.leader)
        return kv is not None and kv.value == self._value

    # ------------------------------------------------------------------ planning
    def _lead(self) -> None:
        """Mirror what the leader reads while it leads (`Keys.leader_watched`), and lead."""
        if isinstance(self.view, Mirror):
            self.view.add(self.keys.leader_watched())
        self.liveness = self._monitor_to_lead()
        try:
            self._lead_loop()
        finally:
            self.liveness.close()
            self.liveness = None
            self._pending_dead.clear()
            if isinstance(self.view, Mirror) and not self.view.error:
                self.view.remove(self.keys.leader_watched())

    def _monitor_to_lead(self) -> LivenessMonitor:
        """The deputy's liveness monitor when this agent was the deputy (its connections prove the
        deaths of nodes that died with the old leader: detect.py, `LeaderWatch`), else a new one."""
        monitor, dead = self.leader_watch.hand_over()
        name = f"leader {self.member.node_id}"
        if not isinstance(monitor, LivenessMonitor):
            if monitor is not None:
                monitor.close()
            monitor = LivenessMonitor(name=name, on_dead=self._nudge)
        monitor.name, monitor.on_dead = name, self._nudge
        now = time.monotonic()
        for node in dead:
            self._pending_dead.setdefault(node, now)
        answered = read_answered(self.client, self.keys)  # what the last leader reached
        if answered is not None:
            monitor.vouch(answered.addresses)
        self._answered, self._first_detect = None, True
        return monitor

    def _write_answered(self, plan: Plan, records: list[NodeRecord]) -> None:
        """Keep `liveness_answered` to the plan's addresses this leader's monitor reached (a
        few writes per generation: when the set grows), for the next leader (`_monitor_to_lead`)."""
        assert self.liveness is not None
        reached = self.liveness.answered() & set(plan.nodes)
        addresses = {r.node_id: r.liveness for r in records if r.node_id in reached and r.liveness}
        if not addresses or self._answered == (plan.generation, addresses):
            return
        self.client.put_json(self.keys.liveness_answered, AnsweredRecord(plan.generation, addresses).to_json())
        self._answered = (plan.generation, addresses)

    def _lead_loop(self) -> None:
        """The leader's loop: read what it sees into a `LeaderView` (the detectors run meanwhile),
        ask `decide` what to do, do it. decide.py holds every rule; this loop only does the I/O."""
        self.is_leader.set()
        clocks = Clocks()
        rules = Rules(
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            last_call_s=self.last_call_s,
            settle_s=self.settle_s,
            rebalance=self.stragglers.enabled,
        )
        while not self._stop.is_set() and self._still_leader():
            if read_closed(self.view, self.keys) is not None:
                self._pause(self.tick_s * 4)
                continue
            view, rev, records = self._read_view()
            decision = decide(view, clocks, time.monotonic(), rules)
            clocks = decision.clocks
            self._act(decision, view.plan, rev, records)
            if decision.action == Action.WAIT_FOR_NODES or self._profile_wait is not None:
                self._pause(_IDLE_S)  # below n0, or no profile yet: only a change can help
                continue
            if decision.recheck_s is not None:
                if decision.recheck_s > 0:
                    self._pause(decision.recheck_s)
                continue
            # with nothing pending on the clock, only a change can call for action: sleep until one
            # (before the first plan that is fewer than MIN nodes up: a node's arrival is a change too;
            # without a mirror, nothing wakes the loop but its tick)
            mirrored = isinstance(self.view, Mirror)
            waiting = decision.action != Action.NONE or (view.plan is None and not mirrored) or self.rollcall.open
            self._pause(self.tick_s if waiting else _IDLE_S)

    def _read_view(self) -> tuple[LeaderView, Optional[int], list[NodeRecord]]:
        """What the leader sees now (from its mirror), with the plan key's revision and the node
        records that the writes need."""
        records = live_nodes(self.view, self.keys)
        up = [r for r in records if r.state == NodeState.UP]
        plan, rev = self._plans.read(self.view)  # mirrored while leading (Keys.leader_watched)
        if plan is None and rev is not None:  # a value that is not a plan: generations go on from history
            plan = newest_history_plan(self.client, self.keys)
        view = LeaderView(
            up=tuple(r.node_id for r in up),
            plan=plan,
            fenced=frozenset(self._fenced(records)),
            admitted=frozenset(read_admitted(self.view, self.keys)),
            not_ready=frozenset(self._not_ready(plan, up)) if plan is not None else frozenset(),
            outage_recent=self.client.outage_within(self.member.lease_ttl_s + self.settle_s),
            dead=self._detect(plan, records) if plan is not None else None,
            refused=self._refused(plan),
            **self.stragglers.view_fields(self.view, self.keys, plan),
        )
        return view, rev, records

    def _refused(self, plan: Optional[Plan]) -> tuple[str, ...]:
        """The nodes the planner refused for the generation after `plan` (decide.py; no plan yet: the first)."""
        if self._unplannable is None or self._unplannable[1] != (plan.generation if plan is not None else 0) + 1:
            return ()
        return self._unplannable[0]

    def _detect(self, plan: Plan, records: list[NodeRecord]) -> Optional[Detection]:
        """Nodes of `plan` found dead since the last re-plan: by the liveness sockets (liveness.py:
        connections to the plan's other agents), or else by the roll call (detect.py). The roll
        call does not run while liveness deaths are pending: `decide` acts on those first, and the
        pings would be wasted."""
        assert self.liveness is not None
        me = self.member.node_id
        self.liveness.watch(
            {r.node_id: r.liveness for r in records if r.node_id in plan.nodes and r.node_id != me and r.liveness}
        )
        if self._first_detect:  # a new leader: the vouched addresses get their verdicts first
            self._first_detect = False
            self.liveness.sync()
        self._write_answered(plan, records)
        now = time.monotonic()
        for node in self.liveness.take_dead() & set(plan.nodes):
            self._pending_dead.setdefault(node, now)
        pending = {node: at for node, at in self._pending_dead.items() if node in plan.nodes}
        if pending:
            return Detection(Detector.LIVENESS, tuple(sorted(pending)), since=min(pending.values()))
        self._pending_dead.clear()
        dead = self.rollcall.check(plan, records)
        return Detection(Detector.ROLL_CALL, tuple(dead)) if dead is not None else None

    def _act(self, decision: Decision, plan: Optional[Plan], rev: Optional[int], records: list[NodeRecord]) -> None:
        """Do what `decide` said: admit nodes, say why a re-plan is held, declare nodes lost and
        publish the next plan (or the first one)."""
        if plan is not None:
            self._profile_wait = None
        for node in decision.admit:
            self.client.put_json(self.keys.admitted(node), Admission(time=time.time()).to_json())
        if decision.held:
            self._warn_held(decision.held, decision.detection, plan.generation if plan else 0)
        if decision.action == Action.FIRST_PLAN:
            self._first_plan(list(decision.nodes), rev, records)
        elif decision.action == Action.REBALANCE and plan is not None and decision.plan is not None:
            log.at(node=self.member.node_id).info(
                "re-splitting the microbatches of generation %d at the measured speeds (%s)",
                plan.generation,
                decision.why,
            )
            self._commit(decision.plan, plan, rev, records, {})
        elif decision.action == Action.REPLAN and decision.leave_out:
            self.stragglers.leave_out(
                self.client,
                self.keys,
                decision.leave_out,
                why=decision.why,
                generation=plan.generation + 1 if plan else 1,
                leader=self.member.node_id,
            )
            self._publish(list(decision.nodes), plan, rev, records)
        elif decision.action == Action.REPLAN:
            lost = {node: LOST_BECAUSE[decision.detection] for node in decision.lost if decision.detection}
            for node in lost:
                self._declare_lost(node, plan.generation if plan else 0)
            self._publish(list(decision.nodes), plan, rev, records, lost=lost)
            if decision.detection is not None:  # the verdict is acted on: the next one starts afresh
                self.rollcall.reset()
                self._pending_dead.clear()

    def _warn_held(self, held: tuple[str, ...], detection: Optional[Detector], generation: int) -> None:
        """One line per generation: a re-plan (or a roll call's verdict) waits out an etcd outage."""
        me, nodes = self.member.node_id, ", ".join(held)
        if detection == Detector.ROLL_CALL:
            # records vanish and pings go unanswered while etcd is away: the nodes renew their
            # leases and answer within a TTL of its return, so the verdict waits
            warn_once(
                self.keys.rollcall(generation),
                generation,
                f"node {me}: roll call of generation {generation}: {nodes} silent right after an etcd "
                "outage; asking again once the outage is a lease TTL past",
            )
        else:
            warn_once(
                self.keys.nodes,
                generation,
                f"node {me}: node(s) {nodes} missing right after an etcd outage: "
                "waiting a lease TTL for them to renew before re-planning",
            )

    def _first_plan(self, nodes: list[str], rev: int | None, records: list[NodeRecord]) -> None:
        """Publish generation 1 on `nodes` when the profile is at hand; otherwise admit them (their
        workers start and one of them measures the profile) and wait for it."""
        if self._has_profile():
            self._profile_wait = None
            self._publish(nodes, None, rev, records)
            return
        now = time.monotonic()
        if self._profile_wait is None:
            for node in nodes:
                if self.view.get_json(self.keys.admitted(node))[0] is None:
                    self.client.put_json(self.keys.admitted(node), Admission(time=time.time()).to_json())
            self._profile_wait = (now, now + self.profile_log_s)
            detail = (
                f"admitted {len(nodes)} node(s) ({', '.join(nodes)}); their workers start, and one per device "
                "kind measures the profile the first plan needs"
            )
            log.at(node=self.member.node_id).info("%s", detail)
            put_event(
                self.client,
                self.keys,
                Event(time=time.time(), kind=EventKind.WAITING, node=self.member.node_id, generation=1, detail=detail),
            )
            return
        since, next_line = self._profile_wait
        if now - since >= self.profile_timeout_s:
            self._fail(
                f"no worker published a profile of its device within {self.profile_timeout_s:.0f}s "
                f"(fault_tolerance.rendezvous_timeout_s) after {len(nodes)} node(s) were admitted, so "
                "no plan can be made: check the workers' logs for an error while profiling (each worker "
                "calls WorkerContext.share_profile before it reports ready), or set planning.profile_path "
                "to a profile file"
            )
        elif now >= next_line:
            self._profile_wait = (since, now + self.profile_log_s)
            log.at(node=self.member.node_id).info(
                "still waiting for a worker-measured profile (%.0fs of %.0fs; %d node(s) admitted)",
                now - since,
                self.profile_timeout_s,
                len(nodes),
            )

    def _has_profile(self) -> bool:
        """Whether the planner has its profile: asked (`profile_ready`, which reads etcd) only when
        the mirrored profile keys changed since it last said no, so a leader waiting for a worker
        to measure the profile sends etcd nothing; without a mirror, asked every time."""
        if self._profile_known:
            return True
        if isinstance(self.view, Mirror):
            seen = tuple((kv.key, kv.mod_revision) for kv in self.view.range(self.keys.profiles))
            pinned = self.view.get(self.keys.profile)
            seen += ((pinned.key, pinned.mod_revision),) if pinned is not None else ()
            if seen == self._profile_seen:
                return False
            self._profile_seen = seen
        self._profile_known = self.profile_ready()
        return self._profile_known

    def _fail(self, reason: str) -> None:
        """Close the job as failed: workers and agents leave with this error (no plan can follow)."""
        log.at(node=self.member.node_id).error("%s", reason)
        self.client.put_json(self.keys.closed, ClosedRecord(time=time.time(), reason=reason, failed=True).to_json())
        put_event(
            self.client,
            self.keys,
            Event(time=time.time(), kind=EventKind.CLOSED, node=self.member.node_id, detail=reason),
        )
        self._profile_wait = None

    def _fenced(self, records: list[NodeRecord]) -> set[str]:
        """Nodes declared lost (by a roll call, or dropped when their record vanished). An entry is
        dropped once the node's record is gone and it is older than `_FENCED_KEEP_S` (a node cut
        off from etcd must still find it when it comes back)."""
        live = {r.node_id for r in records}
        fenced = set()
        for node, rec in read_fences(self.view, self.keys):
            if node in live:
                fenced.add(node)
            elif rec is None or time.time() - rec.time > _FENCED_KEEP_S:
                self.client.delete(self.keys.fence(node))
        return fenced

    def _declare_lost(self, node: str, generation: int) -> None:
        """`fenced/<node>`: excluded from plans; its workers stop, and its agent fences itself if it
        comes back (membership.py)."""
        self.client.put_json(self.keys.fence(node), FenceRecord(time=time.time(), generation=generation).to_json())

    def _not_ready(self, plan: Plan, up: list[NodeRecord]) -> set[str]:
        """New nodes whose workers have not all said they are ready: a plan with them would make
        every worker wait in init_process_group while theirs are still importing torch; and nodes
        of the plan whose agent withdrew a worker's readiness (it restarts a hung worker,
        rendezvous/hang.py), which rejoin once it is ready again; and stragglers this leader left out
        (decide.py), which stay out."""
        waiting = set(self.stragglers.left_out)
        for rec in up:
            entries = read_ready(self.view, self.keys, rec.node_id)
            if readiness_withdrawn(entries) or (rec.node_id not in plan.nodes and len(entries) < rec.devices):
                waiting.add(rec.node_id)
        return waiting

    def _publish(
        self,
        nodes: list[str],
        old: Optional[Plan],
        rev: Optional[int],
        records: list[NodeRecord],
        lost: Optional[Mapping[str, str]] = None,
    ) -> None:
        """Plan generation g+1 on `nodes` and publish it (`lost`: the nodes found dead, and how)."""
        lost = lost or {}
        generation = (old.generation if old else 0) + 1
        if self._unplannable == (tuple(nodes), generation):
            return  # the planner already refused exactly this; do not burn CPU on it every tick
        try:
            plan = self.planner(nodes, generation, old)
        except JobUnplannable as err:
            self._fail(f"cannot plan this job with any number of nodes: {err}")
            return
        except PlanningError as err:
            self._unplannable = (tuple(nodes), generation)
            if self._waiting_for != len(nodes):
                self._waiting_for = len(nodes)
                log.at(node=self.member.node_id).warning(
                    "cannot plan generation %d with %d node(s): %s", generation, len(nodes), err
                )
                put_event(
                    self.client,
                    self.keys,
                    Event(
                        time=time.time(),
                        kind=EventKind.WAITING,
                        node=self.member.node_id,
                        generation=generation,
                        detail=str(err),
                    ),
                )
            return
        self._waiting_for = None
        self._commit(dataclasses.replace(plan, donors=self._donors(plan, old, records, lost)), old, rev, records, lost)

    def _commit(
        self, plan: Plan, old: Optional[Plan], rev: Optional[int], records: list[NodeRecord], lost: Mapping[str, str]
    ) -> None:
        """Publish `plan` as the next generation, with its events, in one transaction that holds
        only while the plan key is at `rev` and this agent leads."""
        generation = plan.generation
        events = plan_events(
            plan, old, {r.node_id: r.state for r in records}, lost, leader=self.member.node_id, now=time.time()
        )
        live = {r.node_id for r in records}
        # a node dropped because its record vanished is fenced first: if it was only cut off from
        # etcd, it learns from this, when it comes back, that the job moved on without it
        # (membership.py); a plan that loses the race below leaves a harmless entry behind
        for ev in events:
            if ev.kind == EventKind.LOST and ev.node not in live:
                self._declare_lost(ev.node, generation)
        blob = json.dumps(plan.to_json(), sort_keys=True)
        # the plan, its history entry and its events in one transaction, within etcd's limit on
        # operations per transaction (--max-txn-ops, 128 by default): beyond it, per-node events follow
        later, inline = (events[:-1], events[-1:]) if len(events) > _TXN_EVENTS else ([], events)
        puts = {
            self.keys.plan: blob,
            self.keys.plan_at(generation): blob,
            self.keys.roster: json.dumps(Roster(generation, plan.nodes).to_json()),
        }
        puts.update((self.keys.event(ev.node), json.dumps(ev.to_json())) for ev in inline)
        ok = self.client.transact(values={self.keys.leader: self._value}, revisions={self.keys.plan: rev}, puts=puts)
        if ok:
            for ev in later:
                put_event(self.client, self.keys, ev)
            self._caught_up(self.keys.plan, lambda kv: kv is not None and kv.mod_revision != rev)
            log.at(node=self.member.node_id).info("published generation %d: %s", generation, events[-1].detail)
        else:
            log.at(node=self.member.node_id).info(
                "plan generation %d lost a race (plan or leadership changed)", generation
            )

    def _donors(
        self, plan: Plan, old: Optional[Plan], records: list[NodeRecord], lost: Mapping[str, str]
    ) -> tuple[str, ...]:
        """Nodes of `old` that ran a stage, are draining now and leave with `plan`: they join its
        entry to hand their layers over, then leave. Only from the generation just left (a donor
        whose entry failed leaves anyway: its layers then come from others or the checkpoint)."""
        if old is None:
            return ()
        draining = {r.node_id for r in records if r.state == NodeState.DRAINING}
        staged = {s.node for p in old.pipelines for s in p.stages}
        return tuple(
            n
            for n in old.nodes
            if n in draining
            and n in staged
            and n not in plan.nodes
            and n not in lost
            and not is_fenced(self.view, self.keys, n)
        )
