"""The step guard (engine/resilience/guard.py): a non-finite or spiking step is never applied; it is replayed
once, then its batch is skipped; too many skips in a row stop the job naming the steps. The
decisions are pure functions tested on made-up numbers; a single process and a four-node job
with injected NaNs end with the weights of the documented outcome."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from oobleck_elastic.config import ConfigError, load_config
from oobleck_elastic.engine.resilience.errors import JobFailed
from oobleck_elastic.engine.resilience.faults import FaultInjector
from oobleck_elastic.engine.resilience.guard import GuardDecision, StepGuard, TooManySkipped, Verdict, judge
from oobleck_elastic.engine.run import train
from oobleck_elastic.engine.reference import single_process
from helpers import RandomTokens, assert_same, run_job, tensorboard_run, tiny_profile

pytestmark = pytest.mark.core  # fast: make test runs it at every landing (tests/lanes.py)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "loss,norm2,running_max,factor,reason",
    [
        (2.0, 4.0, 3.0, 0.0, ""),
        (float("nan"), 4.0, 3.0, 0.0, "the loss is nan"),
        (2.0, float("inf"), 3.0, 0.0, "the gradient norm is inf"),
        (2.0, float("nan"), 3.0, 0.0, "the gradient norm is nan"),
        (31.0, 4.0, 3.0, 10.0, "loss spike: 31 > 10 x the largest loss so far (3)"),
        (29.0, 4.0, 3.0, 10.0, ""),
        (31.0, 4.0, 3.0, 0.0, ""),  # spikes off
        (31.0, 4.0, 0.0, 10.0, ""),  # no applied step yet: nothing to compare with
    ],
)
def test_judge(loss, norm2, running_max, factor, reason) -> None:
    assert judge(loss, norm2, running_max=running_max, spike_factor=factor) == Verdict(not reason, reason)


def test_replay_once_then_skip_then_stop_after_too_many_in_a_row() -> None:
    guard, bad = StepGuard(max_skipped=2), Verdict(False, "the loss is nan")
    assert guard.decide(3, bad) is GuardDecision.REPLAY
    assert guard.decide(3, Verdict(True)) is GuardDecision.APPLY  # a transient fault
    assert guard.decide(4, bad) is GuardDecision.REPLAY and guard.decide(4, bad) is GuardDecision.SKIP
    assert guard.decide(5, Verdict(True)) is GuardDecision.APPLY and guard.in_a_row == []
    assert guard.decide(6, bad) is GuardDecision.REPLAY and guard.decide(6, bad) is GuardDecision.SKIP
    assert guard.decide(7, bad) is GuardDecision.REPLAY
    with pytest.raises(TooManySkipped) as err:
        guard.decide(7, bad)
    assert str(err.value) == (
        "2 steps in a row were not applied (steps [6, 7], the last because the loss is nan; "
        "fault_tolerance.max_skipped_steps=2): lower the learning rate or check the data of "
        "those steps"
    )
    assert guard.skipped == [4, 6, 7]


def test_bad_settings_and_fault_specs_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match="'fault_tolerance.max_skipped_steps' must be >= 1 \\(got 0\\)"):
        load_config(None, ["fault_tolerance.max_skipped_steps=0"])
    with pytest.raises(ConfigError, match=r"'fault_tolerance.loss_spike_factor' must be 0 \(off\) or > 1 \(got 0.5\)"):
        load_config(None, ["fault_tolerance.loss_spike_factor=0.5"])
    with pytest.raises(ValueError, match=r"OOBLECK_NAN_AT='1@x': each item must be RANK@STEP\[xTIMES\], e.g. 1@3x2"):
        FaultInjector.from_env({"OOBLECK_NAN_AT": "1@x"})


def _cfg(tmp: Path, *extra: str):
    return load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=16",
            "training.global_batch_size=8",
            "training.microbatch_size=2",
            "training.steps=6",
            "training.optimizer.eps=1e-6",
            f"checkpoint.dir={tmp / 'ckpt'}",
            f"logging.tensorboard_dir={tmp / 'runs'}",
            f"data.cache_dir={tmp / 'cache'}",
            *extra,
        ],
    )


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {f"{i}:{n}": t for i, layer in trainer.checkpoint_state.layer_state().items() for n, t in layer.items()}


def _reference(cfg, *, skip: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Steps 0..steps-1 of one process with no fault, the steps in `skip` counted as done with no update."""
    trainer = single_process(cfg, dataset=RandomTokens(n=64, seq_len=16))
    try:
        for step in range(cfg.training.steps):
            trainer.skip(step) if step in skip else trainer.train_step(step)
        return _weights(trainer)
    finally:
        trainer.close()


def _run(cfg, monkeypatch, spec: dict[str, str]) -> dict[str, torch.Tensor]:
    for name, value in spec.items():
        monkeypatch.setenv(name, value)
    trainer = single_process(cfg, dataset=RandomTokens(n=64, seq_len=16))
    try:
        guard, step = StepGuard(cfg.fault_tolerance.max_skipped_steps), 0
        while step < cfg.training.steps:  # the loop of engine/worker.py, on a trainer of the one-worker plan
            result = trainer.train_step(step, rejections=guard.attempts.get(step, 0))
            action = guard.decide(step, Verdict(not result.rejected, result.rejected))
            if action is GuardDecision.SKIP:
                trainer.skip(step)
            if action is not GuardDecision.REPLAY:
                step += 1
        assert all(math.isfinite(float(t.abs().sum())) for t in _weights(trainer).values())
        return _weights(trainer)
    finally:
        trainer.close()


def test_a_transient_nan_is_replayed_and_changes_nothing(tmp_path: Path, monkeypatch) -> None:
    cfg = _cfg(tmp_path)
    ref = _reference(cfg)
    got = _run(cfg, monkeypatch, {"OOBLECK_NAN_AT": "0@3"})
    for key in ref:
        assert torch.equal(got[key], ref[key]), key


@pytest.mark.parametrize(
    "spec,extra",
    [
        ({"OOBLECK_NAN_AT": "0@3x2"}, ()),
        pytest.param(  # the spike in turns: the same skip path as the NaN (tests/README.md)
            {"OOBLECK_SPIKE_AT": "0@3:1000x2"}, ("fault_tolerance.loss_spike_factor=10",), marks=pytest.mark.extended
        ),
    ],
)
def test_a_persistent_fault_skips_the_batch(tmp_path: Path, monkeypatch, spec, extra) -> None:
    cfg = _cfg(tmp_path, *extra)
    ref = _reference(cfg, skip=(3,))
    got = _run(cfg, monkeypatch, spec)
    for key in ref:
        assert torch.equal(got[key], ref[key]), key


def test_too_many_skipped_steps_fail_the_job_and_no_checkpoint_holds_a_nan(tmp_path: Path, monkeypatch) -> None:
    cfg = _cfg(tmp_path, "fault_tolerance.max_skipped_steps=2", "checkpoint.interval_steps=1")
    monkeypatch.setenv("OOBLECK_NAN_AT", "0@2x2,0@3x2")
    with pytest.raises(JobFailed, match=r"2 steps in a row were not applied \(steps \[2, 3\]"):
        train(cfg)
    from oobleck_elastic.checkpoint import latest_checkpoint, load_model_state

    newest = latest_checkpoint(tmp_path / "ckpt")
    # steps 0 and 1 applied, step 2 skipped (a checkpoint after it), step 3 ended the job
    assert newest is not None and newest.name == "step-00000003"
    assert all(bool(torch.isfinite(t).all()) for t in load_model_state(newest).values())


def test_the_job_loop_skips_and_reports_it(tmp_path: Path, monkeypatch) -> None:
    cfg = _cfg(tmp_path)
    monkeypatch.setenv("OOBLECK_NAN_AT", "0@3x2")
    summary = train(cfg)
    assert summary.not_applied == ("step 4: the loss is nan; replayed", "step 4: the loss is nan; batch skipped")
    assert summary.final_step == 6
    ea = EventAccumulator(str(tensorboard_run(tmp_path / "runs")), size_guidance={"scalars": 0})
    ea.Reload()
    # at the step's number, as the summary says it: step 4 replayed, then skipped
    assert [(e.step, e.value) for e in ea.Scalars("guard/skipped_steps")] == [(4, 0.0), (4, 1.0)]
    assert sorted({e.step for e in ea.Scalars("train/loss")}) == [1, 2, 3, 5, 6]


def test_the_guard_state_is_kept_in_checkpoints_so_a_resumed_job_sees_a_spike_at_once(
    tmp_path: Path, monkeypatch
) -> None:
    """A job skips step 1 (a persistent NaN) and stops at step 3 with its checkpoint; resumed to
    step 6, its first step spikes 1000x. The checkpoint kept the running maximum and the skipped
    step, so the resumed job rejects the spike at once (it used to start from no maximum and
    apply it) and goes on with the skip history."""
    import json

    monkeypatch.setenv("OOBLECK_NAN_AT", "0@1x2")
    first = train(_cfg(tmp_path, "training.steps=3", "fault_tolerance.loss_spike_factor=10"))
    assert first.final_step == 3
    manifest = json.loads((tmp_path / "ckpt" / "step-00000003" / "manifest.json").read_text())
    guard = manifest["extra"]["guard"]
    assert guard["skipped"] == [1] and guard["in_a_row"] == [] and guard["max_loss"] > 0, guard
    monkeypatch.delenv("OOBLECK_NAN_AT")
    monkeypatch.setenv("OOBLECK_SPIKE_AT", "0@3:1000x2")
    resumed = train(_cfg(tmp_path, "fault_tolerance.loss_spike_factor=10"))
    assert resumed.final_step == 6
    assert [line.split(":")[0] for line in resumed.not_applied] == ["step 4", "step 4"], resumed.not_applied
    assert "loss spike" in resumed.not_applied[0], resumed.not_applied
    manifest = json.loads((tmp_path / "ckpt" / "step-00000006" / "manifest.json").read_text())
    assert manifest["extra"]["guard"]["skipped"] == [1, 3]


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
@pytest.mark.slow
def test_a_persistent_nan_on_one_worker_of_four_nodes_is_skipped_everywhere(
    tmp_path: Path, etcd_server, run_id, monkeypatch
) -> None:
    """Two 2-stage pipelines; rank 1 (the last stage of pipeline 0) gets NaNs at step 3 twice:
    every worker rejects it, replays it, skips it, and the job ends with the weights of one
    process that skipped step 3 (the reference runs with the same fault on its only worker)."""
    monkeypatch.setenv("OOBLECK_NAN_AT", "0@3x2")  # the reference, in this process
    profile = tiny_profile(tmp_path / "profile.json")
    out, job, ref = run_job(
        tmp_path, etcd_server, run_id, ["--nodes", "4"], 8, profile, env={"OOBLECK_NAN_AT": "1@3x2"}
    )
    assert out.count("step 4 not applied: the loss is nan; replaying it") == 4, out[-3000:]
    assert out.count("step 4 not applied: the loss is nan; skipping its batch") == 4, out[-3000:]
    assert_same(job, ref)
