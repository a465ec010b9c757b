"""What a worker process sees of the control plane.

`WorkerContext.from_env()` reconnects to etcd from the agent's environment; the worker reads
plans (never RANK/WORLD_SIZE) from a watch-maintained mirror, so between generations it needs
etcd for nothing. The story: docs/design.md.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch.distributed as dist

from ..config.timing import comm_timeout, stall_report
from ..etcd import EtcdClient, EtcdSettings, connect
from ..etcd.client import warn_once
from ..etcd.mirror import Mirror
from ..etcd.protocols import KVReader
from ..etcd.store import EtcdStore
from ..logs import JobLog
from ..planning import PipelineSpec, Plan, StagePlacement
from ..records.board import claim_board
from ..records.control import Checkin, CheckinKind, NodeRecord, NodeState, ProfileClaim, ReadyRecord, StragglerRecord
from ..records.job import ClosedRecord, Event, EventKind, ProgressRecord
from ..records.errors import ErrorRecord, next_error_record
from ..records.goodput import Ledger, Origin, job_origin
from ..records.keys import Keys
from ..records.plans import PlanReader, parse_plan
from ..records.read import (
    is_fenced,
    read_closed,
    read_profile_claim,
    read_progress,
    read_ready,
    read_stop,
    readiness_withdrawn,
)
from .latest_put import LatestPut
from .membership import put_event, read_events
from .preempt import guard_worker

if TYPE_CHECKING:
    import torch

    from ..config import JobConfig

log = JobLog(logging.getLogger(__name__))


def under_oobleck(environ: Optional[dict[str, str]] = None) -> bool:
    """Whether this process is a worker started by torchrun with the oobleck rendezvous backend
    (the handler put the run id and the etcd settings in its environment)."""
    env = os.environ if environ is None else environ
    return all(k in env for k in ("OOBLECK_RUN_ID", "OOBLECK_ETCD_ENDPOINT", "TORCHELASTIC_RUN_ID"))


class GenerationSuperseded(dist.DistStoreError):
    """A newer plan was published while this worker was joining a generation (a store error, so
    the engine treats it as a communication failure and moves on to the newer generation)."""


@dataclass
class WorkerContext:
    client: EtcdClient
    """Connected etcd client."""
    keys: Keys
    """Key layout of the run."""
    node_id: str
    """This worker's node."""
    local_rank: int
    """Device index on the node."""
    newest: Optional[Plan] = None
    """The newest plan seen: generations only grow, so an older one read later is refused."""
    view: Optional[Mirror] = None
    """The mirror of the keys this worker reads between steps (`watched`); None: read etcd directly."""
    _progress: Optional[LatestPut] = None
    _plans: Optional[PlanReader] = None
    _stalled: set[int] = field(default_factory=set)  # generations this worker checked in as stalled
    _news: int = 0  # the mirror's version when `wait_for_news` last returned
    owns_client: bool = False
    """`close()` closes the client too (it was made for this worker by `from_env`)."""

    @property
    def is_job_worker(self) -> bool:
        """A job's worker process (`ControlPlane.is_job_worker`)."""
        return True

    @classmethod
    def from_env(cls, environ: Optional[dict[str, str]] = None) -> "WorkerContext":
        env = dict(os.environ if environ is None else environ)
        settings = EtcdSettings.from_env(env)
        ctx = cls(
            client=connect(settings),
            keys=Keys(env.get("OOBLECK_KEY_PREFIX", "/oobleck"), env["OOBLECK_RUN_ID"]),
            node_id=env["OOBLECK_NODE_ID"],
            local_rank=int(env.get("LOCAL_RANK", "0")),
            owns_client=True,
        )
        ctx.watch()
        guard_worker(env)  # a preemption notice that reaches this worker too drains its node, not kills it
        return ctx

    def watch(self) -> "WorkerContext":
        """Read the keys of `watched()` from a mirror from now on."""
        if self.view is None:
            self.view = Mirror(self.client, self.watched(), name=f"worker {self.node_id}/{self.local_rank}").start()
        return self

    def watched(self) -> list[str]:
        """The keys (prefixes) a worker reads between steps."""
        return [
            self.keys.plan,
            self.keys.closed,
            self.keys.stop,
            self.keys.fence(self.node_id),
            self.keys.node(self.node_id),
        ]

    @property
    def reader(self) -> KVReader:
        """Where reads go: the mirror, or etcd when there is none."""
        return self.view if self.view is not None else self.client

    def close(self) -> None:
        """Flush the last progress report, stop watching and close the connection (if its own)."""
        if self._progress is not None:
            self._progress.flush(timeout=5.0)
        if self.view is not None:
            self.view.close()
        if self.owns_client:
            self.client.close()

    def plan(self) -> Optional[Plan]:
        """The current plan; None while there is none or the value is malformed (logged once). A
        plan older than one already seen is refused (logged once) and the newer one kept."""
        if self._plans is None:
            self._plans = PlanReader(self.keys.plan)
        plan, rev = self._plans.read(self.reader)
        if plan is not None and self.newest is not None and plan.generation < self.newest.generation:
            warn_once(
                self.keys.plan,
                rev,
                f"ignoring plan of generation {plan.generation} in {self.keys.plan}: "
                f"generation {self.newest.generation} was already seen",
            )
            return self.newest
        if plan is not None:
            self.newest = plan
        return plan

    def wait_for_news(self, timeout: float) -> None:
        """Sleep until the mirror applied a change since the last call (the plan, `closed`, this
        node's record or fence: what `plan`, `plan_at` and `should_leave` read; a plan's history
        entry is written with the plan), or `timeout` seconds at most. Without a mirror: `timeout`."""
        if self.view is None:
            time.sleep(timeout)
        else:
            self._news = self.view.wait(self._news, timeout)

    def plan_at(self, generation: int) -> Optional[Plan]:
        """The plan of a past or current generation (from the leader's history)."""
        data, _ = self.client.get_json(self.keys.plan_at(generation))  # at entry only: not mirrored
        return parse_plan(data)

    def my_stage(self, plan: Plan) -> Optional[tuple[PipelineSpec, StagePlacement]]:
        """This worker's pipeline and stage in `plan`, or None (a spare, not in the plan, or its
        node fenced: a fenced node never trains again, it may only hand its layers over)."""
        stage = plan.stage_at(self.node_id, self.local_rank)
        if stage is not None and is_fenced(self.reader, self.keys, self.node_id):
            return None
        return plan.stage_of(stage.rank) if stage is not None else None

    def record(self) -> Optional[NodeRecord]:
        data, _ = self.reader.get_json(self.keys.node(self.node_id))
        return NodeRecord.parse(data, key=self.keys.node(self.node_id)) if data is not None else None

    def should_leave(self, plan: Optional[Plan]) -> Optional[str]:
        """Why this worker must exit 0 now, or None: the job is closed, or the node was drained."""
        if read_closed(self.reader, self.keys) is not None:
            return "the job is closed"
        if is_fenced(self.reader, self.keys, self.node_id) and not self._may_return(plan):
            return f"node {self.node_id} was fenced (declared lost): it must not train on alone"
        if plan is not None and self.node_id not in plan.nodes:
            rec = self.record()
            if rec is None:
                return f"node {self.node_id} lost its lease (it was unreachable for longer than the TTL)"
            if rec.state == NodeState.DRAINING:
                return f"node {self.node_id} was drained"
        return None

    def _may_return(self, plan: Optional[Plan]) -> bool:
        """This fenced node's agent lives (its record is live: it came back `returned`, or may yet,
        rendezvous/membership.py) and the newest plan `plan` has not moved on without it: its
        workers keep their layers for a plan that may name them donors (docs/recovery.md, "A
        false death loses nothing"). None: only whether the record is live."""
        rec = self.record()
        if rec is None or rec.state == NodeState.DRAINING:
            return False
        return plan is None or self.node_id in plan.nodes or plan.donor_rank(self.node_id, self.local_rank) is not None

    def share_profile(self, cfg: JobConfig, device: torch.device) -> None:
        """Measure the profile of this worker's device kind and publish it for the leader, when
        nobody has yet and this worker wins the claim; otherwise return at once (see the module
        docstring). A failed measurement gives the claim back (a restarted worker tries again)
        and raises."""
        if cfg.planning.profile_path:
            return  # the leader plans from that file
        import torch

        from ..planning import ModelProfile, ProfileError
        from ..planning.profile import cache as profile_cache

        device = torch.device(device)

        def valid(key: str) -> bool:
            data, _ = self.client.get_json(key)
            if data is None:
                return False
            try:
                ModelProfile.from_json(data, source=key)
                return True
            except ProfileError as err:
                log.warning("ignoring profile in etcd key %s: %s", key, err)
                return False

        label = profile_cache.device_label(device)
        key, claim = self.keys.device_profile(label), self.keys.profile_claim(label)
        if valid(self.keys.profile) or valid(key):
            return
        mine = ProfileClaim(node=self.node_id, local_rank=self.local_rank, pid=os.getpid(), time=time.time())
        rec = self.record()
        lease = rec.lease_id if rec is not None else None  # the claim vanishes with this node
        if not self.client.put_if_absent(claim, json.dumps(mine.to_json(), sort_keys=True), lease=lease):
            holder = read_profile_claim(self.client, self.keys, label)
            if holder is None or (holder.node, holder.local_rank) != (self.node_id, self.local_rank):
                return  # another worker measures this device kind (or a malformed claim holds it)
            self.client.put_json(claim, mine.to_json(), lease=lease)  # this worker's earlier run held it: take over
        log.at(node=self.node_id, rank=self.local_rank).info("measuring the profile of %s for the planner", label)
        try:
            profile = profile_cache.load_or_profile(cfg, device=device, log=log.info)
            self.client.put(key, json.dumps(profile.to_json()))
        except BaseException:
            try:
                self.client.delete(claim)
            except Exception as err:  # noqa: BLE001 - the error that matters is the one re-raised
                log.warning("could not give back the profile claim %s: %s", claim, err)
            raise
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the profiled layers' memory goes back to training
        log.at(node=self.node_id, rank=self.local_rank).info(
            "published the profile of %s (%d layers%s)",
            label,
            profile.num_layers,
            f", {profile.device_memory_bytes / 1024**3:.1f} GiB device memory" if profile.device_memory_bytes else "",
        )

    def report_ready(self) -> None:
        """This worker has imported everything and loaded its data: it can join a generation."""
        self.client.put_json(
            self.keys.ready_worker(self.node_id, self.local_rank),
            ReadyRecord(time=time.time(), pid=os.getpid()).to_json(),
        )

    def report_failure(self, generation: int, *, kind: str = CheckinKind.FAILURE) -> None:
        """Check in at the leader's roll call: this worker saw generation `generation` break
        (`failure`), or has waited too long for its peers while joining it (`stall`)."""
        self.client.put_json(
            self.keys.checkin(generation, self.node_id, self.local_rank),
            Checkin(time=time.time(), kind=CheckinKind(kind)).to_json(),
        )
        if kind == CheckinKind.STALL:
            self._stalled.add(generation)

    def record_skip(self, *, generation: int, step: int, detail: str) -> None:
        """An event saying the step guard did not apply `step` (`engine.resilience.guard`)."""
        put_event(
            self.client,
            self.keys,
            Event(
                time=time.time(),
                kind=EventKind.SKIP,
                node=self.node_id,
                generation=generation,
                detail=f"step {step}: {detail}",
            ),
        )

    def report_stragglers(
        self, *, generation: int, step: int, nodes: dict[str, float], pipeline_s: Sequence[float]
    ) -> None:
        """The `stragglers` record the leader re-splits the batch from (`engine.resilience.straggler`)."""
        self.client.put_json(
            self.keys.stragglers,
            StragglerRecord(
                generation=generation, step=step, time=time.time(), nodes=dict(nodes), pipeline_s=tuple(pipeline_s)
            ).to_json(),
        )

    def record_event(self, *, kind: str, generation: int, detail: str) -> None:
        """An event about this job from this worker's node (`engine.control`)."""
        put_event(
            self.client,
            self.keys,
            Event(time=time.time(), kind=EventKind(kind), node=self.node_id, generation=generation, detail=detail),
        )

    def entered(self, generation: int) -> None:
        """This worker has entered `generation`: a `stall` check-in it made while joining is
        withdrawn (the join was only slow), so the roll call does not go on pinging for it."""
        if generation in self._stalled:
            self._stalled.discard(generation)
            self.client.delete(self.keys.checkin(generation, self.node_id, self.local_rank))

    def join_watch(self, generation: int, *, stall_s: float) -> Callable[[float], None]:
        """The `EtcdStore.on_wait` hook of a worker joining `generation`: it gives up (raises)
        once a newer plan is published, and checks in at the roll call as stalled after
        `stall_s` so that the leader finds a peer that died during the reconfiguration."""
        reported = False

        def hook(waited: float) -> None:
            nonlocal reported
            latest = self.plan()
            if latest is not None and latest.generation > generation:
                raise GenerationSuperseded(
                    f"generation {generation} was superseded by generation {latest.generation} while joining it"
                )
            if stall_s > 0 and waited >= stall_s and not reported:
                self.report_failure(generation, kind=CheckinKind.STALL)
                reported = True

        return hook

    def report_progress(self, *, generation: int, step: int, **extra: Any) -> None:
        """Write the job's progress from a background thread (the newest value wins): the step loop
        never waits for etcd."""
        if self._progress is None:
            self._progress = LatestPut(self.client)
        self._progress.put(
            self.keys.progress,
            {"generation": generation, "step": step, "time": time.time(), "node": self.node_id, **extra},
        )

    def goodput_origin(self) -> Origin:
        """The goodput ledger last reported with progress, or (none yet) the job's start and first
        plan from its events (`engine.telemetry.goodput`). Read from etcd, at entry only."""
        data, revision = self.client.get_json(self.keys.progress)
        if isinstance(data, dict) and data.get("goodput") is not None:
            try:
                return Origin(reported=Ledger.from_json(data["goodput"]))
            except ValueError as err:
                warn_once(self.keys.progress, revision, f"ignoring the goodput ledger in {self.keys.progress}: {err}")
        start, first_plan = job_origin((e.time, e.kind, e.generation) for _, e in read_events(self.client, self.keys))
        return Origin(reported=None, start=start, first_plan=first_plan)

    @property
    def run_id(self) -> str:
        """The job's run id (`--rdzv-id`)."""
        return self.keys.run_id

    def tensorboard_run(self, proposed: str) -> str:
        """The job's TensorBoard run (`records.board`): `proposed` when this worker is the job's
        first writer, else the run its first writer chose. Read from etcd, at entry only."""
        return claim_board(self.client, self.keys, proposed, node=self.node_id)

    def progress(self) -> Optional[ProgressRecord]:
        """The job's last reported progress (None: none yet, or malformed)."""
        return read_progress(self.client, self.keys)

    def close_job(self, reason: str, *, failed: bool = False, stopped: bool = False, known_error: bool = False) -> None:
        """Close the job: every agent and worker leaves; `failed` makes them exit with an error;
        `stopped`: it was asked to stop before `training.steps` (`oobleck outcome` says so)."""
        record = ClosedRecord(time=time.time(), reason=reason, failed=failed, stopped=stopped, known_error=known_error)
        self.client.put_json(self.keys.closed, record.to_json())

    def stop_requested(self) -> Optional[str]:
        """Why the job was asked to stop at its next step boundary (`StopRecord`), or None."""
        stop = read_stop(self.reader, self.keys)
        return stop.reason if stop is not None else None

    def failure_of_job(self) -> Optional[str]:
        """The reason the job was closed as failed, or None (open, or finished normally)."""
        closed = read_closed(self.reader, self.keys)
        return closed.reason if closed is not None and closed.failed else None

    def store_for(self, generation: int, cfg: JobConfig, *, typical_step_s: float = 0.0) -> EtcdStore:
        """The etcd-backed c10d store of `generation`'s process groups (keys under
        `store/g<generation>/`); joining gives up at once when the generation is superseded. Its
        timeouts derive from this worker's typical step unless the config sets them (`config.timing`)."""
        ft = cfg.fault_tolerance
        timeout = timedelta(seconds=comm_timeout(ft, typical_step_s))
        return EtcdStore(
            self.client,
            prefix=self.keys.store(generation),
            timeout=timeout,
            min_wait=timeout,
            on_wait=self.join_watch(generation, stall_s=stall_report(ft, typical_step_s)),
        )

    def abandon_check(self, plan: Plan) -> Callable[[], Optional[str]]:
        """The `should_abandon` of a step of generation `plan.generation` (`engine.runner`): the
        job was closed, this node was fenced, a newer plan left a lost node out, or a newer plan on
        the same nodes restarts the generation (the roll call found every node alive after a
        worker failed: a crashed or hung worker restarted by its agent). Drains and joins are not
        reasons, nor a re-split of the batch around a straggler (`Plan.rebalanced`): they take effect
        at the step boundary."""
        checked: dict[int, list[str]] = {}

        def check() -> Optional[str]:
            if read_closed(self.reader, self.keys) is not None:
                return "the job was closed"
            if is_fenced(self.reader, self.keys, self.node_id):
                return f"node {self.node_id} was fenced (declared lost)"
            latest = self.plan()
            if latest is None or latest.generation <= plan.generation:
                return None
            if set(latest.nodes) == set(plan.nodes) and not latest.donors and not latest.rebalanced:
                return f"generation {latest.generation} restarts generation {plan.generation} on the same nodes"
            if latest.generation not in checked:
                checked[latest.generation] = self.lost_nodes(plan, latest)
            lost = checked[latest.generation]
            return f"generation {latest.generation} left out lost node(s) {', '.join(lost)}" if lost else None

        return check

    def lost_nodes(self, current: Plan, newer: Plan) -> list[str]:
        """Nodes of `current` that `newer` leaves out because they were lost (lease expired or
        fenced) or are restarting a hung worker (`rendezvous.hang`), as opposed to drained nodes
        and spares, which leave at a step boundary."""
        lost = []
        for node in current.nodes:
            if node in newer.nodes:
                continue
            if is_fenced(self.client, self.keys, node):
                lost.append(node)
            elif self.client.get_json(self.keys.node(node))[0] is None:
                lost.append(node)
            elif readiness_withdrawn(read_ready(self.client, self.keys, node)):
                lost.append(node)
        return lost

    def record_failure(self, record: ErrorRecord) -> None:
        """Keep `record` as what broke its generation if it is the first (`Keys.failure`, put if
        absent), for the restart bound (`rendezvous.restart_loop`)."""
        self.client.put_if_absent(self.keys.failure(record.generation), json.dumps(record.to_json()))

    def record_error(self, err: BaseException, *, step: int, generation: int) -> ErrorRecord:
        """Store the error that ends this worker (see `engine.resilience.errors`); returns the new record."""
        data, _ = self.client.get_json(self.keys.errors)
        rec = next_error_record(
            ErrorRecord.parse(data),
            err,
            step=step,
            generation=generation,
            node=self.node_id,
            local_rank=self.local_rank,
        )
        self.client.put_json(self.keys.errors, rec.to_json())
        return rec
