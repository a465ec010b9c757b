"""Real torchrun processes on localhost with the oobleck backend (examples/probe.py as the
worker, launched by launcher.local): three nodes rendezvous, a fourth joins and is admitted
without restarting anyone, one node is SIGKILLed and its record vanishes within TTL + 1 s and
the leader re-plans without it, and `kill-agent` drains another node whose agent exits 0."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from oobleck_elastic import cluster_ops
from oobleck_elastic.etcd import EtcdSettings, connect
from oobleck_elastic.planning import Plan
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.rendezvous.membership import live_nodes, read_events

ROOT = Path(__file__).resolve().parents[2]
TTL = 2.0

pytestmark = pytest.mark.slow


def test_join_kill_and_drain_under_torchrun(etcd_server, run_id) -> None:
    cmd = [
        sys.executable,
        "-m",
        "launcher.local",
        "-v",  # every node line: this reads them
        "--nodes",
        "3",
        "--join",
        "3",
        "--kill",
        "1@70",  # 13 s of steps after the join at step 3: the joiner is planned first even on a busy machine
        "--endpoint",
        etcd_server.endpoint,
        "--run-id",
        run_id,
        "--rdzv-conf",
        f"lease_ttl={TTL},settle=0.2,last_call_timeout=0.5",
        "--",
        "examples/probe.py",
        "--config",
        "configs/gpt2-tiny.yaml",
        "--steps",
        "110",
        "--step-time",
        "0.2",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(
        target=lambda: lines.extend((time.monotonic(), line) for line in proc.stdout), daemon=True
    )
    reader.start()
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    keys = Keys("/oobleck", run_id)
    vanished_at = None
    victim = None
    node_of_pid: dict[int, str] = {}
    drained = None
    counts = []
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            nodes = live_nodes(client, keys)
            killed = next((line for _, line in lines if "[launcher] killed node 1" in line), None)
            if killed is None:
                node_of_pid.update((r.agent_pid, r.node_id) for r in nodes)
            elif victim is None:  # "... (SIGKILL to pids <agent>, ...)"
                victim = node_of_pid[int(killed.split("SIGKILL to pids ")[1].split(",")[0].split(")")[0])]
            if victim is not None and vanished_at is None and victim not in {r.node_id for r in nodes}:
                vanished_at = time.monotonic()  # its lease expired, or a deputy revoked a dead leader's
            counts.append(len(nodes))
            data, _ = client.get_json(keys.plan)
            generation = data.get("generation", 0) if isinstance(data, dict) else 0
            if generation >= 3 and drained is None:  # after the kill's re-plan: drain the late joiner
                target = max(nodes, key=lambda r: r.index)  # the node that joined late
                drained = target.node_id
                cluster_ops.kill_agent(client, keys, target.index)
            time.sleep(0.05)
        rc = proc.wait(timeout=60)
        reader.join(10)
        out = "".join(line for _, line in lines)
        assert rc == 0, out[-4000:]

        killed_at = next(t for t, line in lines if "[launcher] killed node 1" in line)
        assert vanished_at is not None and vanished_at - killed_at <= TTL + 1.0, out[-3000:]

        plans = [ev for _, ev in read_events(client, keys) if ev.kind == "plan"]
        sizes = [int(ev.detail.split()[0]) for ev in plans]
        assert sizes[:3] == [3, 4, 3], [ev.line() for ev in plans]  # start, join, kill
        assert sizes[3] == 2 and "drain" in plans[3].detail, [ev.line() for ev in plans]
        kinds = [ev.kind for _, ev in read_events(client, keys)]
        # one node lost (a dead leader also has the deputy's event, with its revoked lease)
        lost = [ev for _, ev in read_events(client, keys) if ev.kind == "lost"]
        assert len({ev.node for ev in lost}) == 1 and "drain" in kinds, [ev.line() for ev in lost]

        # nobody was restarted: one PID per worker, restart count 0
        probes = list(client.get_prefix_json(keys.probes))
        workers = {k.rsplit("/", 1)[0] for k, _ in probes}
        assert len(probes) == len(workers) == 4, probes
        assert all(v["restart_count"] == 0 for _, v in probes)
        assert "Stopping worker group" not in out and "will restart worker group" not in out
        assert f"exiting 0: node {drained} was drained" in out
        final = Plan.from_json(client.get_json(keys.plan)[0])
        assert drained not in final.nodes and len(final.nodes) == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        client.close()
