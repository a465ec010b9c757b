"""Invariants 1-2 through a real node failure: four torchrun nodes train two 2-stage pipelines,
one node is SIGKILLed mid-run, the survivors re-plan into one 3-stage pipeline in-process (no
worker restarts), receive the layers they newly own with their AdamW state from surviving
holders, settle the interrupted step, and finish with the same weights as one process (under
1F1B, and under zero-bubble, interleaved 1F1B and zbv)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from oobleck_elastic.checkpoint import latest_checkpoint, load_model_state, read_manifest
from oobleck_elastic.etcd import EtcdSettings, connect
from oobleck_elastic.logs import read_event_lines
from oobleck_elastic.records.goodput import Category, Ledger
from helpers import (
    a_follower,
    assert_same,
    at_step,
    overrides,
    paced,
    run_job,
    single_process_reference,
    tensorboard_run,
    tiny_profile,
    when,
    worker_pid,
)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.mark.core
def test_kill_one_node_of_four_matches_reference(tmp_path: Path, etcd_server, run_id) -> None:
    steps, kill_at = 8, 3
    profile = tiny_profile(tmp_path / "profile.json")
    ref = single_process_reference(tmp_path / "ref", steps, profile, [])
    # a custom key prefix: the launcher must watch the nodes' keys to kill node 1 at step 3
    cmd = [
        sys.executable,
        "-m",
        "launcher.local",
        "-v",  # every node line: this reads them
        "--nodes",
        "4",
        "--kill",
        f"1@{kill_at}",
        "--endpoint",
        etcd_server.endpoint,
        "--run-id",
        run_id,
        "--rdzv-conf",
        "lease_ttl=2,settle=0.2,last_call_timeout=1,key_prefix=/custom-prefix",
        "--",
        "examples/train.py",
        "--config",
        "configs/gpt2-tiny.yaml",
        *overrides(tmp_path / "job", steps, profile),
    ]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    out = res.stdout
    assert res.returncode == 0, out[-5000:] + res.stderr[-2000:]
    assert "[launcher] killed node 1" in out
    # the survivors saw the failure in a collective, or the leader found the dead agent first (its
    # liveness socket) and they abandoned the step for the new plan
    assert ("communication failed" in out or "step abandoned" in out) and "entered from generation 1" in out, out[
        -4000:
    ]
    assert "Stopping worker group" not in out and "restart" not in out.lower().replace("restarts=", "")
    manifest = read_manifest(latest_checkpoint(tmp_path / "job" / "ckpt"))
    assert manifest["step"] == steps and manifest["plan"]["generation"] == 2
    assert len(manifest["plan"]["nodes"]) == 3
    moved = [line for line in out.splitlines() if "entered from generation 1" in line and " 0 layer bytes" not in line]
    assert moved, "some survivor must have received layers"
    job = load_model_state(tmp_path / "job" / "ckpt")
    for key in ref:
        torch.testing.assert_close(job[key], ref[key], rtol=1e-5, atol=1e-6, msg=key)
    ea = EventAccumulator(str(tensorboard_run(tmp_path / "job" / "runs")), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    gens = ea.Scalars("cluster/generation")
    assert sorted({e.value for e in gens}) == [1, 2]
    assert ea.Tags()["tensors"] and any("reconfiguration" in t for t in ea.Tags()["tensors"])
    text = ea.Tensors("reconfiguration/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "generation 1 -> 2 (failure: -node" in text and "after the failure was seen here" in text, text
    # samples/s at the first step of generation 2 is over the wall time since the previous step
    # completed: the broken step, the reconfiguration and the replay, not the replay alone
    first = min(e.step for e in gens if e.value == 2)
    at = {
        tag: next(e.value for e in ea.Scalars(tag) if e.step == first)
        for tag in (
            "Throughput/wall_s",
            "Throughput/step_time_s",
            "Throughput/samples_per_s",
            "reconfiguration/bytes_moved_job",
            "reconfiguration/seconds_until_all_entered",
        )
    }
    assert at["Throughput/wall_s"] > at["Throughput/step_time_s"], at
    sps = at["Throughput/samples_per_s"]
    assert abs(sps - 16 / at["Throughput/wall_s"]) < 1e-3 * sps, at
    # the job-level figures: every worker's bytes (sent plus received, each byte counted at both
    # ends) sum to twice the job's; the window from the first worker beginning to enter to the last
    # one entered holds every worker's own entry, and rank 0 waited through it since its last step
    entries = [
        re.search(r"entered from generation 1 \(.*?, (\d+) layer bytes moved, ([\d.]+) s\)", line)
        for line in out.splitlines()
    ]
    entries = [m for m in entries if m is not None]
    assert len(entries) == 3, out[-4000:]  # the three survivors
    assert at["reconfiguration/bytes_moved_job"] == pytest.approx(sum(int(m.group(1)) for m in entries) / 2, rel=1e-6)
    assert at["reconfiguration/bytes_moved_job"] > 0
    window = at["reconfiguration/seconds_until_all_entered"]
    assert max(float(m.group(2)) for m in entries) - 0.001 <= window < at["Throughput/wall_s"], (entries, at)
    # TensorBoard's step is the progress line's: the first step of generation 2 is "gen 2 step N/8"
    assert f"gen 2 step {first}/{steps} " in out, out[-4000:]


# these take turns in CI (extended): the feature matrix (tests/jobs/test_matrix.py) kills a node
# under every schedule at every landing, and tests/worlds/test_engine_schedules.py runs each schedule
@pytest.mark.parametrize(
    "schedule, chunks, planned",
    [
        pytest.param("zero-bubble", 1, (1, 1), marks=pytest.mark.extended),
        pytest.param("interleaved-1f1b", "auto", (3, 2), marks=pytest.mark.extended),
        pytest.param("zero-bubble", 2, (2, 2), marks=pytest.mark.extended),
        pytest.param("zbv", "auto", (2, 2), marks=pytest.mark.extended),
    ],
)
def test_kill_one_node_of_four_under_other_schedules_matches_reference(
    tmp_path: Path, etcd_server, run_id, schedule: str, chunks: object, planned: tuple[int, int]
) -> None:
    """The same failure under planning.schedule=zero-bubble (two 2-stage ZB-H1 pipelines become
    one 3-stage one), interleaved-1f1b (two pipelines of 2 devices holding 3 one-layer chunks
    each become one of 3 devices holding 2), zero-bubble with 2 chunks per device and zbv (2
    chunks, the V: device 0 holds the first and the last layers): the survivors re-plan
    in-process, receive the non-contiguous layers they newly own, and end with the
    single-process weights."""
    from oobleck_elastic.planning import Plan
    from oobleck_elastic.records.keys import Keys

    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4", "--kill", "1@3"],
        8,
        tiny_profile(tmp_path / "profile.json"),
        extra=[f"planning.schedule={schedule}", f"planning.chunks_per_device={chunks}"],
    )
    assert "[launcher] killed node 1" in out and "entered from generation 1" in out, out[-4000:]
    assert "Stopping worker group" not in out and "restart" not in out.lower().replace("restarts=", "")
    client, keys = connect(EtcdSettings(endpoint=etcd_server.endpoint)), Keys("/oobleck", run_id)
    try:
        plans = [Plan.from_json(client.get_json(keys.plan_at(g))[0]) for g in (1, 2)]
    finally:
        client.close()
    assert [[(p.schedule, len(p.stages), p.num_chunks) for p in plan.pipelines] for plan in plans] == [
        [(schedule, 2, planned[0]), (schedule, 2, planned[0])],
        [(schedule, 3, planned[1])],
    ]
    assert read_manifest(latest_checkpoint(tmp_path / "job" / "ckpt"))["plan"]["generation"] == 2
    assert_same(job, ref)


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
def test_join_then_drain_at_step_boundaries(tmp_path: Path, etcd_server, run_id) -> None:
    """A 4th node joins a 3-node job (admitted at a step boundary, layers copied to it), then a
    node is drained with `oobleck kill-agent` (leaves at a boundary, its agent exits 0)."""
    from oobleck_elastic import cluster_ops
    from oobleck_elastic.records.keys import Keys

    profile = tiny_profile(tmp_path / "profile.json")
    keys = Keys("/oobleck", run_id)

    def drain_after_join(proc) -> None:  # once the joiner trains in generation 2, drain node1
        when(
            etcd_server.endpoint,
            proc,
            lambda c: (c.get_json(keys.progress)[0] or {}).get("generation", 0) >= 2,
            lambda c: cluster_ops.kill_agent(c, keys, 1),
        )

    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "3", "--join", "1"],
        30,
        profile,
        during=drain_after_join,
        env=paced(1, 30, 1.5),  # 43 s or more: the join and then the drain land while the job runs
    )
    assert "entered from generation 1" in out and "entered from generation 2" in out, out[-4000:]
    assert "node node1 was drained" in out and "communication failed" not in out, out[-4000:]
    assert "rank 3: entered from generation 1" in out  # the joiner received its layers
    # each reconfiguration says its cause and the nodes involved (log and TensorBoard text)
    assert "generation 1 -> 2 (join: +node3)" in out and "generation 2 -> 3 (drain: -node1)" in out, out[-4000:]
    assert "Stopping worker group" not in out
    assert_same(job, ref)


def test_draining_the_last_holders_of_layers_moves_them(tmp_path: Path, etcd_server, run_id) -> None:
    """Two 2-stage pipelines; both nodes running a second stage (the only holders of those layers)
    are drained with `oobleck kill-agent`. The next plan names them donors: their workers join
    the next generation's entry, send their layers with the optimizer state to the two nodes left,
    and exit 0. No checkpoint exists (none is configured): without the donors the job would stop
    with "no surviving copy"; with them it ends with the reference weights."""
    from oobleck_elastic import cluster_ops
    from oobleck_elastic.planning import Plan
    from oobleck_elastic.records.keys import Keys
    from oobleck_elastic.rendezvous.membership import live_nodes, read_events
    from oobleck_elastic.etcd import EtcdSettings, connect

    profile = tiny_profile(tmp_path / "profile.json")
    keys = Keys("/oobleck", run_id)
    drained: list[str] = []

    def drain_the_second_stages(client) -> None:
        plan = Plan.from_json(client.get_json(keys.plan)[0])
        drained.extend(p.stages[-1].node for p in plan.pipelines)
        index = {r.node_id: r.index for r in live_nodes(client, keys)}
        for node in drained:
            cluster_ops.kill_agent(client, keys, index[node])

    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4"],
        12,
        profile,
        during=at_step(etcd_server.endpoint, keys, 4, drain_the_second_stages),
    )
    assert len(drained) == 2
    assert "as a donor" in out and "no surviving copy" not in out and "communication failed" not in out, out[-4000:]
    for node in drained:
        assert f"node {node}: leaving the job (node {node} was drained; its layers were handed over" in out
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    try:
        events = [ev for _, ev in read_events(client, keys)]
        plans = {p.generation: p for p in (Plan.from_json(data) for _, data in client.get_prefix_json(keys.plans))}
        plans = list(plans.values())
    finally:
        client.close()
    replanned = [e for e in events if e.kind == "drain" and e.generation]  # not the kill-agent requests
    assert sorted(e.node for e in replanned) == sorted(drained)
    assert all("hands its layers over" in e.detail for e in replanned), [e.line() for e in replanned]
    assert sorted(n for p in plans for n in p.donors) == sorted(drained)
    assert all(not (set(p.donors) & set(p.nodes)) for p in plans)
    assert_same(job, ref)


def test_losing_every_copy_of_a_layer_restores_the_checkpoint(tmp_path: Path, etcd_server, run_id) -> None:
    """Two nodes die at once and they held both copies of the same layers (more than f=1
    failures): the survivors restore the newest checkpoint by themselves and still end with the
    reference weights, every sample used once."""
    from oobleck_elastic import cluster_ops
    from oobleck_elastic.records.keys import Keys

    profile = tiny_profile(tmp_path / "profile.json")
    keys = Keys("/oobleck", run_id)

    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4"],
        9,
        profile,
        extra=["checkpoint.interval_steps=2"],
        job_extra=[f"logging.events_dir={tmp_path / 'events'}"],
        killed_by_test=2,
        during=at_step(etcd_server.endpoint, keys, 5, _kill_both_first_stages(keys)),
    )
    assert "had no surviving copy; restored checkpoint" in out, out[-4000:]
    assert_same(job, ref)
    # every survivor says where the layers came from: all of them from disk, none from a copy
    restored = read_event_lines(tmp_path / "events", ["restored"])
    assert restored and all(e["sources"] == restored[0]["sources"] for e in restored), restored
    sources = restored[0]["sources"]
    assert sources["replica"] == sources["shadow"] == {"layers": 0, "bytes": 0} and sources["disk"]["bytes"] > 0
    assert sources["disk"]["layers"] == 6 and "6 from disk" in out
    # the steps after the checkpoint ran twice, and count once (records/samples.py)
    ok, lines = cluster_ops.samples(str(tmp_path / "events"))
    assert ok and lines[0].startswith("samples: exactly once: 9 of 9 steps applied, 0 skipped"), lines
    assert "re-runs after 1 restore(s)" in lines[0], lines


@pytest.mark.slow
def test_losing_both_holders_of_layers_goes_on_from_their_shadow_copies(tmp_path: Path, etcd_server, run_id) -> None:
    """The same loss of both copies of the first layers, with fault_tolerance.shadow_copies=1 and
    no periodic checkpoint: the survivors take those layers from the shadow copies they keep in
    host memory, at the step the job had reached, and end with the reference weights, every
    step applied once and none trained twice."""
    from oobleck_elastic import cluster_ops
    from oobleck_elastic.records.keys import Keys

    profile = tiny_profile(tmp_path / "profile.json")
    keys = Keys("/oobleck", run_id)

    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4"],
        9,
        profile,
        job_extra=[
            "fault_tolerance.shadow_copies=1",
            "planning.host_memory_gb=1",
            f"logging.events_dir={tmp_path / 'events'}",
        ],
        killed_by_test=2,
        during=at_step(etcd_server.endpoint, keys, 3, _kill_both_first_stages(keys)),
    )
    assert "had no surviving device copy: taken from their shadow copies" in out, out[-4000:]
    assert "no surviving copy of layer" not in out and "restored checkpoint" not in out, out[-4000:]
    assert_same(job, ref)
    # the entry after the loss: the lost layers from the shadows, the others from replicas, none from disk
    entered = [e for e in read_event_lines(tmp_path / "events", ["entered"]) if "sources" in e]
    after = [e for e in entered if e["sources"]["shadow"]["layers"] > 0]
    assert after and all(e["gen"] == after[0]["gen"] for e in after), entered  # one entry took from shadows
    assert all(e["sources"] == after[0]["sources"] for e in entered if e["gen"] == after[0]["gen"]), entered
    sources = after[0]["sources"]
    assert sources["disk"] == {"layers": 0, "bytes": 0} and sources["shadow"]["bytes"] > 0
    assert sources["replica"]["layers"] + sources["shadow"]["layers"] == 6
    assert re.search(r"layers by source: \d+ from replicas \(.* MB moved\), [1-9]\d* from shadows", out), out[-4000:]
    # TensorBoard: the shadows never lag; the goodput ledger charged their exchange to `shadows`
    events = EventAccumulator(str(tensorboard_run(tmp_path / "job" / "runs")), size_guidance={"scalars": 0}).Reload()
    lags = [e.value for e in events.Scalars("shadows/lag_steps")]
    assert lags and set(lags) == {0.0}, lags
    assert all(e.value > 0 for e in events.Scalars("shadows/host_gb_job_planned"))
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    try:
        ledger = Ledger.from_json(client.get_json(keys.progress)[0]["goodput"])
    finally:
        client.close()
    assert ledger.get(Category.SHADOWS) > 0, ledger.seconds
    ok, lines = cluster_ops.samples(str(tmp_path / "events"))
    assert ok and lines[0].startswith("samples: exactly once: 9 of 9 steps applied, 0 skipped"), lines
    # at most the interrupted step was replayed; no committed step was trained again
    assert "re-runs after 0 restore(s)" in lines[0], lines


@pytest.mark.slow
def test_losing_every_copy_of_a_layer_without_a_checkpoint_fails_the_job(tmp_path: Path, etcd_server, run_id) -> None:
    """The same loss with no checkpoint to restore: the job is closed as failed with the reason,
    at once. (The survivors' workers used to raise, and their agents restarted them into a job
    that trained again from step 0 on re-initialised layers.)"""
    from oobleck_elastic.records.read import read_closed
    from oobleck_elastic.records.keys import Keys

    profile = tiny_profile(tmp_path / "profile.json")
    keys = Keys("/oobleck", run_id)

    out, _, _ = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4"],
        40,
        profile,
        expect_failure=True,
        during=at_step(etcd_server.endpoint, keys, 3, _kill_both_first_stages(keys)),
    )
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    try:
        closed = read_closed(client, keys)
    finally:
        client.close()
    assert closed is not None and closed.failed, out[-4000:]
    assert closed.reason.startswith("no surviving copy of layer(s) [0, 1, 2] and no checkpoint in "), closed.reason
    killed_at = out.index("no surviving copy")
    assert "step 1/40" not in out[killed_at:], out[-4000:]  # nothing trained again from step 0


def test_hung_node_is_cut_off_by_the_control_plane(tmp_path: Path, etcd_server, run_id) -> None:
    """A SIGSTOPped node (agent and workers frozen, sockets open) blocks its peers' gloo calls,
    which would only fail after the 30 s communication timeout. Its lease expires instead (TTL
    2 s), the leader publishes a plan without it, and every survivor abandons the blocked step at
    once and enters the next generation: the next step completes within lease TTL + settle + a
    few seconds of the stop, far before the timeout, with the reference weights. The frozen node
    is killed by the launcher once the job is closed."""
    import os
    import signal
    import time

    from launcher.faults import descendants
    from oobleck_elastic.etcd import EtcdSettings, connect
    from oobleck_elastic.records.keys import Keys

    profile = tiny_profile(tmp_path / "profile.json")
    keys = Keys("/oobleck", run_id)
    stopped: dict[str, float] = {}

    def freeze_a_non_leader(client) -> None:
        rec = a_follower(client, keys)
        for pid in [rec.agent_pid] + descendants(rec.agent_pid):
            os.kill(pid, signal.SIGSTOP)
        stopped["at"] = time.monotonic()

    def freeze_then_time_the_next_step(proc) -> None:
        when(
            etcd_server.endpoint,
            proc,
            lambda c: (c.get_json(keys.progress)[0] or {}).get("step", 0) >= 4,
            freeze_a_non_leader,
        )
        client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
        try:
            while proc.poll() is None and "resumed" not in stopped:
                if (client.get_json(keys.progress)[0] or {}).get("generation", 1) >= 2:
                    stopped["resumed"] = time.monotonic()
                time.sleep(0.02)
        finally:
            client.close()

    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4", "--exit-grace", "5"],
        9,
        profile,
        extra=["fault_tolerance.comm_timeout_s=30"],
        killed_by_test=1,
        during=freeze_then_time_the_next_step,
    )
    assert "step abandoned (StepAbandoned: generation 2 left out lost node(s)" in out, out[-4000:]
    assert "entered from generation 1" in out
    assert "Timed out waiting" not in out  # nobody waited for the communication timeout
    assert "did not exit 5s after the job closed" in out
    cut_off = stopped["resumed"] - stopped["at"]
    print(f"hung node: first step of generation 2 done {cut_off:.2f} s after the SIGSTOP")
    assert cut_off < 15, f"{cut_off:.1f} s: the hung node was not cut off by the control plane"
    assert_same(job, ref)


def test_local_worker_crash_is_restarted_by_its_agent_and_rejoins(tmp_path: Path, etcd_server, run_id) -> None:
    """One worker process dies on a healthy node: its agent restarts it (torchrun's restart of the
    local worker group), the node answers the roll call's ping so it stays in the plan, and the
    restarted worker, holding nothing, receives its layers like a newcomer."""
    import os
    import signal

    from oobleck_elastic.records.keys import Keys
    from oobleck_elastic.rendezvous.membership import read_events

    profile = tiny_profile(tmp_path / "profile.json")
    keys = Keys("/oobleck", run_id)

    def crash_a_worker(client) -> None:
        os.kill(worker_pid(a_follower(client, keys).agent_pid), signal.SIGKILL)

    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4"],
        12,
        profile,
        during=at_step(etcd_server.endpoint, keys, 4, crash_a_worker),
    )
    from oobleck_elastic.etcd import EtcdSettings, connect

    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    events = [ev for _, ev in read_events(client, keys)]
    client.close()
    plans = [ev for ev in events if ev.kind == "plan"]
    assert [ev.generation for ev in plans] == [1, 2] and "(restart)" in plans[1].detail, [e.line() for e in plans]
    # a crashed worker is no lost node: its agent restarts it and no plan leaves a node out (the
    # agents' own `leave` events at the end of the job belong to no generation)
    assert not [ev for ev in events if ev.kind in ("lost", "leave", "drain") and ev.generation is not None], [
        e.line() for e in events
    ]
    assert_same(job, ref)


def _kill_both_first_stages(keys):
    """The action that SIGKILLs the nodes of every pipeline's first stage at once (two pipelines:
    both copies of the first layers)."""
    from launcher.faults import kill_node
    from oobleck_elastic.planning import Plan
    from oobleck_elastic.rendezvous.membership import live_nodes

    def kill(client) -> None:
        plan = Plan.from_json(client.get_json(keys.plan)[0])
        victims = {p.stages[0].node for p in plan.pipelines}
        assert len(victims) == 2
        for rec in live_nodes(client, keys):
            if rec.node_id in victims:
                kill_node(rec.agent_pid)

    return kill


def test_a_device_group_error_after_the_waits_refuses_the_step_on_every_worker(
    tmp_path: Path, etcd_server, run_id
) -> None:
    """NCCL's watchdog may abort a timed-out communicator after the step's waits returned, leaving
    partial sums (docs/nccl.md): the worker holding rank 1 reports an errored device group at step 3
    with its gradients halved (`OOBLECK_GROUP_ERROR_AT`). The commit vote carries it, no worker
    applies the step, the generation is left and step 3 is replayed: the job ends with the
    single-process weights (applied, the halved gradients would part from them)."""
    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "2"],
        6,
        tiny_profile(tmp_path / "profile.json"),
        env={"OOBLECK_GROUP_ERROR_AT": "1@3"},
    )
    refused = "step 3 refused by every worker: a device group reported an error after its waits"
    assert f"{refused} (injected: TIMEOUT (OOBLECK_GROUP_ERROR_AT))" in out, out[-5000:]
    assert f"{refused} (on another worker)" in out, out[-5000:]
    assert "entered from generation 1" in out, out[-5000:]
    assert_same(job, ref)
