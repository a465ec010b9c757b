"""etcd unavailability up to `EtcdSettings.outage_s` costs nothing: a client retries across a
stalled (SIGSTOPped) server and a server killed and restarted on the same port and data dir,
fails over between the members given as a list, and gives one clear error past the bound."""

from __future__ import annotations

import os
import re
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from oobleck_elastic.etcd import EtcdError, EtcdSettings, connect

from helpers import stall_process


@pytest.mark.core
def test_requests_ride_out_a_stalled_server(own_etcd, caplog) -> None:
    client = connect(EtcdSettings(endpoint=own_etcd.endpoint, timeout_s=1.0, outage_s=20.0))
    try:
        client.put_json("/t/a", {"v": 1})
        t0 = time.monotonic()
        stall = stall_process(own_etcd.pid, 4.0)
        time.sleep(0.2)
        client.put_json("/t/a", {"v": 2})  # blocks in retries until the server answers again
        assert client.get_json("/t/a")[0] == {"v": 2}
        assert time.monotonic() - t0 >= 3.5
        stall.join()
        messages = [r.getMessage() for r in caplog.records]
        assert sum("is unreachable" in m for m in messages) == 1 and any("reachable again" in m for m in messages)
    finally:
        client.close()


@pytest.mark.core
def test_requests_ride_out_a_restart_on_the_same_port_and_data_dir(own_etcd, tmp_path: Path) -> None:
    client = connect(EtcdSettings(endpoint=own_etcd.endpoint, timeout_s=1.0, outage_s=30.0))
    try:
        client.put_json("/t/b", {"v": 1})
        port = own_etcd.port
        own_etcd.stop()

        def restart() -> None:
            time.sleep(3.0)
            own_etcd.port = port
            own_etcd.start()

        t = threading.Thread(target=restart, daemon=True)
        t.start()
        assert client.get_json("/t/b")[0] == {"v": 1}  # the data dir kept it
        t.join()
    finally:
        client.close()


@pytest.mark.core
def test_an_outage_longer_than_the_bound_is_one_clear_error(own_etcd) -> None:
    client = connect(EtcdSettings(endpoint=own_etcd.endpoint, timeout_s=0.5, outage_s=2.0))
    try:
        stall = stall_process(own_etcd.pid, 5.0)
        time.sleep(0.2)
        t0 = time.monotonic()
        with pytest.raises(EtcdError, match=r"has been unreachable for more than 2 s"):
            client.get_json("/t/c")
        assert time.monotonic() - t0 < 5.0
        stall.join()
    finally:
        client.close()


def test_a_list_of_members_fails_over_to_one_that_answers(own_etcd) -> None:
    from oobleck_elastic.etcd.server import free_port

    dead = f"127.0.0.1:{free_port()}"
    client = connect(EtcdSettings(endpoint=f"{dead},{own_etcd.endpoint}", timeout_s=1.0, outage_s=10.0))
    try:
        for i in range(6):  # whichever member a request starts on, it ends on the live one
            client.put_json("/t/d", {"v": i})
            assert client.get_json("/t/d")[0] == {"v": i}
    finally:
        client.close()


def _job_through(tmp_path: Path, own_etcd, run_id: str, outage, steps: int = 20) -> tuple[str, dict, dict, list]:
    """A 4-node job (lease TTL 2 s) that has `outage(proc)` done to its etcd once it reached step
    3; returns (log, job weights, reference weights, the events in etcd after the job)."""
    from helpers import run_job, tiny_profile, when
    from oobleck_elastic.records.keys import Keys
    from oobleck_elastic.rendezvous.membership import read_events

    keys = Keys("/oobleck", run_id)
    profile = tiny_profile(tmp_path / "profile.json")

    hit: list[int] = []  # the step reported when the outage began

    def begin(c) -> None:
        hit.append((c.get_json(keys.progress)[0] or {}).get("step", 0))
        outage(proc_of[0])

    proc_of: list = []

    def during(proc) -> None:
        proc_of.append(proc)
        when(own_etcd.endpoint, proc, lambda c: (c.get_json(keys.progress)[0] or {}).get("step", 0) >= 3, begin)

    out, job, ref = run_job(
        tmp_path,
        own_etcd,
        run_id,
        ["--nodes", "4"],
        steps,
        profile,
        during=during,
        rdzv="lease_ttl=2,settle=0.2,last_call_timeout=1,etcd_outage=30",
    )
    # the fault was done, to a job that still had steps to run
    assert len(hit) == 1 and 3 <= hit[0] < steps, (hit, out[-3000:])
    client = connect(EtcdSettings(endpoint=own_etcd.endpoint))
    try:
        events = [ev for _, ev in read_events(client, keys)]
    finally:
        client.close()
    return out, job, ref, events


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
@pytest.mark.slow
def test_a_job_rides_out_a_stalled_etcd(tmp_path: Path, own_etcd, run_id) -> None:
    """etcd SIGSTOPped for 6 s (three lease TTLs) during a 4-node job: every lease expires the
    moment etcd resumes, but the nodes renew their membership and the leader holds its re-plan,
    so the job ends with the reference weights in its first generation, no node lost."""
    from helpers import assert_same

    window: list[float] = []

    def stall(proc) -> None:
        window.append(time.time())
        stall_process(own_etcd.pid, 6.0).join()
        window.append(time.time())

    out, job, ref, events = _job_through(tmp_path, own_etcd, run_id, stall)
    assert_same(job, ref)
    # training went on while etcd was stopped: steps were logged inside the stall
    stamps = [
        datetime.strptime(m, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for m in re.findall(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO gen \d+ step \d+/\d+", out)
    ]
    assert sum(window[0] + 0.5 < t < window[1] - 0.5 for t in stamps) >= 1, (window, stamps)
    plans = [ev for ev in events if ev.kind == "plan"]
    assert [ev.generation for ev in plans] == [1], [ev.line() for ev in events]
    assert not [ev for ev in events if ev.kind == "lost"], [ev.line() for ev in events]
    assert len([ev for ev in events if ev.kind == "renew"]) >= 1, [ev.line() for ev in events]


@pytest.mark.slow
@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
def test_a_job_rides_out_the_loss_of_the_etcd_leader_member(tmp_path: Path, run_id) -> None:
    """A 3-member etcd cluster given as `--rdzv-endpoint h1,h2,h3`; its raft leader member is
    SIGKILLed during a 4-node job: the members elect a new leader, the clients fail over and the
    watches resume on another member, and the job ends with the reference weights in its first
    generation, no node lost."""
    import signal
    from types import SimpleNamespace

    from helpers import assert_same
    from oobleck_elastic.etcd.server import start_cluster

    members = start_cluster(3, str(tmp_path / "etcd"), extra_args=["--unsafe-no-fsync"])
    killed: list[str] = []
    try:
        cluster = SimpleNamespace(endpoint=",".join(m.endpoint for m in members))

        def kill_the_leader_member(proc) -> None:
            client = connect(EtcdSettings(endpoint=cluster.endpoint))
            try:
                name = client.cluster_leader()
            finally:
                client.close()
            victim = next(m for m in members if m.name == name)
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(name)

        out, job, ref, events = _job_through(tmp_path, cluster, run_id, kill_the_leader_member)
        assert killed, "the etcd leader member was never killed"
        assert_same(job, ref)
        assert [ev.generation for ev in events if ev.kind == "plan"] == [1], "\n".join(ev.line() for ev in events)
        assert not [ev for ev in events if ev.kind == "lost"], [ev.line() for ev in events]
    finally:
        for member in members:
            member.stop()


@pytest.mark.slow
def test_a_job_rides_out_an_etcd_restart(tmp_path: Path, own_etcd, run_id) -> None:
    """etcd SIGKILLed and restarted 3 s later on the same port and data dir during a 4-node job:
    etcd restores the leases (with a fresh TTL), every client retries and every watch resumes from
    its last revision, and the job ends with the reference weights in its first generation."""
    import signal

    from helpers import assert_same

    def restart(proc) -> None:
        port = own_etcd.port
        os.kill(own_etcd.pid, signal.SIGKILL)
        own_etcd.stop()  # reaps it; the data dir was given, so it stays
        time.sleep(3.0)
        own_etcd.port = port
        own_etcd.start()

    pids: list[int] = []
    out, job, ref, events = _job_through(
        tmp_path, own_etcd, run_id, lambda proc: (pids.append(own_etcd.pid), restart(proc), pids.append(own_etcd.pid))
    )
    assert len(pids) == 2 and pids[0] != pids[1], pids  # a new etcd process served the rest of the job
    assert_same(job, ref)
    assert [ev.generation for ev in events if ev.kind == "plan"] == [1], "\n".join(ev.line() for ev in events)
    assert not [ev for ev in events if ev.kind == "lost"], [ev.line() for ev in events]
