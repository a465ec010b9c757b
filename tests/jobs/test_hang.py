"""A hung worker on a live node (rendezvous/hang.py): its agent sees from the worker's local
heartbeat that its step thread makes no progress while not waiting for a peer (or that the whole
process stands still), records where it stands (its stacks, or that it is stopped) under
`errors` and as a `hang` event, and stops it; the agent restarts it and the job re-plans and ends
with the reference weights, well before comm_timeout_s."""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oobleck_elastic.config import FaultToleranceConfig
from oobleck_elastic.config.timing import comm_timeout, hang_bound, stall_report, typical_step
from oobleck_elastic.engine.resilience.faults import FaultInjector
from oobleck_elastic.engine.resilience.heartbeat import Heartbeat
from oobleck_elastic.engine.resilience.progress import Progress
from oobleck_elastic.records.heartbeat import Beat, read_beat
from oobleck_elastic.rendezvous.hang import HangWatch, overdue
from helpers import a_follower, assert_same, at_step, run_job, tiny_profile, worker_pid

ROOT = Path(__file__).resolve().parents[2]


def ft(**values) -> FaultToleranceConfig:
    return FaultToleranceConfig(**values)


@pytest.mark.parametrize(
    "in_step,progress,waiting,typical,floor,factor,bound",
    [
        (False, 0.0, 0.0, 1.0, 5.0, 10.0, None),  # idle
        (True, 96.0, 0.0, 1.0, 5.0, 10.0, None),  # still for 4 s: within max(5, 10 x 1)
        (True, 85.0, 0.0, 1.0, 5.0, 10.0, 10.0),  # still for 15 s: past the bound of 10 s
        (True, 85.0, 0.0, 0.0, 5.0, 10.0, 5.0),  # no step time yet: the floor
        (True, 0.0, 0.0, 1.0, 0.0, 10.0, None),  # the watch is off
        (True, 50.0, 60.0, 1.0, 5.0, 10.0, None),  # waiting for a peer since 60: not hung
        (True, 50.0, 0.0, 0.0, None, 10.0, None),  # auto: 120 s before a step was measured
        (True, 75.0, 0.0, 0.5, None, 10.0, None),  # auto: 30 s once steps are measured
        (True, 65.0, 0.0, 0.5, None, 10.0, 30.0),
        (True, 50.0, 0.0, 6.0, None, 10.0, None),  # auto: 10 x a 6 s step
    ],
)
def test_overdue(in_step, progress, waiting, typical, floor, factor, bound) -> None:
    """Standing still counts, not the step's length, and waiting for a peer is not standing still."""
    beat = Beat(1, in_step, 3, 0.0, typical_step_s=typical, progress=progress, waiting=waiting, written=99.9)
    assert overdue(beat, 100.0, ft(hang_floor_s=floor, hang_factor=factor)) == bound  # its main thread writes


def test_a_process_that_stopped_writing_is_hung_even_while_waiting() -> None:
    """A stopped or frozen process (SIGSTOP) writes nothing more: past the bound it is hung, even if
    its step thread was waiting for a peer when it stopped."""
    conf = ft(hang_floor_s=5.0, hang_factor=10.0)
    beat = Beat(1, True, 3, 0.0, typical_step_s=0.1, progress=90.0, waiting=90.0, written=90.0)
    assert overdue(beat, 96.0, conf) == 5.0
    assert overdue(beat, 94.0, conf) is None


def test_only_the_stuck_worker_stands_still() -> None:
    """One worker's step thread blocked (in a plain loop, or inside a collective wait whose handle
    completed) while its peers wait for it in calls that cannot complete without its part: the
    rule names it and none of them, as long as it stands still."""
    now, conf = 100.0, ft(hang_floor_s=3.0, hang_factor=2.0)

    def beat(progress: float, waiting: float) -> Beat:
        return Beat(1, True, 5, 80.0, typical_step_s=0.5, progress=progress, waiting=waiting, written=99.9)

    stuck = beat(progress=90.0, waiting=0.0)  # no progress since 90, not waiting for a peer
    peers = [beat(progress=91.0, waiting=91.0), beat(progress=90.5, waiting=90.5), beat(progress=92.0, waiting=92.0)]
    assert overdue(stuck, now, conf) == 3.0
    assert [overdue(p, now, conf) for p in peers] == [None, None, None]
    assert overdue(stuck, 92.9, conf) is None  # within the bound


def test_the_derived_clocks() -> None:
    """Auto values follow the typical step; explicit values override them (config/timing.py)."""
    auto = ft()
    assert typical_step([]) == 0.0 and typical_step([0.3, 9.0, 0.2, 0.4]) == 0.3
    assert hang_bound(auto, 0.0) == 120.0 and hang_bound(auto, 0.2) == 30.0 and hang_bound(auto, 6.0) == 60.0
    assert comm_timeout(auto, 0.0) == 300.0 and comm_timeout(auto, 0.2) == 120.0 and comm_timeout(auto, 6.0) == 180.0
    assert stall_report(auto, 0.0) == 1.0 and stall_report(auto, 2.5) == 2.5
    explicit = ft(hang_floor_s=20.0, comm_timeout_s=45.0, stall_report_s=0.0)
    assert hang_bound(explicit, 0.2) == 20.0 and hang_bound(explicit, 6.0) == 60.0
    assert comm_timeout(explicit, 3.0) == 45.0 and stall_report(explicit, 2.5) == 0.0
    off = ft(hang_floor_s=0.0)
    assert hang_bound(off, 6.0) is None and comm_timeout(off, 6.0) == 180.0  # the watch off: still 3 x 10 steps
    assert ft(hang_floor_s=-1.0).validate() and ft(comm_timeout_s=0.0).validate() and ft(stall_report_s=-1).validate()
    assert not ft().validate()


class Work:
    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def test_progress_marks_what_the_step_thread_does() -> None:
    progress = Progress()
    assert not progress.waits_for_a_peer()
    before = progress.count
    progress.timed(lambda: None)()
    assert progress.count == before + 2
    pending, done = Work(False), Work(True)
    with progress.waiting(pending, done):
        assert progress.waits_for_a_peer()  # one handle not complete: waiting for a peer
        pending.done = True
        assert not progress.waits_for_a_peer()  # complete, and the thread still here: standing still
    with progress.waiting():
        assert progress.waits_for_a_peer()  # a call with no handle: waiting
    assert not progress.waits_for_a_peer()


def test_the_heartbeat_file_round_trips(tmp_path: Path) -> None:
    progress = Progress()
    hb = Heartbeat(2, str(tmp_path), progress=progress)
    try:
        first = read_beat(tmp_path / "2.hb")
        assert first is not None and (first.pid, first.in_step, first.step) == (os.getpid(), False, -1)
        hb.begin(7)
        beat = read_beat(tmp_path / "2.hb")
        assert beat is not None and beat.in_step and beat.step == 7 and beat.waiting == 0.0
        time.sleep(0.01)
        hb.tick()  # the step thread did nothing: its progress stands still
        still = read_beat(tmp_path / "2.hb")
        assert still is not None and still.in_step and still.since == beat.since and still.progress == beat.progress
        progress.point()
        time.sleep(0.01)
        hb.tick()
        moved = read_beat(tmp_path / "2.hb")
        assert moved is not None and moved.progress > beat.progress and moved.waiting == 0.0
        assert moved.written >= moved.progress and still is not None and moved.written > still.written
        with progress.waiting(Work(False)):
            time.sleep(0.01)
            hb.tick()
            waiting = read_beat(tmp_path / "2.hb")
            assert waiting is not None and waiting.waiting > moved.progress
        hb.tick()
        assert (read_beat(tmp_path / "2.hb") or beat).waiting == 0.0
        hb.end(7)
        beat = read_beat(tmp_path / "2.hb")
        assert beat is not None and not beat.in_step and beat.typical_step_s > 0
        assert round(hb.typical_step_s, 3) == beat.typical_step_s
    finally:
        hb.close()
    assert Heartbeat(0, str(tmp_path / "missing"))._fd is None  # no directory: a no-op
    old = tmp_path / "old.hb"  # a six-field line (an older worker): not waiting
    old.write_text("12 step 3 10.000 0.500 11.000".ljust(95) + "\n")
    assert read_beat(old) == Beat(12, True, 3, 10.0, 0.5, 11.0, 0.0, 11.0)


def test_oobleck_block_at_is_parsed() -> None:
    assert FaultInjector.from_env({"OOBLECK_BLOCK_AT": "1@3, 2@4:comm"}).blocks == {(1, 3): "loop", (2, 4): "comm"}
    assert FaultInjector.from_env({"OOBLECK_BLOCK_AT": "1@3:loop"}).blocks == {(1, 3): "loop"}
    restarted = {"OOBLECK_BLOCK_AT": "1@3", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert FaultInjector.from_env(restarted).blocks == {}
    for bad in ("1@3:wait", "1:3", "x@3"):
        with pytest.raises(ValueError) as err:
            FaultInjector.from_env({"OOBLECK_BLOCK_AT": bad})
        assert str(err.value) == (
            f"OOBLECK_BLOCK_AT={bad!r}: each item must be RANK@STEP[:WHERE] with WHERE loop or comm, e.g. 1@3:comm"
        )
    faults = FaultInjector.from_env({"OOBLECK_BLOCK_AT": "1@3"})
    faults.block(rank=1, step=3, where="comm")  # another place: no block
    faults.block(rank=0, step=3, where="loop")
    faults.disarm()
    faults.block(rank=1, step=3, where="loop")  # disarmed after a broken generation: no block


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
            ft=ft(hang_floor_s=0.5, hang_factor=10.0),
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


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
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
        during=at_step(etcd_server.endpoint, keys, 4, stop_a_worker),
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
    done = [at for at, step in _step_times(out) if step > stopped["step"] + 1]
    assert done and min(done) - stopped["at"] < 25, (min(done) - stopped["at"], out[-3000:])
    print(f"SIGSTOP -> next step: {min(done) - stopped['at']:.2f} s")
    assert_same(job, ref)


def _step_times(out: str) -> list[tuple[float, int]]:
    """(log time, step) of every completed step in a job's output."""
    found = []
    for line in out.splitlines():
        m = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO gen \d+ step (\d+)/\d+ node", line)
        if m:
            found.append((datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), int(m.group(2))))
    return found


def _a_stuck_step_is_cut_off(tmp_path: Path, etcd_server, run_id: str, where: str) -> None:
    """OOBLECK_BLOCK_AT=1@4:WHERE blocks rank 1's step thread in step 5 while its main thread runs
    on: its agent finds that the step thread makes no progress (its peers wait for it in their
    communication calls), records its stacks, withdraws its readiness and stops it; the job goes
    on within the bound (3 s) + a re-plan, not at comm_timeout_s (30 s), with the reference weights."""
    from oobleck_elastic.etcd import EtcdSettings, connect
    from oobleck_elastic.records.keys import Keys
    from oobleck_elastic.rendezvous.membership import read_events

    profile = tiny_profile(tmp_path / "profile.json")
    keys = Keys("/oobleck", run_id)
    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4"],
        12,
        profile,
        extra=["fault_tolerance.hang_floor_s=3", "fault_tolerance.hang_factor=2"],
        env={"OOBLECK_BLOCK_AT": f"1@4:{where}"},
    )
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    try:
        hangs = [ev for _, ev in read_events(client, keys) if ev.kind == "hang"]
        errors = client.get_json(keys.errors)[0]
    finally:
        client.close()
    assert len(hangs) == 1, (hangs, out[-4000:])  # only the stuck worker: its peers waited for it
    node = hangs[0].node
    assert f"node {node}: worker 0 (pid" in out and "its step thread has made no progress in step" in out, out[-4000:]
    assert errors["error"].startswith(f"WorkerHung: worker 0 of node {node} hung in step")
    assert "_blocked_step_thread" in errors["traceback"], errors["traceback"]  # its stacks, from faulthandler
    # the blocked step: 5 (loop: nobody completes it) or 6 (comm: rank 1 posted step 5's commit)
    stuck = 5 if where == "loop" else 6
    times = _step_times(out)
    before = max(t for t, s in times if s == stuck - 1)
    after = min(t for t, s in times if s == stuck)
    assert after - before < 25, (after - before, out[-3000:])  # comm_timeout_s is 30 s here
    print(f"OOBLECK_BLOCK_AT {where}: step {stuck - 1} -> step {stuck}: {after - before:.2f} s")
    assert_same(job, ref)


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
@pytest.mark.slow
def test_a_step_thread_stuck_in_a_plain_loop_is_cut_off(tmp_path: Path, etcd_server, run_id) -> None:
    _a_stuck_step_is_cut_off(tmp_path, etcd_server, run_id, "loop")


@pytest.mark.slow
def test_a_step_thread_stuck_inside_a_collective_wait_is_cut_off(tmp_path: Path, etcd_server, run_id) -> None:
    _a_stuck_step_is_cut_off(tmp_path, etcd_server, run_id, "comm")


@pytest.mark.extended  # two minutes of waiting; tests/worlds/test_comm_timeout.py covers the mechanism
@pytest.mark.slow
def test_a_stuck_step_in_generation_1_is_cut_off_at_the_derived_comm_timeout(
    tmp_path: Path, etcd_server, run_id
) -> None:
    """The hang watch off and the communication timeout auto: rank 1's step thread blocks at step 5
    of generation 1 (OOBLECK_BLOCK_AT=1@4) and its peers wait for it in their communication calls.
    They derived the timeout from their first steps (300 s -> 120 s, a line says so), so they are
    cut off after 120 s, not the 300 s of a job that has measured nothing, and the job re-plans and
    ends with the reference weights."""
    profile = tiny_profile(tmp_path / "profile.json")
    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "2"],
        8,
        profile,
        extra=["fault_tolerance.hang_floor_s=0", "fault_tolerance.comm_timeout_s=null"],
        env={"OOBLECK_BLOCK_AT": "1@4"},
    )
    assert "communication timeout 300 s -> 120 s: the first steps were measured" in out, out[-4000:]
    times = _step_times(out)
    before = max(t for t, s in times if s == 4)
    after = min(t for t, s in times if s == 5)
    assert 110 < after - before < 250, (after - before, out[-3000:])  # 120 s and a re-plan, not 300 s
    print(f"stuck step 5 of generation 1: step 4 -> step 5: {after - before:.2f} s")
    assert_same(job, ref)
