"""A stalled leader hands over: the leader's agent (not its workers) is frozen for three lease
TTLs, by SIGSTOP or by a busy loop that holds the GIL (`OOBLECK_AGENT_SPIN`), alone or while a
non-leader dies; its lease expires (or a deputy deposes it), another agent is elected and
re-plans without the stalled node, and the job never waits for a step longer than TTL + settle +
the survivors' re-entry + two steps. The job ends with the single-process reference weights. The
stalled agent finds itself fenced when it resumes and publishes nothing.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import pytest

from helpers import assert_same, paced, run_job, tiny_profile, when

pytestmark = pytest.mark.slow

TTL_S, SETTLE_S = 2.0, 0.2
RDZV = f"lease_ttl={TTL_S:g},settle={SETTLE_S:g},last_call_timeout=1"


class StepClock:
    """When each step of the job completed (its `progress`) and each generation was published,
    polled every 20 ms."""

    def __init__(self) -> None:
        self.done: dict[int, float] = {}
        self.published: dict[int, float] = {}

    def poll(self, client, keys) -> int:
        generation = (client.get_json(keys.plan)[0] or {}).get("generation", 0)
        self.published.setdefault(generation, time.monotonic())
        step = (client.get_json(keys.progress)[0] or {}).get("step", 0)
        if step and step not in self.done:
            self.done[step] = time.monotonic()
        return step

    def longest_wait_after(self, at: float) -> float:
        """The longest time without a step from the last step completed before `at` on."""
        times = sorted(self.done.values())
        after = [t for t in times if t > at]
        assert after, "no step completed after the stall"
        last = max(t for t in times if t <= at)
        return max(b - a for a, b in zip([last, *after], after))

    def bound(self, at: float) -> float:
        """TTL + settle + the survivors' re-entry + two steps, each measured on this job: the
        re-entry from generation 2's publication to its first step, and the slowest step before
        `at` (the one under way when the leader stalled, and one to spare for the hand-over's
        own ticks: the election, the planner)."""
        times = sorted(t for t in self.done.values() if t <= at)
        slowest = max(b - a for a, b in zip(times, times[1:]))
        reentry = min(t for t in self.done.values() if t > self.published[2]) - self.published[2]
        return TTL_S + SETTLE_S + reentry + 2 * slowest


def _stall_the_leader(
    tmp_path: Path,
    etcd_server,
    run_id: str,
    stall: Callable[[int], None],
    also: Callable = lambda c, k: None,
    env: Optional[dict[str, str]] = None,
    killed: int = 0,
) -> tuple[str, StepClock, float]:
    """A 4-node job of 10 paced steps whose leader's agent (not its workers) is stalled by
    `stall(pid)` once 3 steps are done (then `also(client, keys)`); returns its output, its step
    clock and when the stall began."""
    from oobleck_elastic.etcd import EtcdSettings, connect
    from oobleck_elastic.records.keys import Keys
    from oobleck_elastic.records.read import read_leader
    from oobleck_elastic.rendezvous.membership import live_nodes, read_events

    keys = Keys("/oobleck", run_id)
    clock = StepClock()
    stalled: dict = {}

    def stall_leader(client) -> None:
        leader = read_leader(client, keys)
        assert leader is not None
        rec = next(r for r in live_nodes(client, keys) if r.node_id == leader.node_id)
        stalled["at"], stalled["node"] = time.monotonic(), rec.node_id
        stall(rec.agent_pid)
        also(client, keys)

    def during(proc) -> None:
        when(etcd_server.endpoint, proc, lambda c: clock.poll(c, keys) >= 3, stall_leader)
        client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
        try:
            while proc.poll() is None:
                clock.poll(client, keys)
                time.sleep(0.02)
        finally:
            client.close()

    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4", "--exit-grace", "5"],
        10,
        tiny_profile(tmp_path / "p.json"),
        rdzv=RDZV,
        env={**paced(1, 10, 0.5), **(env or {})},
        during=during,
        killed_by_test=killed,
    )
    assert_same(job, ref)
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    try:
        published = [ev.node for _, ev in read_events(client, keys) if ev.kind == "plan" and ev.generation > 1]
    finally:
        client.close()
    assert published and stalled["node"] not in published, published  # the stalled leader published nothing
    return out, clock, stalled["at"]


def _sigstop(seconds: float) -> Callable[[int], None]:
    def stall(pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(seconds, os.kill, (pid, signal.SIGCONT)).start()

    return stall


def _spin(pid: int) -> None:
    os.kill(pid, signal.SIGUSR2)  # OOBLECK_AGENT_SPIN: its main thread holds the GIL


def _check(out: str, clock: StepClock, at: float, what: str) -> None:
    gap, bound = clock.longest_wait_after(at), clock.bound(at)
    print(f"leader agent {what} for {3 * TTL_S:g} s: longest wait for a step {gap:.2f} s (bound {bound:.2f} s)")
    assert gap < bound, out[-6000:]
    # the survivors moved to generation 2 (told by the abandoned step, or by their own failed
    # communication when a follower died meanwhile: whichever comes first under load)
    assert re.search(r"gen 2 step \d+ node \S+ rank \d+: entered from generation 1", out), out[-6000:]
    assert "Timed out waiting" not in out  # nobody waited for the communication timeout
    assert "lease expired: this node sent no refresh for" in out  # the stalled agent came back fenced


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
def test_a_sigstopped_leader_agent_hands_over(tmp_path: Path, etcd_server, run_id) -> None:
    out, clock, at = _stall_the_leader(tmp_path, etcd_server, run_id, _sigstop(3 * TTL_S))
    _check(out, clock, at, "SIGSTOPped")


@pytest.mark.extended  # the default run stalls the leader's agent (SIGSTOP, a follower killed meanwhile)
def test_a_leader_agent_holding_the_gil_hands_over(tmp_path: Path, etcd_server, run_id) -> None:
    out, clock, at = _stall_the_leader(
        tmp_path, etcd_server, run_id, _spin, env={"OOBLECK_AGENT_SPIN": f"{3 * TTL_S:g}"}
    )
    _check(out, clock, at, "spinning with the GIL")


def test_a_node_dies_while_the_leader_agent_is_stalled(tmp_path: Path, etcd_server, run_id) -> None:
    """The shape of the original stall: a non-leader is SIGKILLed while the leader's agent is
    stopped. The survivors check in at the roll call, a deputy pings the silent leader, fences it
    and revokes its lease, and the next leader re-plans on the two nodes left (n0 = 2)."""
    from launcher.faults import kill_node
    from helpers import a_follower

    def kill_a_follower(client, keys) -> None:
        kill_node(a_follower(client, keys).agent_pid)

    out, clock, at = _stall_the_leader(
        tmp_path, etcd_server, run_id, _sigstop(3 * TTL_S), also=kill_a_follower, killed=1
    )
    _check(out, clock, at, "SIGSTOPped, a follower killed,")
