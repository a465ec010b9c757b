"""`torchrun --rdzv-backend=oobleck` in place (`--rdzv-conf mode=in_place`): a TorchElastic
rendezvous handler on etcd v3.

Invariant: healthy workers are never restarted: `num_nodes_waiting()` is always 0, the agent
gets a node-local view, and `shutdown()` only takes this node out, never the job. The story:
docs/design.md.
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
from ..etcd import EtcdClient, connect
from ..etcd.mirror import Mirror
from ..etcd.protocols import KVReader
from ..records.keys import Keys
from ..records.control import NodeState, ReadyRecord, Roster
from ..records.job import ClosedRecord, Event, EventKind
from ..records.read import read_closed, read_ready, read_roster
from .leader import Leader
from .planner import JobPlanner
from .liveness import LivenessServer
from .membership import Member, mark_draining, put_event, say_goodbye
from .hang import HangWatch, WorkerHung
from .exits import closed_error, note_closed
from .options import (
    RDZV_OPTIONS,
    agent_local_world_size,
    class_devices_problem,
    device_class_of,
    etcd_settings,
    launch_of,
    rdzv_conf,
    seconds,
)
from .preempt import PreemptionWatch, parse_signals

log = JobLog(logging.getLogger(__name__))

_SHUTDOWN_OUTAGE_S = 2.0
"""How long `shutdown()` waits for an unreachable etcd before it returns False."""

BACKEND = "oobleck"
NO_ENV_WORLD = (
    "oobleck in-place job: no env:// world here (RANK/WORLD_SIZE are node-local); use WorkerContext, "
    "or --rdzv-conf mode=restart for a plain torch.distributed script"
)
"""MASTER_PORT of an in-place job's workers: a script that calls `init_process_group` through
`env://` fails at once with this text (Python shows 200 characters of it) instead of training
alone in a world of one node."""


class OobleckRendezvousHandler(RendezvousHandler):
    def __init__(self, params: RendezvousParameters, *, argv: Optional[list[str]] = None) -> None:
        """`argv`: a torchrun command line to take the script's --config from (tests); by default
        only torchrun's own command line for this rendezvous counts (`rendezvous.options`)."""
        if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <agent>` prints its threads' stacks (a slow exit)
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        self.params = params
        conf = rdzv_conf(params)
        launch = launch_of(params, argv)
        if not launch.config:
            raise ConfigError(
                "--rdzv-backend=oobleck in place needs the job config to plan pipelines: give the training "
                "script --config PATH on torchrun's command line or pass --rdzv-conf config=PATH "
                "(a script that does not use the worker context: --rdzv-conf mode=restart)"
            )
        self.cfg: JobConfig = load_config(launch.config, launch.overrides)
        self.device_class = device_class_of(conf, self.cfg)
        self.devices: Optional[int] = None
        if launch.nproc is not None:
            self._plan_devices(launch.nproc)
        ft = self.cfg.fault_tolerance
        self.lease_ttl_s = seconds(conf, "lease_ttl", ft.lease_ttl_s)
        self.settle_s = seconds(conf, "settle", ft.settle_s, zero_ok=True)
        self.last_call_s = seconds(conf, "last_call_timeout", 2.0)
        self.join_timeout_s = seconds(conf, "join_timeout", ft.rendezvous_timeout_s)
        self.settings = etcd_settings(params, conf)
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
        self.preemption: Optional[PreemptionWatch] = None
        self._heartbeat_dir: Optional[Path] = None
        self._notice_dir: Optional[Path] = None
        self._shut_down: Optional[bool] = None
        # No TORCH_ELASTIC_WORKER_IDENTICAL: with the node-local view (rank 0 of 1, an in-memory
        # store) torch's own rank assignment gives the same ranks, and the process's environment
        # stays as it was for any other job it runs.

    def _plan_devices(self, nproc: int) -> None:
        """Plan with `nproc` devices per node (torchrun's --nproc-per-node)."""
        problem = class_devices_problem(self.cfg, self.device_class, nproc)
        if problem:
            raise ValueError(problem)
        self.devices = nproc
        if self.cfg.planning.gpus_per_node != nproc:
            log.warning(
                "planning.gpus_per_node=%d but --nproc-per-node=%d: planning with %d device(s) per node",
                self.cfg.planning.gpus_per_node,
                nproc,
                nproc,
            )
            self.cfg.planning.gpus_per_node = nproc

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
        """Take this node out of the job (its lease is revoked; the job goes on without it): stop
        the threads, give the signals back, remove the temporary directories, close the etcd
        connection. Never raises: torchrun calls it in a `finally:`, where an error would replace
        the worker's own. False (one log line) when etcd could not be told that the node leaves
        (its record then expires with its lease); a second call returns the first one's answer."""
        if self._shut_down is not None:
            return self._shut_down
        self._shut_down = True
        self._stopping.set()
        node = self.member.node_id if self.member is not None else None
        try:  # workers that failed because the job was closed as failed: that reason is their line
            note_closed(self.params.run_id, read_closed(self.reader, self.keys))
        except Exception as err:  # noqa: BLE001 - etcd gone: torch's own report stands
            log.at(node=node).warning("shutdown: could not read whether the job was closed: %s", err)
        steps = [
            self.preemption.uninstall if self.preemption is not None else None,
            self.leader.stop if self.leader is not None else None,
            self._say_goodbye,  # before the socket closes: no watcher can take the leave for a death
            self.liveness.close if self.liveness is not None else None,
            self.hang_watch.stop if self.hang_watch is not None else None,
            self.view.close if self.view is not None else None,
        ]
        for step in steps:
            if step is None:
                continue
            try:
                step()
            except Exception as err:  # noqa: BLE001 - the rest of the shutdown must still run
                log.at(node=node).warning("shutdown: %s failed: %s", getattr(step, "__qualname__", step), err)
        for directory in (self._heartbeat_dir, self._notice_dir):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
        self._shut_down = self._leave()
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - a broken channel: nothing left to close
            pass
        return self._shut_down

    def _on_the_way_out(self) -> None:
        """etcd is waited for `_SHUTDOWN_OUTAGE_S` at most from now on (not the job's whole
        `etcd_outage`: the agent is on its way out)."""
        settings = self.client.settings
        self.client.settings = dataclasses.replace(settings, outage_s=min(settings.outage_s, _SHUTDOWN_OUTAGE_S))

    def _say_goodbye(self) -> None:
        """Record the clean leave (`goodbye/<node>`) while the liveness socket is still open: a
        watcher that reads it closed, however late, finds the goodbye and takes no death."""
        m = self.member
        if m is None or m.record is None or (m.fenced.is_set() and not m.returned):
            return  # never registered, or declared lost (and not back `returned`): nothing to say
        self._on_the_way_out()
        say_goodbye(self.client, self.keys, m.node_id, "agent shut down")

    def _leave(self) -> bool:
        """Record this node's leaving and revoke its lease; False when etcd does not answer within
        `_SHUTDOWN_OUTAGE_S`."""
        if self.member is None or self.member.record is None:
            return True
        node = self.member.node_id
        self._on_the_way_out()
        self.member.close(revoke=False)  # first: a keep-alive that found the lease revoked would register again
        try:
            put_event(
                self.client,
                self.keys,
                Event(time=time.time(), kind=EventKind.LEAVE, node=node, detail="agent shut down"),
            )
            if self.member.lease is not None and (self.member.returned or not self.member.fenced.is_set()):
                self.client.revoke_lease(self.member.lease)
            return True
        except Exception as err:  # noqa: BLE001 - etcd gone: say so once, the lease expires by itself
            log.at(node=node).warning(
                "shutdown: etcd did not answer (%s): node %s leaves when its lease expires (%.0f s)",
                err,
                node,
                self.lease_ttl_s,
            )
            return False

    def next_rendezvous(self) -> RendezvousInfo:
        closed = read_closed(self.client, self.keys)
        if closed is not None:
            raise closed_error(self.params.run_id, closed)
        if self._shut_down is not None:
            raise RendezvousClosedError(f"the rendezvous handler of run {self.params.run_id} was shut down")
        if self.member is None:
            if self.devices is None:  # started by torch's agent: its WorkerSpec says how many workers
                self._plan_devices(agent_local_world_size(self, sys._getframe(1)) or 1)
            host = self.params.local_addr or socket.gethostname()
            self.liveness = LivenessServer(host)
            self.member = Member(
                self.client,
                self.keys,
                devices=self.devices or 1,
                lease_ttl_s=self.lease_ttl_s,
                host=host,
                liveness=self.liveness.address,
                device_class=self.device_class,
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
                max_restarts=self.cfg.fault_tolerance.max_restarts_without_progress,
                strict=self.cfg.fault_tolerance.strict,
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
        # a node-local view: job-wide ranks come from the plan; MASTER_PORT refuses env:// (NO_ENV_WORLD)
        info = RendezvousStoreInfo(self.params.local_addr or "127.0.0.1", NO_ENV_WORLD)  # type: ignore[arg-type]
        return RendezvousInfo(self._store, 0, 1, info)

    # ------------------------------------------------------------------ helpers
    def _watch_preemption(self) -> None:
        """Preemption notices drain this node (`rendezvous.preempt`)."""
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
            applies=self._drainable,
        )
        watch.install()
        self.preemption = watch

    def _drainable(self) -> bool:
        """Whether a preemption notice can drain this node: some worker of it reported ready (it uses
        the worker context, which leaves at a step boundary). Otherwise the notice stops the node as
        torchrun would (`rendezvous.preempt`)."""
        assert self.member is not None
        return bool(read_ready(self.client, self.keys, self.member.node_id))

    def _watch_hangs(self) -> None:
        """This node's workers tell it whether their step threads move (`engine.resilience.heartbeat`); a
        worker stuck in a step is recorded and stopped (`rendezvous.hang`)."""
        assert self.member is not None
        node, ft = self.member.node_id, self.cfg.fault_tolerance
        directory = Path(tempfile.mkdtemp(prefix=f"oobleck-heartbeat-{node}-"))
        os.environ[HEARTBEAT_ENV] = str(directory)

        def record(beat: Beat, local_rank: int, bound: float, stack: str) -> None:
            err = WorkerHung(
                f"worker {local_rank} of node {node} hung in step {beat.step + 1} for more than "
                f"{bound:.1f} s with no progress of its step thread (fault_tolerance.hang_floor_s / hang_factor)"
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

        self.hang_watch = HangWatch(directory, ft=ft, node=node, record=record).start()
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
                    self.member.check_declared_lost()  # too late? then back as `returned` (docs/recovery.md)
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


__all__ = ["BACKEND", "NO_ENV_WORLD", "OobleckRendezvousHandler", "RDZV_OPTIONS"]
