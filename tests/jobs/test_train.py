"""examples/train.py end to end: the single-process run writes TensorBoard events and checkpoints,
resumes, and refuses another model's checkpoint; under torchrun (launcher.local, real etcd) a
3-stage pipeline over three nodes ends with the same weights as the single-process run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from oobleck_elastic import checkpoint
from oobleck_elastic.checkpoint import latest_checkpoint, load_model_state, read_manifest
from oobleck_elastic.config import ConfigError, load_config
from oobleck_elastic.engine.run import train
from oobleck_elastic.engine.startup import one_line
from helpers import (
    TINY_PROFILE_OVERRIDES,
    bf16_atol,
    one_thread,
    single_process_overrides,
    tensorboard_run,
    tiny_profile,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.core
def test_single_process_tensorboard_checkpoint_and_resume(tmp_path: Path, monkeypatch) -> None:
    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", single_process_overrides(tmp_path, 3))
    summary = train(cfg, max_bytes=300_000)
    assert summary.final_step == 3 and summary.resumed_from is None
    ea = EventAccumulator(str(tensorboard_run(tmp_path / "runs")), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert tags >= {
        "train/loss",
        "Throughput/samples_per_s",
        "Throughput/tokens_per_s",
        "Throughput/step_time_s",
        "cluster/nodes",
        "cluster/pipelines",
        "cluster/generation",
    }
    loss = ea.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]  # the progress lines' "step 1/3" .. "step 3/3"
    assert loss[0].value == pytest.approx(summary.first_loss) and loss[-1].value == pytest.approx(summary.last_loss)
    assert [e.value for e in ea.Scalars("cluster/nodes")] == [1, 1, 1]
    text = ea.Tensors("plan/text_summary")[0]
    # the single process runs as a one-worker job: one stage holding all 6 layers
    assert text.step == 0 and "1 worker(s)" in text.tensor_proto.string_val[0].decode()
    assert "[0,6)@local:0" in text.tensor_proto.string_val[0].decode()
    step3 = latest_checkpoint(tmp_path / "ckpt")
    manifest = read_manifest(step3)
    assert manifest["step"] == 3 and manifest["extra"]["model"]["hidden_size"] == 64
    del manifest["extra"]["model"]  # as a checkpoint from before the model's identity record: resumed all the same
    (step3 / "manifest.json").write_text(json.dumps(manifest))

    cfg5 = load_config(ROOT / "configs/gpt2-tiny.yaml", single_process_overrides(tmp_path, 5))
    resumed = train(cfg5, max_bytes=300_000)
    assert resumed.resumed_from == 3 and resumed.steps == 2

    # another model in the same directory: refused in one line, before any tensor is read
    monkeypatch.setattr(checkpoint, "load_layer", lambda *a, **k: pytest.fail("a checkpoint tensor was read"))
    listing = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    for steps in (8, 2):  # 2: "nothing to do" would speak of the other model's checkpoint
        wider = load_config(
            ROOT / "configs/gpt2-tiny.yaml", [*single_process_overrides(tmp_path, steps), "model.hidden_size=128"]
        )
        with pytest.raises(ConfigError) as err:
            train(wider, max_bytes=300_000)
        assert one_line(err.value) == (
            f"ConfigError: checkpoint.dir={tmp_path / 'ckpt'} holds a checkpoint of another model (step-00000005: "
            "gpt2, 4 layers, hidden 64, vocab 256; this job: gpt2, 4 layers, hidden 128, vocab 256): set "
            "checkpoint.dir to a directory of its own"
        )
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == listing
    monkeypatch.undo()
    # the same 5 steps in one go give the same weights
    fresh = tmp_path / "fresh"
    cfg_once = load_config(ROOT / "configs/gpt2-tiny.yaml", single_process_overrides(fresh, 5))
    train(cfg_once, max_bytes=300_000)
    a, b = load_model_state(tmp_path / "ckpt"), load_model_state(fresh / "ckpt")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


# bf16 runs are compared within `bf16_atol` (tests/helpers.py tells why).
TOLERANCE = {"fp32": {"rtol": 1e-5, "atol": 1e-6}}


@pytest.mark.core
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.extended)])  # bf16 in turns
def test_torchrun_job_equals_single_process(tmp_path: Path, etcd_server, run_id, precision: str) -> None:
    steps = 4
    ref_dir, job_dir = tmp_path / "ref", tmp_path / "job"
    common = [
        f"planning.profile_path={tiny_profile(tmp_path / 'profile.json')}",
        *TINY_PROFILE_OVERRIDES,
        f"training.precision={precision}",
    ]
    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", single_process_overrides(ref_dir, steps) + common)
    with one_thread():
        summary = train(cfg, max_bytes=None)
    assert summary.last_loss < summary.first_loss - 0.1, (summary.first_loss, summary.last_loss)  # it learns
    cmd = [
        sys.executable,
        "-m",
        "launcher.local",
        "-v",  # every node line: this reads them
        "--nodes",
        "3",
        "--endpoint",
        etcd_server.endpoint,
        "--run-id",
        run_id,
        "--rdzv-conf",
        "lease_ttl=2,settle=0.2,last_call_timeout=0.5",
        "--",
        "examples/train.py",
        "--config",
        "configs/gpt2-tiny.yaml",
        *single_process_overrides(job_dir, steps),
        *common,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one intra-op thread per worker, as the reference
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "each worker computes on OMP_NUM_THREADS=1 thread(s)" in res.stdout, res.stdout[:2000]
    assert "rank 2: entered from generation 0" in res.stdout, res.stdout[-3000:]
    manifest = read_manifest(latest_checkpoint(job_dir / "ckpt"))
    assert manifest["step"] == steps and len(manifest["plan"]["pipelines"][0]["stages"]) == 3
    ref, job = load_model_state(ref_dir / "ckpt"), load_model_state(job_dir / "ckpt")
    assert set(ref) == set(job)
    ea = EventAccumulator(str(tensorboard_run(job_dir / "runs")), size_guidance={"scalars": 0})
    ea.Reload()  # first: a job that lost a node under load and re-planned says so, not a weight
    assert [e.value for e in ea.Scalars("cluster/nodes")] == [3] * steps
    assert [e.value for e in ea.Scalars("cluster/generation")] == [1] * steps
    lr = load_config(ROOT / "configs/gpt2-tiny.yaml").training.optimizer.lr
    tolerance = TOLERANCE.get(precision, {"rtol": 0.0, "atol": bf16_atol(steps, lr)})
    for key in ref:
        torch.testing.assert_close(job[key], ref[key], **tolerance, msg=f"{precision}: {key}")
    if precision == "bf16":  # bf16 really ran: its weights are not the fp32 ones
        fp32 = tmp_path / "ref-fp32"
        with one_thread():
            train(
                load_config(ROOT / "configs/gpt2-tiny.yaml", single_process_overrides(fp32, steps) + common[:-1]),
                max_bytes=None,
            )
        other = load_model_state(fp32 / "ckpt")
        assert max((other[k] - t).abs().max().item() for k, t in ref.items()) > tolerance["atol"]
