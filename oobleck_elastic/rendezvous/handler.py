"""`torchrun --rdzv-backend=oobleck`: a TorchElastic rendezvous handler on etcd v3.

What torchrun's agent needs from a handler, and what this one does differently from the stock
c10d/etcd handlers so that healthy workers are never restarted (the agent restarts ALL local
workers when `num_nodes_waiting() > 0` or when a local worker exits non-zero):

- `next_rendezvous()` registers the node (membership.py), starts the leader thread (leader.py)
  and returns once the leader has admitted this node: into the first generation, or, for a node
  arriving while the job runs, as a member whose workers join the next generation once they
  report ready (so nobody waits in init_process_group while a newcomer imports torch). The first
  nodes are admitted before the first plan exists when the planner still needs the profile: their
  workers start, one per device kind measures the profile on its own device and publishes it
  (`WorkerContext.share_profile`), and they wait for the plan that gives them a stage. It returns a
  node-local view (rank 0 of 1, an in-memory store): the agent's own rank assignment and exit
  barrier stay on this node, because job-wide ranks come from the plan, which workers read from
  etcd. A node that arrives while the job runs is admitted into the next generation without a
  new rendezvous round for anyone.
- `num_nodes_waiting()` is always 0: a positive value makes the agent restart its workers.
- `shutdown()` only takes this node out (revokes its lease); it never closes the job.
- The leader plans with a `JobPlanner` (rendezvous/planner.py): from `planning.profile_path`, or
  the first profile a worker measured, pinned in etcd so every later leader plans from the same
  numbers.
- Workers inherit the agent's environment, so the handler exports the etcd endpoint, TLS and
  auth settings, run id, key prefix and node id (`OOBLECK_*`) before the agent starts them.

Options come through `--rdzv-conf key=value,...`; see `RDZV_OPTIONS`.
"""

from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import logging
import signal
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from ..logs import JobLog
from ..config import ConfigError, JobConfig, load_config
from ..records.errors import ErrorRecord, next_error_record
from ..records.heartbeat import ENV as HEARTBEAT_ENV
from ..records.heartbeat import Beat
from ..etcd import EtcdClient, EtcdSettings, connect
from ..etcd.mirror import Mirror
from ..etcd.server import free_port
from ..etcd.protocols import KVReader
from ..records.keys import Keys
from ..records.control import ClosedRecord, Event, EventKind, NodeState, ReadyRecord, Roster, read_closed, read_roster
from .leader import Leader
from .planner import JobPlanner
from .liveness import LivenessServer
from .membership import Member, mark_draining, put_event
from .hang import HangWatch, WorkerHung
from .preempt import PreemptionWatch, parse_signals

log = JobLog(logging.getLogger(__name__))

BACKEND = "oobleck"
RDZV_OPTIONS = {
    "config": "job YAML (default: the training script's --config argument)",
    "lease_ttl": "seconds before a silent node's record expires (default fault_tolerance.lease_ttl_s)",
    "last_call_timeout": "seconds to wait for more nodes once --nnodes MIN are up (default 2)",
    "settle": "seconds that batch simultaneous membership changes (default fault_tolerance.settle_s)",
    "cacert": "CA certificate of the etcd server (enables TLS)",
    "cert": "client certificate for mutual TLS",
    "key": "client key for mutual TLS",
    "user": "etcd user",
    "password": "etcd password",
    "key_prefix": "etcd key prefix (default /oobleck)",
    "join_timeout": "seconds a node waits to be admitted before giving up (default 600)",
    "etcd_outage": "seconds etcd requests are retried while etcd is unreachable before failing (default 60)",
}
# set by torchrun itself or kept for compatibility with other backends; accepted silently
_TORCHRUN_OPTIONS = {
    "timeout",
    "close_timeout",
    "is_host",
    "local_addr",
    "read_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
}


def script_arguments(argv: list[str]) -> tuple[int, Optional[str], list[str]]:
    """(nproc_per_node, --config value, dotlist overrides) from torchrun's own command line."""
    try:
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(argv[1:])
        nproc = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else 1
        script_args = list(args.training_script_args)
    except (SystemExit, Exception):  # noqa: BLE001 - not started by torchrun (tests, CLI)
        return 1, None, []
    config = None
    for i, arg in enumerate(script_args):
        if arg == "--config" and i + 1 < len(script_args):
            config = script_args[i + 1]
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
    overrides = [a for a in script_args if "=" in a and not a.startswith("-")]
    return nproc, config, overrides


class OobleckRendezvousHandler(RendezvousHandler):
    def __init__(self, params: RendezvousParameters, *, argv: Optional[list[str]] = None) -> None:
        if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <agent>` prints its threads' stacks (a slow exit)
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        self.params = params
        conf = {k: v for k, v in params.config.items() if v is not None}
        unknown = set(conf) - set(RDZV_OPTIONS) - _TORCHRUN_OPTIONS
        if unknown:
            raise ValueError(
                f"unknown --rdzv-conf option(s) {sorted(unknown)} for --rdzv-backend=oobleck; "
                f"known: {', '.join(sorted(RDZV_OPTIONS))}"
            )
        nproc, script_config, overrides = script_arguments(argv if argv is not None else sys.argv)
        config_path = conf.get("config") or script_config
        if not config_path:
            raise ConfigError(
                "--rdzv-backend=oobleck needs the job config to plan pipelines: give the training "
                "script --config PATH or pass --rdzv-conf config=PATH"
            )
        self.cfg: JobConfig = load_config(config_path, overrides)
        self.devices = nproc
        if self.cfg.planning.gpus_per_node != nproc:
            log.warning(
                "planning.gpus_per_node=%d but --nproc-per-node=%d: planning with %d device(s) per node",
                self.cfg.planning.gpus_per_node,
                nproc,
                nproc,
            )
            self.cfg.planning.gpus_per_node = nproc
        ft = self.cfg.fault_tolerance

        def seconds(option: str, default: float, *, zero_ok: bool = False) -> float:
            value = conf.get(option, default)
            try:
                result = float(value)
            except (TypeError, ValueError):
                result = float("nan")
            if not (result >= 0 if zero_ok else result > 0):
                raise ValueError(
                    f"--rdzv-conf {option}={value}: give a number of seconds {'>=' if zero_ok else '>'} 0 "
                    f"(e.g. {option}={default:g}); {option}: {RDZV_OPTIONS[option]}"
                )
            return result

        self.lease_ttl_s = seconds("lease_ttl", ft.lease_ttl_s)
        self.settle_s = seconds("settle", ft.settle_s, zero_ok=True)
        self.last_call_s = seconds("last_call_timeout", 2.0)
        self.join_timeout_s = seconds("join_timeout", ft.rendezvous_timeout_s)
        self.settings = EtcdSettings(
            endpoint=params.endpoint or "127.0.0.1:2379",
            cacert=conf.get("cacert"),
            cert=conf.get("cert"),
            key=conf.get("key"),
            user=conf.get("user"),
            password=conf.get("password"),
            outage_s=seconds("etcd_outage", 60.0),
        )
        self.keys = Keys(conf.get("key_prefix", "/oobleck"), params.run_id)
        self.client: EtcdClient = connect(self.settings)
        self.member: Optional[Member] = None
        self.leader: Optional[Leader] = None
        self.liveness: Optional[LivenessServer] = None
        self.planner = JobPlanner(self.cfg, self.client, self.keys)
        self._store = dist.HashStore()
        self.view: Optional[Mirror] = None
        self._stopping = threading.Event()
        self.hang_watch: Optional[HangWatch] = None
        self._heartbeat_dir: Optional[Path] = None
        self._notice_dir: Optional[Path] = None
        os.environ["TORCH_ELASTIC_WORKER_IDENTICAL"] = "1"  # the agent skips store-based rank assignment

    # ------------------------------------------------------------------ RendezvousHandler
    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self.params.run_id

    @property
    def use_agent_store(self) -> bool:
        return False

    @property
    def reader(self) -> KVReader:
        """The agent's mirror once the node registered; etcd before."""
        return self.view if self.view is not None else self.client

    def is_closed(self) -> bool:
        return read_closed(self.reader, self.keys) is not None

    def set_closed(self) -> None:
        self.client.put_json(self.keys.closed, ClosedRecord(time=time.time(), reason="set_closed").to_json())

    def num_nodes_waiting(self) -> int:
        return 0  # joins are admitted by the leader; a positive value would restart healthy workers

    def shutdown(self) -> bool:
        if self.leader is not None:
            self.leader.stop()
        if self.liveness is not None:
            self.liveness.close()
        self._stopping.set()
        if self.hang_watch is not None:
            self.hang_watch.stop()
        for directory in (self._heartbeat_dir, self._notice_dir):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
        if self.view is not None:
            self.view.close()
        if self.member is not None and self.member.record is not None:
            put_event(
                self.client,
                self.keys,
                Event(time=time.time(), kind=EventKind.LEAVE, node=self.member.node_id, detail="agent shut down"),
            )
            self.member.close(revoke=True)
        self.client.close()
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        closed = read_closed(self.client, self.keys)
        if closed is not None:
            raise closed_error(self.params.run_id, closed)
        if self.member is None:
            host = self.params.local_addr or socket.gethostname()
            self.liveness = LivenessServer(host)
            self.member = Member(
                self.client,
                self.keys,
                devices=self.devices,
                lease_ttl_s=self.lease_ttl_s,
                host=host,
                liveness=self.liveness.address,
            )
            self.member.register()
            self.view = Mirror(
                self.client, self.keys.agent_watched(self.member.node_id), name=f"agent {self.member.node_id}"
            ).start()
            self.leader = Leader(
                self.client,
                self.keys,
                self.member,
                planner=self.planner.plan_for,
                min_nodes=self.params.min_nodes,
                max_nodes=self.params.max_nodes,
                last_call_s=self.last_call_s,
                settle_s=self.settle_s,
                profile_ready=self.planner.profile_ready,
                profile_timeout_s=self.cfg.fault_tolerance.rendezvous_timeout_s,
                view=self.view,
                # GPipe keeps every microbatch in memory: its count is planned, not moved
                rebalance=self.cfg.fault_tolerance.straggler_rebalance
                and self.cfg.fault_tolerance.straggler_factor > 0
                and self.cfg.planning.schedule == "1f1b",
            )
            self.leader.start()
            threading.Thread(target=self._answer_pings, name="oobleck-pong", daemon=True).start()
            self._watch_preemption()
            self._watch_hangs()
        node = self.member.node_id
        plan = self._wait_admitted(node)
        os.environ.update(self.settings.to_env())
        os.environ.update(
            {
                "OOBLECK_RUN_ID": self.params.run_id,
                "OOBLECK_KEY_PREFIX": self.keys.prefix,
                "OOBLECK_NODE_ID": node,
                "OOBLECK_NODE_INDEX": str(self.member.record.index),  # type: ignore[union-attr]
                "OOBLECK_GENERATION": str(plan.generation if plan else 0),
            }
        )
        if plan is None:
            log.at(node=node).info("admitted; the first plan follows once a worker has measured the profile")
        else:
            log.at(node=node).info("admitted (current generation %d, %d node(s))", plan.generation, len(plan.nodes))
        info = RendezvousStoreInfo("127.0.0.1", free_port())
        return RendezvousInfo(self._store, 0, 1, info)

    # ------------------------------------------------------------------ helpers
    def _watch_preemption(self) -> None:
        """Preemption notices drain this node (rendezvous/preempt.py)."""
        assert self.member is not None
        member, ft = self.member, self.cfg.fault_tolerance

        def drain(detail: str) -> bool:
            rec = member.current_record()
            return rec is not None and (
                rec.state == NodeState.DRAINING or mark_draining(self.client, self.keys, rec, detail)
            )

        if threading.current_thread() is not threading.main_thread():
            log.at(node=member.node_id).warning(
                "preemption notices are not handled (the rendezvous runs outside the main thread)"
            )
            return
        self._notice_dir = Path(tempfile.mkdtemp(prefix=f"oobleck-preempt-{member.node_id}-"))
        # torchrun does not always call shutdown() (a run that finished): remove it at exit too
        atexit.register(shutil.rmtree, self._notice_dir, ignore_errors=True)
        watch = PreemptionWatch(
            parse_signals(ft.preempt_signals),
            grace_s=ft.preempt_grace_s,
            node=member.node_id,
            drain=drain,
            alive=lambda: not self._stopping.is_set(),
            notice_file=self._notice_dir / "notice",
        )
        watch.install()

    def _watch_hangs(self) -> None:
        """This node's workers tell it when their steps begin and end (engine/resilience/heartbeat.py); a worker
        stuck in a step is recorded and stopped (rendezvous/hang.py)."""
        assert self.member is not None
        node, ft = self.member.node_id, self.cfg.fault_tolerance
        directory = Path(tempfile.mkdtemp(prefix=f"oobleck-heartbeat-{node}-"))
        os.environ[HEARTBEAT_ENV] = str(directory)

        def record(beat: Beat, local_rank: int, bound: float, stack: str) -> None:
            err = WorkerHung(
                f"worker {local_rank} of node {node} hung in step {beat.step + 1} for more than "
                f"{bound:.0f} s (fault_tolerance.hang_floor_s / hang_factor)"
            )
            plan, _ = self.client.get_json(self.keys.plan)
            generation = int(plan.get("generation", 0)) if isinstance(plan, dict) else 0
            data, _ = self.client.get_json(self.keys.errors)
            rec = next_error_record(
                ErrorRecord.parse(data), err, step=beat.step, generation=generation, node=node, local_rank=local_rank
            )
            self.client.put_json(self.keys.errors, dataclasses.replace(rec, traceback=stack[-4000:]).to_json())
            # not ready until the restarted worker says so: the next plan leaves the node out, and it
            # joins again at a step boundary (leader._not_ready), off the survivors' critical path
            self.client.put_json(
                self.keys.ready_worker(node, local_rank), ReadyRecord.withdraw("hung worker restarting").to_json()
            )
            put_event(
                self.client,
                self.keys,
                Event(
                    time=time.time(),
                    kind=EventKind.HANG,
                    node=node,
                    generation=generation,
                    detail=f"{err}: stopped, its agent restarts it; first stack lines: {stack.strip()[:300]}",
                ),
            )

        self.hang_watch = HangWatch(
            directory, floor_s=ft.hang_floor_s, factor=ft.hang_factor, node=node, record=record
        ).start()
        self._heartbeat_dir = directory
        atexit.register(shutil.rmtree, directory, ignore_errors=True)

    def _answer_pings(self) -> None:
        """The leader's roll call asks whether this node is alive (a nonce under `ping/<node>`):
        answer with the same nonce under `pong/<node>`, as soon as the mirror shows a new one."""
        assert self.member is not None and self.view is not None
        key, answered, version = self.keys.ping(self.member.node_id), 0, 0
        while not self._stopping.is_set() and not self.member.fenced.is_set():
            version = self.view.wait(version, 1.0)
            try:
                kv = self.view.get(key)
                if kv is not None and kv.mod_revision != answered:
                    self.client.put(self.keys.pong(self.member.node_id), kv.value)
                    answered = kv.mod_revision
            except Exception as err:  # noqa: BLE001 - a missed pong only delays the re-plan
                log.at(node=self.member.node_id).warning("could not answer a ping: %s", err)
                self._stopping.wait(0.1)

    def _wait_admitted(self, node: str) -> Roster | None:
        """The current roster (the plan's generation and nodes) once this node may start its
        workers: it is in the plan, or the leader admitted it (a late node, or a first node before
        the first plan exists: then None)."""
        assert self.member is not None and self.view is not None
        deadline = time.monotonic() + self.join_timeout_s
        next_log = time.monotonic() + 5
        version = 0
        while True:  # reads are from the mirror: each change wakes this loop, nothing polls etcd
            plan = read_roster(self.view, self.keys)
            if plan is not None and node in plan.nodes:
                return plan
            if self.view.get_json(self.keys.admitted(node))[0] is not None:
                return plan  # a late node, or a first one before the profile exists: its workers start now
            if self.member.fenced.is_set():
                raise RendezvousClosedError(f"node {node} was fenced (lease expired) while waiting")
            closed = read_closed(self.view, self.keys)  # e.g. closed as failed: no plan will come
            if closed is not None:
                raise closed_error(self.params.run_id, closed, node=node)
            now = time.monotonic()
            if now > deadline:
                raise RendezvousTimeoutError(
                    f"node {node} was not admitted within {self.join_timeout_s:.0f}s (run {self.params.run_id}, "
                    f"--nnodes {self.params.min_nodes}:{self.params.max_nodes}); are the other nodes using the "
                    "same --rdzv-id and --rdzv-endpoint?"
                )
            if now > next_log:
                log.at(node=node).info("waiting to be admitted (generation %s)", plan.generation if plan else "none")
                next_log = now + 10
            version = self.view.wait(version, 0.5)


def closed_error(run_id: str, closed: ClosedRecord, *, node: Optional[str] = None) -> BaseException:
    """What `next_rendezvous` raises on a closed job. Closed as failed (a worker's error that every
    restart would repeat, engine/startup.py): SystemExit with one line, so the agent restarts no
    worker and exits 1 without a traceback; closed otherwise: torch's RendezvousClosedError."""
    where = f" while node {node} waited to be admitted" if node else ""
    if closed.failed:
        return SystemExit(f"torchrun --rdzv-backend=oobleck: run {run_id} was closed as failed{where}: {closed.reason}")
    return RendezvousClosedError(f"run {run_id} was closed{where}" + (f": {closed.reason}" if closed.reason else ""))


__all__ = ["BACKEND", "OobleckRendezvousHandler", "closed_error", "RDZV_OPTIONS", "script_arguments"]
