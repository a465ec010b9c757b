"""What a worker process sees of the control plane.

torchrun starts workers with the agent's environment, in which the oobleck handler put the etcd
settings, run id, key prefix and node id (`OOBLECK_*`). `WorkerContext.from_env()` reconnects
to etcd from there; the worker then reads plans (never RANK/WORLD_SIZE, which torchrun sets for
a node-local world), finds its stage, reports progress and learns when to leave:
its node was drained (it is no longer in the plan and its record says draining) or the job
was closed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..etcd import EtcdClient, EtcdSettings, connect
from ..planning import PipelineSpec, Plan, StagePlacement
from .keys import Keys, NodeRecord
from .leader import _parse_plan


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

    @classmethod
    def from_env(cls, environ: Optional[dict[str, str]] = None) -> "WorkerContext":
        env = dict(os.environ if environ is None else environ)
        settings = EtcdSettings.from_env(env)
        return cls(client=connect(settings), keys=Keys(env.get("OOBLECK_KEY_PREFIX", "/oobleck"),
                                                       env["OOBLECK_RUN_ID"]),
                   node_id=env["OOBLECK_NODE_ID"], local_rank=int(env.get("LOCAL_RANK", "0")))

    def plan(self) -> Optional[Plan]:
        data, _ = self.client.get_json(self.keys.plan)
        return _parse_plan(data)

    def plan_at(self, generation: int) -> Optional[Plan]:
        """The plan of a past or current generation (from the leader's history)."""
        data, _ = self.client.get_json(self.keys.plan_at(generation))
        return _parse_plan(data)

    def my_stage(self, plan: Plan) -> Optional[tuple[PipelineSpec, StagePlacement]]:
        for p in plan.pipelines:
            for s in p.stages:
                if s.node == self.node_id and s.local_rank == self.local_rank:
                    return p, s
        return None

    def record(self) -> Optional[NodeRecord]:
        data, _ = self.client.get_json(self.keys.node(self.node_id))
        return NodeRecord.parse(data, key=self.keys.node(self.node_id)) if data is not None else None

    def should_leave(self, plan: Optional[Plan]) -> Optional[str]:
        """Why this worker must exit 0 now, or None: the job is closed, or the node was drained."""
        if self.client.get_json(self.keys.closed)[0] is not None:
            return "the job is closed"
        if self.client.get_json(self.keys.fenced + self.node_id)[0] is not None:
            return f"node {self.node_id} was fenced (declared lost): it must not train on alone"
        if plan is not None and self.node_id not in plan.nodes:
            rec = self.record()
            if rec is None:
                return f"node {self.node_id} lost its lease (it was unreachable for longer than the TTL)"
            if rec.state == "draining":
                return f"node {self.node_id} was drained"
        return None

    def report_ready(self) -> None:
        """This worker has imported everything and loaded its data: it can join a generation."""
        self.client.put_json(f"{self.keys.ready(self.node_id)}{self.local_rank}", {"time": time.time(),
                                                                                 "pid": os.getpid()})

    def report_failure(self, generation: int, *, kind: str = "failure") -> None:
        """Check in at the leader's roll call: this worker saw generation `generation` break
        (`failure`), or has waited too long for its peers while joining it (`stall`)."""
        self.client.put_json(f"{self.keys.rollcall(generation)}{self.node_id}/{self.local_rank}",
                             {"time": time.time(), "kind": kind})

    def join_watch(self, generation: int, *, stall_s: float) -> Callable[[float], None]:
        """The `EtcdStore.on_wait` hook of a worker joining `generation`: it gives up (raises)
        once a newer plan is published, and checks in at the roll call as stalled after
        `stall_s` so that the leader finds a peer that died during the reconfiguration."""
        reported = False

        def hook(waited: float) -> None:
            nonlocal reported
            latest = self.plan()
            if latest is not None and latest.generation > generation:
                raise RuntimeError(f"generation {generation} was superseded by generation {latest.generation} "
                                   "while joining it")
            if stall_s > 0 and waited >= stall_s and not reported:
                self.report_failure(generation, kind="stall")
                reported = True
        return hook

    def report_progress(self, *, generation: int, step: int, **extra: Any) -> None:
        self.client.put_json(self.keys.progress, {"generation": generation, "step": step, "time": time.time(),
                                                  "node": self.node_id, **extra})

    def progress(self) -> Optional[dict[str, Any]]:
        data, _ = self.client.get_json(self.keys.progress)
        return data if isinstance(data, dict) else None

    def close_job(self, reason: str) -> None:
        self.client.put_json(self.keys.closed, {"time": time.time(), "reason": reason})
