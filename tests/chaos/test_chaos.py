"""Seeded chaos: a 4-node job runs while a seeded schedule SIGKILLs random nodes (the leader
included) and starts new ones; checkpoints every 3 steps cover the cases where every copy of a
layer dies. The invariant is the same as everywhere: the final weights equal an uninterrupted
single-process run on the same global batches.

    make test-all       # seeds 1-5 and 4242, 8 events each (extended: CI runs one per landing, in turn)
    OOBLECK_CHAOS_SEED=7 OOBLECK_CHAOS_EVENTS=6 .venv/bin/python -m pytest -m chaos -s tests/chaos/test_chaos.py

The events must happen: a join counts once its node is in a plan; a kill once its victim is
SIGKILLed, chosen among the current plan's nodes once that plan has left out every node killed
before, and only while more than n0 = 2 of them are alive. As a cluster does, the test starts a
replacement node for every victim once the job has seen the loss, so every planned kill can
happen. A run that realises fewer than three quarters of its events fails."""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

import pytest

from helpers import ROOT, assert_same, overrides, paced, run_job, tiny_profile

N0 = 2  # the tiny profile's fewest nodes for one replica
PACE_S = 2.0
"""Seconds rank 0 sleeps at each step (`paced`): the job lasts long enough for replacement nodes to
start and be admitted (a node's start is tens of seconds on a loaded 2-core machine)."""
RDZV = "lease_ttl=2,settle=0.2,last_call_timeout=1"
STALL_S = 4 * 30.0
"""How long the job may make no step before the test stops waiting: a few of its communication
timeouts (`fault_tolerance.comm_timeout_s=30` in the jobs' overrides), each a failed step's wait."""
EXIT_GRACE_S = 20.0


def schedule(seed: int, events: int) -> tuple[list[tuple[int, str]], int]:
    """(step, kill|join) of each event and the job's steps, from the seed."""
    rng = random.Random(seed)
    kinds = [rng.choice(["kill", "kill", "join"]) for _ in range(events)]
    return [(4 + 6 * i, kind) for i, kind in enumerate(kinds)], 8 + 6 * events


def pick_victim(rng: random.Random, plan_nodes: list[str], killed: list[str]) -> str | None:
    """The next node to kill: one of the current plan's nodes, while more than n0 of them remain."""
    alive = [n for n in plan_nodes if n not in killed]
    return rng.choice(alive) if len(alive) > N0 else None


def needed(events: int) -> int:
    """Events a run must realise: three quarters of them (6 of 8)."""
    return events - events // 4


def test_a_victim_is_chosen_only_among_the_plans_nodes_while_more_than_n0_remain() -> None:
    rng = random.Random(0)
    assert pick_victim(rng, ["a", "b", "c"], []) in {"a", "b", "c"}
    assert pick_victim(rng, ["a", "b", "c"], ["c"]) is None  # two left: keep them
    assert pick_victim(rng, ["a", "b"], []) is None
    assert pick_victim(rng, ["a", "b", "c", "d"], ["a"]) in {"b", "c", "d"}
    assert schedule(4242, 8) == schedule(4242, 8) and len(schedule(4242, 8)[0]) == 8
    assert (needed(8), needed(4), needed(1)) == (6, 3, 1)


class Cluster:
    """The nodes the test starts itself (joins and replacements), as the launcher starts its own:
    the same torchrun command and environment."""

    def __init__(self, tmp: Path, launcher_args: list[str], script: list[str], env: dict[str, str]) -> None:
        from launcher.local import LocalCluster
        from launcher.options import build_parser

        self.local = LocalCluster(build_parser().parse_args(launcher_args), script)
        self.env = {**self.local.node_env(), **env}
        self.logs = tmp / "started"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.killed: set[int] = set()
        """Agent pids of started nodes the test killed."""

    def start(self) -> subprocess.Popen:
        with open(self.logs / f"{len(self.procs)}.log", "w") as log:
            proc = subprocess.Popen(
                self.local.torchrun_command(),
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def stop(self, wait_s: float) -> list[str]:
        """Wait up to `wait_s` for every started node to exit, kill the rest; what went wrong."""
        from launcher.faults import kill_node

        deadline = time.monotonic() + wait_s
        wrong = []
        for i, proc in enumerate(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_node(proc.pid)
                proc.wait()
                wrong.append(f"started node {i} (pid {proc.pid}) still ran {wait_s:g} s after the launcher")
                continue
            if proc.pid not in self.killed and proc.returncode != 0:
                wrong.append(f"started node {i} (pid {proc.pid}) exited with status {proc.returncode}")
        return wrong


class Watch:
    """The job as etcd shows it, for the events: its plan, progress, node records, and whether it
    still runs (`proc`: the launcher, which exits once its own nodes are gone, while nodes the
    `cluster` started go on)."""

    def __init__(self, endpoint: str, run_id: str, proc: subprocess.Popen, cluster: Cluster) -> None:
        from oobleck_elastic.etcd import EtcdSettings, connect
        from oobleck_elastic.records.keys import Keys

        self.client = connect(EtcdSettings(endpoint=endpoint))
        self.keys = Keys("/oobleck", run_id)
        self.proc, self.cluster = proc, cluster

    def plan_nodes(self) -> list[str]:
        from oobleck_elastic.planning import Plan

        value = self.client.get_json(self.keys.plan)[0]
        return list(Plan.from_json(value).nodes) if value else []

    def step(self) -> int:
        return (self.client.get_json(self.keys.progress)[0] or {}).get("step", 0)

    def agent_pid(self, node: str) -> Optional[int]:
        from oobleck_elastic.rendezvous.membership import live_nodes

        return next((r.agent_pid for r in live_nodes(self.client, self.keys) if r.node_id == node), None)

    def node_id(self, agent_pid: int) -> Optional[str]:
        from oobleck_elastic.rendezvous.membership import live_nodes

        return next((r.node_id for r in live_nodes(self.client, self.keys) if r.agent_pid == agent_pid), None)

    def running(self) -> bool:
        from oobleck_elastic.records.read import read_closed

        started = any(p.poll() is None for p in self.cluster.procs)
        return read_closed(self.client, self.keys) is None and (self.proc.poll() is None or started)

    def until(self, condition: Callable[[], bool]) -> bool:
        """Poll until `condition()` holds (True), or the job has ended or made no step for
        `STALL_S` (False: the test fails on what did not happen)."""
        last, moved = self.step(), time.monotonic()
        while self.running() and time.monotonic() - moved < STALL_S:
            if condition():
                return True
            time.sleep(0.1)
            if (now := self.step()) != last:
                last, moved = now, time.monotonic()
        return False


def _chaos(tmp_path: Path, etcd_server, run_id: str, seed: int, events: int) -> None:
    from launcher.faults import kill_node

    plan_of_events, steps = schedule(seed, events)
    said = f"seed {seed}: planned events {plan_of_events}"
    print(said, flush=True)
    rng = random.Random(seed + 1)
    profile = tiny_profile(tmp_path / "profile.json")
    extra = ["checkpoint.interval_steps=3"]
    env = paced(0, steps, PACE_S)
    # room for every event's node: a join's, and a replacement for every kill
    launcher_args = ["--nodes", "4", "--max-nodes", str(4 + events), "--exit-grace", f"{EXIT_GRACE_S:g}"]
    script = ["examples/train.py", "--config", "configs/gpt2-tiny.yaml", *overrides(tmp_path / "job", steps, profile)]
    cluster = Cluster(
        tmp_path,
        [*launcher_args, "--endpoint", etcd_server.endpoint, "--run-id", run_id, "--rdzv-conf", RDZV],
        script + extra,
        env,
    )
    done: list[str] = []  # the victims' node ids
    launcher_victims: list[str] = []
    realised: list[str] = []

    def happen(job: Watch) -> None:
        """The planned events, each in turn, while the job runs."""
        for at, kind in plan_of_events:
            if not job.until(lambda at=at: job.step() >= at):
                return
            if kind == "join":
                started = cluster.start()
                if not job.until(lambda started=started: job.node_id(started.pid) in job.plan_nodes()):
                    return
                realised.append(f"join of {job.node_id(started.pid)} at step {job.step()}")
                continue
            # the plan has left out every victim, and more than n0 of its nodes are alive (the
            # replacements started after earlier kills come in)
            if not job.until(lambda: not set(done) & set(job.plan_nodes()) and len(job.plan_nodes()) > N0):
                return
            victim = pick_victim(rng, job.plan_nodes(), done)
            pid = job.agent_pid(victim) if victim is not None else None
            assert victim is not None and pid is not None, f"{victim} is in the plan but has no node record"
            kill_node(pid)
            done.append(victim)
            if any(p.pid == pid for p in cluster.procs):
                cluster.killed.add(pid)
            else:
                launcher_victims.append(victim)
            realised.append(f"kill of {victim} at step {job.step()}")
            # a cluster replaces a lost machine, once the job has seen the loss
            if not job.until(lambda victim=victim: victim not in job.plan_nodes()):
                return
            cluster.start()

    def chaos(proc: subprocess.Popen) -> None:
        job = Watch(etcd_server.endpoint, run_id, proc, cluster)
        try:
            happen(job)
            job.until(lambda: False)  # the job's end, on whichever nodes run it
        finally:
            job.client.close()

    try:
        out, job, ref = run_job(
            tmp_path,
            etcd_server,
            run_id,
            launcher_args,
            steps,
            profile,
            extra=extra,
            during=chaos,
            killed_by_test=lambda: len(launcher_victims),
            rdzv=RDZV,
            env=env,
        )
    finally:
        # the started nodes exit once the job closes: the launcher's grace, then they are killed
        wrong = cluster.stop(EXIT_GRACE_S + 10)
    print(f"{said}; realised {len(realised)} of {events}: {realised}", flush=True)
    assert not wrong, wrong
    assert len(realised) >= needed(events), f"realised {len(realised)} of {events}, fewer than {needed(events)}"
    assert_same(job, ref)


@pytest.mark.chaos
def test_random_kills_and_joins(tmp_path: Path, etcd_server, run_id) -> None:
    seed = int(os.environ.get("OOBLECK_CHAOS_SEED", "0"))
    events = int(os.environ.get("OOBLECK_CHAOS_EVENTS", "4"))
    _chaos(tmp_path, etcd_server, run_id, seed, events)


@pytest.mark.extended
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 4242])
def test_chaos_seeds(tmp_path: Path, etcd_server, run_id, seed: int) -> None:
    _chaos(tmp_path, etcd_server, run_id, seed, 8)
