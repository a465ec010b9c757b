"""Errors that are not communication failures end a worker with their traceback, and a job whose
workers keep failing with the same error stops with it instead of re-planning forever: a
deterministic exception injected into one worker, and a corrupt checkpoint found while resuming
(never trained on half-restored)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import flip_byte, run_job, tiny_profile
from oobleck_elastic.records.errors import ErrorRecord
from oobleck_elastic.etcd import EtcdSettings, connect
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.rendezvous.membership import read_events

pytestmark = pytest.mark.slow


def _etcd_outcome(endpoint: str, run_id: str) -> tuple[dict, ErrorRecord | None, list[int]]:
    keys = Keys("/oobleck", run_id)
    client = connect(EtcdSettings(endpoint=endpoint))
    try:
        closed = client.get_json(keys.closed)[0] or {}
        record = ErrorRecord.parse(client.get_json(keys.errors)[0])
        plans = [ev.generation for _, ev in read_events(client, keys) if ev.kind == "plan"]
    finally:
        client.close()
    return closed, record, plans


@pytest.mark.core
def test_a_deterministic_error_stops_the_job_after_max_repeated_errors(tmp_path: Path, etcd_server, run_id) -> None:
    """Four nodes, two 2-stage pipelines: whichever worker holds rank 1 raises at step 2; its agent
    restarts it, the roll call re-plans, it receives its layers from the other pipeline, and it
    raises again at step 2; after two generations the job is closed as failed."""
    profile = tiny_profile(tmp_path / "profile.json")
    out, _, _ = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4"],
        6,
        profile,
        extra=["fault_tolerance.max_repeated_errors=2"],
        env={"OOBLECK_FAIL_AT": "1@2"},
        expect_failure=True,
    )
    # the worker ends with the original traceback, twice (once per generation), then the job stops
    assert out.count("RuntimeError: injected fault: rank 1 at step 2 (OOBLECK_FAIL_AT)") >= 2, out[-5000:]
    assert "Traceback (most recent call last)" in out
    assert "closing the job as failed: RuntimeError: injected fault" in out, out[-5000:]
    closed, record, plans = _etcd_outcome(etcd_server.endpoint, run_id)
    assert closed.get("failed") is True and "in 2 generations in a row" in closed["reason"], closed
    assert record is not None and record.count == 2 and record.step == 2
    assert record.error == "RuntimeError: injected fault: rank 1 at step 2 (OOBLECK_FAIL_AT)"
    assert "injected fault" in record.traceback and "train_step" in record.traceback
    assert len(plans) <= 3, plans  # no endless re-planning
    assert "the job was closed as failed" in out  # the healthy worker stops too, with the reason


def test_a_failure_at_every_first_step_stops_the_job_after_max_restarts_without_progress(
    tmp_path: Path, etcd_server, run_id
) -> None:
    """Two nodes: whichever worker holds rank 1 raises a communication failure as step 0 starts, in
    every generation. It checks in at the roll call, every node answers, so each re-plan is a
    restart on the same nodes; after generation 1 and 3 restarts broke without a step, the leader
    closes the job as failed naming the error (not re-planning for ever), and every agent exits
    non-zero with that line."""
    profile = tiny_profile(tmp_path / "profile.json")
    out, _, _ = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "2"],
        4,
        profile,
        extra=["fault_tolerance.max_restarts_without_progress=3"],
        env={"OOBLECK_COMM_FAIL_AT": "1@0"},
        expect_failure=True,
    )
    injected = "ConnectionError: injected communication failure: rank 1 at step 0 (OOBLECK_COMM_FAIL_AT)"
    closed, record, plans = _etcd_outcome(etcd_server.endpoint, run_id)
    reason = closed.get("reason", "")
    assert closed.get("failed") is True, closed
    assert reason.startswith("generations 1-4 on the same 2 node(s) all broke before a step committed"), reason
    assert "fault_tolerance.max_restarts_without_progress=3" in reason and injected in reason, reason
    assert plans == [1, 2, 3, 4], plans  # the initial plan and 3 restarts, then no more
    assert record is not None and record.error == injected and "injected communication failure" in record.traceback
    # every agent exits non-zero with the closing line
    assert out.count("node 0 exited with status 1") + out.count("node 1 exited with status 1") == 2, out[-5000:]
    assert "was closed as failed" in out and "all broke before a step committed" in out, out[-5000:]


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
def test_a_corrupt_checkpoint_stops_the_resume_instead_of_training_half_restored(
    tmp_path: Path, etcd_server, run_id
) -> None:
    profile = tiny_profile(tmp_path / "profile.json")
    run_job(tmp_path / "first", etcd_server, run_id + "a", ["--nodes", "2"], 4, profile)
    ckpt = tmp_path / "first" / "job" / "ckpt" / "step-00000004"
    layer = ckpt / "layer-002.safetensors"
    flip_byte(layer)
    out, _, _ = run_job(
        tmp_path / "second",
        etcd_server,
        run_id + "b",
        ["--nodes", "2"],
        6,
        profile,
        extra=[f"checkpoint.dir={ckpt.parent}", "checkpoint.resume=true", "fault_tolerance.max_repeated_errors=1"],
        expect_failure=True,
    )
    assert "CheckpointError" in out and "layer-002.safetensors" in out, out[-5000:]
    assert "communication failed (CheckpointError" not in out  # not mistaken for a network failure
    closed, record, _ = _etcd_outcome(etcd_server.endpoint, run_id + "b")
    assert closed.get("failed") is True and record is not None and record.error.startswith("CheckpointError")
    assert not (ckpt.parent / "step-00000006").exists()  # it never trained on


def test_a_corrupt_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path: Path, etcd_server, run_id) -> None:
    """Checkpoints at steps 2 and 4, one byte of step 4 flipped: the resumed job says which file
    was bad and which checkpoint it used, restores step 2 on every worker, sets step 4 aside
    (never rewritten in place), and ends with the weights of an uninterrupted run."""
    from helpers import ROOT, assert_same, overrides
    from oobleck_elastic.checkpoint import list_checkpoints, load_model_state
    from oobleck_elastic.config import load_config
    from oobleck_elastic.engine.run import train

    profile = tiny_profile(tmp_path / "profile.json")
    run_job(
        tmp_path / "first",
        etcd_server,
        run_id + "a",
        ["--nodes", "2"],
        4,
        profile,
        extra=["checkpoint.interval_steps=2"],
        reference=False,
    )
    ckpt_dir = tmp_path / "first" / "job" / "ckpt"
    layer = ckpt_dir / "step-00000004" / "layer-002.safetensors"
    flip_byte(layer)
    out, job, _ = run_job(
        tmp_path / "second",
        etcd_server,
        run_id + "b",
        ["--nodes", "2"],
        6,
        profile,
        extra=[f"checkpoint.dir={ckpt_dir}", "checkpoint.resume=true", "checkpoint.interval_steps=2"],
        reference=False,
    )
    assert "checkpoint step-00000004 cannot be used" in out and "layer-002.safetensors is corrupt" in out, out[-4000:]
    assert "using checkpoint step-00000002 instead" in out and "resumed from" in out
    names = [p.name for p in list_checkpoints(ckpt_dir)]
    assert names == ["step-00000002", "step-00000004", "step-00000006"], names  # step 4 written anew
    assert any(p.name.startswith("step-00000004.corrupt-") for p in ckpt_dir.iterdir())
    train(load_config(ROOT / "configs/gpt2-tiny.yaml", overrides(tmp_path / "ref", 6, profile)))
    assert_same(load_model_state(ckpt_dir), load_model_state(tmp_path / "ref" / "ckpt"))
