"""A launched job with activation checkpointing (`training.activation_checkpoint=full`,
models/recompute.py): zero-bubble on 4 nodes, a layer holder killed at step 3, under
torch's collective checker; its weights equal the single-process reference's trained without
recomputation (fp32, the equality tests' tolerance)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oobleck_elastic.checkpoint import load_model_state
from oobleck_elastic.config import load_config
from oobleck_elastic.engine.run import train
from helpers import one_thread, overrides, run_job, tiny_profile
from test_matrix import AT, STEPS, _keys

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_a_job_recomputing_its_activations_survives_a_kill_with_the_reference_weights(
    tmp_path: Path, etcd_server, run_id
) -> None:
    row = {"schedule": "zero-bubble", "shadows": 0, "compile": False, "tp": 1, "precision": "fp32"}
    keys = _keys(row, tmp_path / "cache")
    profile = tiny_profile(tmp_path / "profile.json")
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "OMP_NUM_THREADS": "1"}
    launcher = ["--nodes", "4", "--kill", f"follower@{AT}"]
    out, job, _ = run_job(
        tmp_path,
        etcd_server,
        run_id,
        launcher,
        STEPS,
        profile,
        extra=keys,
        job_extra=["training.activation_checkpoint=full"],
        env=env,
        reference=False,
    )
    assert "Detected mismatch between collectives" not in out, out[-5000:]
    assert "[launcher] killed node" in out and "entered from generation 1" in out, out[-4000:]
    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", overrides(tmp_path / "ref", STEPS, profile) + keys)
    assert cfg.training.activation_checkpoint == "none"
    with one_thread():
        train(cfg)
    ref = load_model_state(tmp_path / "ref" / "ckpt")
    assert set(job) == set(ref)
    for key in ref:
        torch.testing.assert_close(job[key], ref[key], rtol=1e-5, atol=1e-6, msg=key)
