"""`oobleck stop` over etcd: the request a job's workers read at their step boundaries, said once,
and refused in words on a job that already closed; what a worker's control plane reads of it; and
the local launcher's answer to a first and a second Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from oobleck_elastic import cluster_ops
from oobleck_elastic.etcd import connect
from oobleck_elastic.records.job import ClosedRecord
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.records.read import read_stop
from oobleck_elastic.rendezvous.worker import WorkerContext
from launcher.stopping import Interrupt


def test_oobleck_stop_asks_once_and_names_a_closed_job(etcd_settings, run_id: str) -> None:
    client, keys = connect(etcd_settings), Keys("/oobleck", run_id)
    try:
        client.put(keys.root + "leader", "x")  # the run exists
        ctx = WorkerContext(client=client, keys=keys, node_id="node0", local_rank=0)
        assert ctx.stop_requested() is None
        said = cluster_ops.stop_job(client, keys, "maintenance")
        assert said == (
            f"run '{run_id}' stops at its next step boundary: the step in flight is finished and saved as a "
            "checkpoint, then every node exits 0 (`oobleck outcome` says when it closed)"
        )
        stop = read_stop(client, keys)
        assert stop is not None and stop.reason == "maintenance" and abs(stop.time - time.time()) < 60
        assert ctx.stop_requested() == "maintenance"
        again = cluster_ops.stop_job(client, keys, "another reason")
        assert again.startswith(f"run '{run_id}' was already asked to stop at ") and "(maintenance)" in again
        assert read_stop(client, keys) == stop  # the first request stands
        client.put(keys.closed, json.dumps(ClosedRecord(time=time.time(), reason="finished 5 steps").to_json()))
        assert cluster_ops.stop_job(client, keys, "late") == f"run '{run_id}' is already closed (finished 5 steps)"
    finally:
        client.delete_prefix(keys.root)
        client.close()


def test_the_cli_asks_the_run_to_stop(etcd_settings, run_id: str) -> None:
    client, keys = connect(etcd_settings), Keys("/oobleck", run_id)
    try:
        client.put(keys.root + "leader", "x")
        cli = [sys.executable, "-m", "oobleck_elastic.cli", "stop", "--endpoint", etcd_settings.endpoint]
        done = subprocess.run(
            [*cli, "--run-id", run_id, "--reason", "end of the reservation"], capture_output=True, text=True
        )
        assert done.returncode == 0 and done.stdout.startswith(f"run '{run_id}' stops at its next step boundary")
        stop = read_stop(client, keys)
        assert stop is not None and stop.reason == "end of the reservation"
    finally:
        client.delete_prefix(keys.root)
        client.close()


def test_a_first_ctrl_c_asks_the_job_to_stop_and_a_second_stops_every_node() -> None:
    said: list[str] = []
    interrupt = Interrupt(grace_s=60.0, checkpoint_dir=None, say=said.append)
    assert not interrupt.received(signal.SIGINT)  # no node runs yet: nothing to stop gently
    assert said == ["SIGINT: stopping every node now"] and interrupt.signal is None
    interrupt.running = True
    assert interrupt.received(signal.SIGINT) and interrupt.signal is signal.SIGINT
    assert said[-1].startswith(
        "Ctrl-C (SIGINT): the job stops at its next step boundary and saves that step (up to 60s"
    )
    assert not interrupt.received(signal.SIGINT)
    assert said[-1] == "SIGINT: stopping every node now"
