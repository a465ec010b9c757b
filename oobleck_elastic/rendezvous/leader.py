"""The agent's leader loop: campaign (`rendezvous.election`), detect, decide, publish.

Invariant: at most one leader publishes at a time (the `leader` key under its lease), and a
deposed leader can never overwrite a newer plan. The story: docs/recovery.md.
"""

from __future__ import annotations

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
from .decide import LeaderAction, Clocks, Decision, Detection, Detector, LeaderView, Rules, decide
from .decide import closes_on_stop, shortfall_line, strict_refusal
from .drills import install_spin_drill
from .election import Election, caught_up
from .detect import Deputy, LeaderLiveness, LeaderWatch, RollCall, ping_timeout, why_lost
from .profile_wait import ProfileWait
from .failing import close_failed, restarts_exhausted
from .publish import SourceChoice, commit_plan, declare_lost, with_donors
from ..records.keys import Keys
from .stop import close_if_stopped, stop_when_drained
from .stragglers import LeaderStragglers
from .membership import Member, goodbye_of, live_nodes, put_event
from ..records.plans import PlanReader, RosterReader, newest_history_plan
from ..records.control import Admission, NodeRecord, NodeState
from ..records.job import Event, EventKind
from ..records.read import (
    is_fenced,
    read_admitted,
    read_closed,
    read_fences,
    read_progress,
    read_ready,
    readiness_withdrawn,
)

log = JobLog(logging.getLogger(__name__))

_FENCED_KEEP_S = 600.0
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
        ping_timeout_s: Optional[float] = None,
        profile_ready: Callable[[], bool] | None = None,
        profile_timeout_s: float = 600.0,
        profile_log_s: float = 10.0,
        view: Optional[KVReader] = None,
        rebalance: bool = False,
        max_restarts: int = 5,
        strict: bool = False,
    ) -> None:
        """`rebalance`: re-split the microbatches around stragglers the workers name (`rendezvous.decide`);
        `max_restarts`: restarts in a row without progress before the job fails (`rendezvous.restart_loop`);
        `strict`: a first plan that gives less than the config asks fails the job (`strict_refusal`);
        `ping_timeout_s`: the roll call's wait for a pong (None: `ping_timeout` of the member's lease TTL)."""
        if ping_timeout_s is None:
            ping_timeout_s = ping_timeout(member.lease_ttl_s)
        self.max_restarts, self.strict = max_restarts, strict
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
        self.profiles = ProfileWait(
            client,
            keys,
            self.view,
            node_id=member.node_id,
            profile_ready=profile_ready or (lambda: True),
            timeout_s=profile_timeout_s,
            log_s=profile_log_s,
        )
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.last_call_s, self.settle_s, self.tick_s = last_call_s, settle_s, tick_s
        self.is_leader = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._waiting_for: Optional[int] = None
        self._unplannable: Optional[tuple[tuple[str, ...], int]] = None
        self._hold: Optional[tuple[int, float]] = None  # (generation, since): a re-plan awaits a return
        self.liveness: Optional[LeaderLiveness] = None  # connections to the plan's agents while leading
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
        self.election = Election(client, keys, member, self.view)

    def start(self) -> None:
        install_spin_drill()
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
                elif self.election.campaign():
                    self._lead()
                elif self.member.lease_fresh():  # a stalled deputy's ping timing is no verdict
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
        check-in, `closed`; a liveness verdict nudges the mirror): 1,000 idle agents cost nothing."""
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
        caught_up(self.view, key, done)

    # ------------------------------------------------------------------ planning
    def _lead(self) -> None:
        """Mirror what the leader reads while it leads (`Keys.leader_watched`), and lead."""
        if isinstance(self.view, Mirror):
            self.view.add(self.keys.leader_watched())
        self.liveness = LeaderLiveness(
            self.client, self.keys, node_id=self.member.node_id, watch=self.leader_watch, on_dead=self._nudge
        )
        try:
            self._lead_loop()
        finally:
            self.liveness.close()
            self.liveness = None
            if isinstance(self.view, Mirror) and not self.view.error:
                self.view.remove(self.keys.leader_watched())

    def _lead_loop(self) -> None:
        """The leader's loop: read what it sees into a `LeaderView` (the detectors run meanwhile),
        ask `decide` what to do, do it. `rendezvous.decide` holds every rule; this loop only does the I/O."""
        self.is_leader.set()
        clocks = Clocks()
        rules = Rules(
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            last_call_s=self.last_call_s,
            settle_s=self.settle_s,
            rebalance=self.stragglers.enabled,
        )
        while not self._stop.is_set() and not self.member.fenced.is_set() and self.election.held():
            if read_closed(self.view, self.keys) is not None:
                self._pause(self.tick_s * 4)
                continue
            if not self._lease_confirmed():
                self._pause(self.tick_s)
                continue
            view, rev, records = self._read_view()
            decision = decide(view, clocks, time.monotonic(), rules)
            clocks = decision.clocks
            if not self._lease_confirmed():
                continue
            self._act(decision, view.plan, rev, records)
            if closes_on_stop(view, decision):  # no worker steps to stop at a boundary
                close_if_stopped(self.client, self.view, self.keys, node=self.member.node_id, plan=view.plan)
            if decision.action in (LeaderAction.WAIT_FOR_NODES, LeaderAction.STOP) or self.profiles.waiting:
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
            waiting = decision.action != LeaderAction.NONE or (view.plan is None and not mirrored) or self.rollcall.open
            self._pause(self.tick_s if waiting else _IDLE_S)

    def _lease_confirmed(self) -> bool:
        """Whether this leader may act (`Member.lease_fresh`): after a stall of a TTL another agent
        may lead and what this one saw is stale, so it acts on nothing (no ping, admission, fence or
        plan) until its keep-alive finds the lease alive (it leads on) or fences the node."""
        fresh = self.member.lease_fresh()
        if fresh != self.is_leader.is_set():
            if fresh:
                self.is_leader.set()
                log.at(node=self.member.node_id).info("lease refreshed: leading again")
            else:
                self.is_leader.clear()
                stalled = time.monotonic() - self.member.refreshed_at
                log.at(node=self.member.node_id).warning("no lease refresh for %.1fs: not leading", stalled)
        return fresh

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
            draining=tuple(r.node_id for r in records if r.state == NodeState.DRAINING),
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
        """The nodes the planner refused for the generation after `plan` (`decide`; no plan yet: the first)."""
        if self._unplannable is None or self._unplannable[1] != (plan.generation if plan is not None else 0) + 1:
            return ()
        return self._unplannable[0]

    def _detect(self, plan: Plan, records: list[NodeRecord]) -> Optional[Detection]:
        """Nodes of `plan` found dead since the last re-plan: by the liveness sockets (`rendezvous.liveness`:
        connections to the plan's other agents), or else by the roll call (`rendezvous.detect`). The roll
        call does not run while liveness deaths are pending: `decide` acts on those first, and the
        pings would be wasted."""
        assert self.liveness is not None
        pending = self.liveness.found_dead(plan, records)
        if pending:
            return Detection(Detector.LIVENESS, tuple(sorted(pending)), since=min(pending.values()))
        dead = self.rollcall.check(plan, records)
        return Detection(Detector.ROLL_CALL, tuple(dead)) if dead is not None else None

    def _act(self, decision: Decision, plan: Optional[Plan], rev: Optional[int], records: list[NodeRecord]) -> None:
        """Do what `decide` said: admit nodes, say why a re-plan is held, declare nodes lost and
        publish the next plan (or the first one)."""
        if plan is not None:
            self.profiles.reset()
        for node in decision.admit:
            self.client.put_json(self.keys.admitted(node), Admission(time=time.time()).to_json())
        if decision.held:
            self._warn_held(decision.held, decision.detection, plan.generation if plan else 0)
        if decision.action == LeaderAction.STOP:
            stop_when_drained(self.client, self.view, self.keys, node=self.member.node_id, plan=plan)
        elif decision.action == LeaderAction.FIRST_PLAN:
            self._first_plan(list(decision.nodes), rev, records)
        elif decision.action == LeaderAction.REBALANCE and plan is not None and decision.plan is not None:
            log.at(node=self.member.node_id).info(
                "re-splitting the microbatches of generation %d at the measured speeds (%s)",
                plan.generation,
                decision.why,
            )
            self._commit(decision.plan, plan, rev, records, {})
        elif decision.action == LeaderAction.REPLAN and decision.leave_out:
            self.stragglers.leave_out(
                self.client,
                self.keys,
                decision.leave_out,
                why=decision.why,
                generation=plan.generation + 1 if plan else 1,
                leader=self.member.node_id,
            )
            self._publish(list(decision.nodes), plan, rev, records)
        elif decision.action == LeaderAction.REPLAN:
            if plan is not None and not decision.lost and self._restarts_exhausted(plan, decision.nodes):
                return
            lost = {
                node: why_lost(decision.detection, node, self.liveness, self.rollcall)
                for node in decision.lost
                if decision.detection
            }
            for node in lost:
                declare_lost(self.client, self.keys, node, plan.generation if plan else 0)
            self._publish(list(decision.nodes), plan, rev, records, lost=lost)
            if decision.detection is not None:  # the verdict is acted on: the next one starts afresh
                self.rollcall.reset()
                if self.liveness is not None:
                    self.liveness.acted()

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
        workers start and one of them measures the profile) and wait for it (`rendezvous.profile_wait`)."""
        if self.profiles.has_profile():
            self.profiles.reset()
            self._publish(nodes, None, rev, records)
            return
        failed = self.profiles.wait(nodes)
        if failed is not None:
            self._fail(failed)

    def _fail(self, reason: str, *, known_error: bool = False) -> None:
        """Close the job as failed (`rendezvous.failing`); no profile is awaited any more."""
        close_failed(self.client, self.keys, self.member.node_id, reason, known_error=known_error)
        self.profiles.reset()

    def _restarts_exhausted(self, plan: Plan, nodes: tuple[str, ...]) -> bool:
        """Whether a restart on `nodes` after `plan` is one too many without progress
        (`rendezvous.failing`): then the job is closed as failed, its last error stored."""
        reason = restarts_exhausted(self.client, self.keys, plan, nodes, self.max_restarts)
        if reason is not None:
            self._fail(reason)
        return reason is not None

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

    def _not_ready(self, plan: Plan, up: list[NodeRecord]) -> set[str]:
        """New nodes whose workers have not all said they are ready: a plan with them would make
        every worker wait in init_process_group while theirs are still importing torch; and nodes
        of the plan whose agent withdrew a worker's readiness (it restarts a hung worker,
        `rendezvous.hang`), which rejoin once it is ready again; and stragglers this leader left out
        (`rendezvous.decide`), which stay out."""
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
            self._fail(f"cannot plan this job with any number of nodes: {err}", known_error=True)
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
        refused = strict_refusal(plan, first=old is None, strict=self.strict)
        if refused is not None:
            self._fail(refused, known_error=True)
            return
        progress = read_progress(self.client, self.keys) if old is not None else None
        stepped = progress is not None and old is not None and progress.generation >= old.generation
        plan, choice = with_donors(plan, old, records, lost, lambda n: is_fenced(self.view, self.keys, n), stepped)
        if old is not None and choice is not None and choice.awaited and self._awaiting(old.generation, choice):
            return  # a false death loses nothing: wait for the node to come back (docs/recovery.md)
        self._commit(plan, old, rev, records, lost)

    def _awaiting(self, generation: int, choice: SourceChoice) -> bool:
        """Whether the re-plan after `generation` still waits for `choice.awaited` (a TTL + settle at most)."""
        now, bound = time.monotonic(), self.member.lease_ttl_s + self.settle_s
        left = all(goodbye_of(self.client, self.keys, n) is not None for n in choice.awaited)  # nothing comes back
        if not left and (self._hold is None or self._hold[0] != generation):
            self._hold = (generation, now)
            log.at(node=self.member.node_id).warning("%s: waiting up to %.1f s", choice.describe_wait(), bound)
        return not left and self._hold is not None and now - self._hold[1] < bound

    def _commit(
        self, plan: Plan, old: Optional[Plan], rev: Optional[int], records: list[NodeRecord], lost: Mapping[str, str]
    ) -> None:
        """Publish `plan` as the next generation, with its events (`rendezvous.publish`), if the plan key is
        still at `rev` and this agent leads."""
        events = commit_plan(
            self.client,
            self.keys,
            plan,
            old,
            records,
            lost,
            leader=self.member.node_id,
            leader_value=self.election.value,
            rev=rev,
        )
        if events is not None:
            self._caught_up(self.keys.plan, lambda kv: kv is not None and kv.mod_revision != rev)
            log.at(node=self.member.node_id).info("published generation %d: %s", plan.generation, events[-1].detail)
            short = shortfall_line(plan)
            if short is not None:
                log.at(node=self.member.node_id).warning("%s", short)
        else:
            log.at(node=self.member.node_id).info(
                "plan generation %d lost a race (plan or leadership changed)", plan.generation
            )
