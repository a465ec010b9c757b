"""A hung worker on a live node (rendezvous/hang.py): its agent sees from the worker's local
heartbeat that a step has run too long, records where it stands (its stacks, or that it is
stopped) under `errors` and as a `hang` event, and stops it; the agent restarts it and the job
re-plans and ends with the reference weights, well before comm_timeout_s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oobleck_elastic.records.heartbeat import Beat, read_beat
from oobleck_elastic.engine.resilience.heartbeat import Heartbeat
from oobleck_elastic.rendezvous.hang import HangWatch, overdue
from helpers import a_follower, assert_same, run_job, tiny_profile, when, worker_pid

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "in_step,tick,last,floor,factor,bound",
    [
        (False, 0.0, 1.0, 5.0, 10.0, None),  # idle
        (True, 96.0, 1.0, 5.0, 10.0, None),  # still for 4 s: within max(5, 10 x 1)
        (True, 85.0, 1.0, 5.0, 10.0, 10.0),  # still for 15 s: past the bound of 10 s
        (True, 85.0, 0.0, 5.0, 10.0, 5.0),  # no step time yet: the floor
        (True, 0.0, 1.0, 0.0, 10.0, None),  # the watch is off
    ],
)
def test_overdue(in_step, tick, last, floor, factor, bound) -> None:
    """Standing still counts, not the step's length: a step begun long ago that ticks is fine."""
    beat = Beat(pid=1, in_step=in_step, step=3, since=0.0, last_step_s=last, tick=tick)
    assert overdue(beat, 100.0, floor_s=floor, factor=factor) == bound


def test_the_heartbeat_file_round_trips(tmp_path: Path) -> None:
    hb = Heartbeat(2, str(tmp_path))
    try:
        first = read_beat(tmp_path / "2.hb")
        assert first is not None and (first.pid, first.in_step, first.step) == (os.getpid(), False, -1)
        hb.begin(7)
        beat = read_beat(tmp_path / "2.hb")
        assert beat is not None and beat.in_step and beat.step == 7
        time.sleep(0.01)
        hb.tick()
        ticked = read_beat(tmp_path / "2.hb")
        assert ticked is not None and ticked.in_step and ticked.since == beat.since and ticked.tick > beat.tick
        hb.end(7)
        beat = read_beat(tmp_path / "2.hb")
        assert beat is not None and not beat.in_step and beat.last_step_s >= 0
    finally:
        hb.close()
    assert Heartbeat(0, str(tmp_path / "missing"))._fd is None  # no directory: a no-op


HUNG = """
import sys, threading, time
from oobleck_elastic.engine.resilience.heartbeat import Heartbeat
hb = Heartbeat(0, sys.argv[1])
def stuck_in_a_kernel():
    time.sleep(3600)
hb.begin(4)
t = threading.Thread(target=stuck_in_a_kernel, name="oobleck-step")
t.start()
print("ready", flush=True)
t.join()
"""


def test_a_hung_process_is_asked_for_its_stacks_recorded_and_killed(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", HUNG, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        found: list[tuple[int, int, float, str]] = []
        watch = HangWatch(
            tmp_path,
            floor_s=0.5,
            factor=10.0,
            node="node9",
            record=lambda beat, lr, bound, stack: found.append((beat.pid, lr, bound, stack)),
            interval_s=0.1,
        ).start()
        assert proc.wait(timeout=20) == -signal.SIGKILL
        watch.stop()
        assert len(found) == 1 and found[0][:3] == (proc.pid, 0, 0.5)
        assert "stuck_in_a_kernel" in found[0][3], found[0][3]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_stopped_worker_on_a_live_node_is_cut_off(tmp_path: Path, etcd_server, run_id) -> None:
    """SIGSTOP one worker process (its agent runs on): with hang_floor_s=3 its agent stops it (and
    only it: its peers wait for it, but they tick), the job re-plans and goes on long before
    comm_timeout_s (30 s here), with the reference weights."""
    from oobleck_elastic.etcd import EtcdSettings, connect
    from oobleck_elastic.records.keys import Keys
    from oobleck_elastic.rendezvous.membership import read_events

    profile = tiny_profile(tmp_path / "profile.json")
    keys = Keys("/oobleck", run_id)
    stopped: dict[str, float] = {}

    def stop_a_worker(client) -> None:
        rec = a_follower(client, keys)
        os.kill(worker_pid(rec.agent_pid), signal.SIGSTOP)
        stopped.update(node=rec.node_id, at=time.time(), step=(client.get_json(keys.progress)[0] or {})["step"])

    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4"],
        12,
        profile,
        extra=["fault_tolerance.hang_floor_s=3", "fault_tolerance.hang_factor=2"],
        during=lambda proc: when(
            etcd_server.endpoint,
            proc,
            lambda c: (c.get_json(keys.progress)[0] or {}).get("step", 0) >= 4,
            stop_a_worker,
        ),
    )
    assert f"node {stopped['node']}: worker 0 (pid" in out and "(no stack: the process is stopped" in out, out[-4000:]
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    try:
        hangs = [ev for _, ev in read_events(client, keys) if ev.kind == "hang"]
        errors = client.get_json(keys.errors)[0]
    finally:
        client.close()
    assert [ev.node for ev in hangs] == [stopped["node"]]
    assert errors["error"].startswith(f"WorkerHung: worker 0 of node {stopped['node']} hung in step")
    assert "stopped" in errors["traceback"]
    # the step after the stop completed within the bound + a re-plan, not after comm_timeout_s (30 s)
    import datetime
    import re

    done = [
        datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for m in (
            re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO gen \d+ step (\d+)/12 node", ln)
            for ln in out.splitlines()
        )
        if m and int(m.group(2)) > stopped["step"] + 1
    ]
    assert done and min(done) - stopped["at"] < 25, (min(done) - stopped["at"], out[-3000:])
    print(f"SIGSTOP -> next step: {min(done) - stopped['at']:.2f} s")
    assert_same(job, ref)
