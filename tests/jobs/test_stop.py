"""A job asked to stop (`oobleck stop`, the local launcher's Ctrl-C): every worker stops at the same
step boundary, the step in flight finished, with a checkpoint of that step, and the job closes as
stopped, not failed; the same command then resumes it to the weights of an uninterrupted run."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typing import Any

import torch

from helpers import signal_after_steps, single_process_overrides
from oobleck_elastic.checkpoint import latest_checkpoint, load_model_state, newest_intact_checkpoint, read_manifest
from oobleck_elastic.config import load_config
from oobleck_elastic.engine.control import LocalControl
from oobleck_elastic.engine.run import train
from oobleck_elastic.models.build import num_layers

ROOT = Path(__file__).resolve().parents[2]


class StopAfter(LocalControl):
    """The single process's control plane, asked to stop once `after` steps are reported."""

    def __init__(self, cfg: Any, after: int) -> None:
        super().__init__(cfg, num_layers(cfg.model))
        self.after = after
        self.closed: tuple[str, bool, bool] | None = None

    def report_progress(self, *, generation: int, step: int, **extra: Any) -> None:
        if step >= self.after:
            self.stop = "a test asked"

    def close_job(self, reason: str, *, failed: bool = False, stopped: bool = False, known_error: bool = False) -> None:
        super().close_job(reason, failed=failed, stopped=stopped, known_error=known_error)
        self.closed = (reason, failed, stopped)


@pytest.mark.core
def test_a_stop_request_ends_the_run_at_the_next_boundary_with_its_checkpoint(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", single_process_overrides(tmp_path, 6))
    ctx = StopAfter(cfg, after=2)
    summary = train(cfg, ctx, max_bytes=300_000)
    # read before step 3, voted in step 3's commit: step 3 (in flight) is finished, then the run stops
    assert summary.final_step == 3 and summary.steps == 3
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    assert ckpt is not None and ckpt.name == "step-00000003" and read_manifest(ckpt)["step"] == 3
    assert ctx.closed == (
        f"stopped at step 3 of 6 on request (a test asked); its checkpoint: {ckpt}; the same command resumes it",
        False,  # not failed: ...
        True,  # ... stopped (`oobleck outcome` exits 4)
    )
    resumed = train(
        load_config(ROOT / "configs/gpt2-tiny.yaml", single_process_overrides(tmp_path, 6)), max_bytes=300_000
    )
    assert resumed.resumed_from == 3 and resumed.steps == 3
    once = tmp_path / "once"
    train(load_config(ROOT / "configs/gpt2-tiny.yaml", single_process_overrides(once, 6)), max_bytes=300_000)
    a, b = load_model_state(tmp_path / "ckpt"), load_model_state(once / "ckpt")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.core
def test_a_ctrl_c_to_the_launcher_stops_a_4_node_job_at_a_boundary_with_an_intact_checkpoint(tmp_path: Path) -> None:
    """SIGINT to the local launcher while a 4-node job trains (no periodic checkpoint): every node
    exits 0 on its own (none killed), the step they stopped at is saved and verifies file by file,
    the job is closed as stopped, and the launcher's last line is its `done:` summary naming it."""
    cmd = [sys.executable, "-m", "launcher.local", "--nodes", "4", "--log-dir", str(tmp_path / "runs"), "--"]
    cmd += ["examples/train.py", "--config", "configs/gpt2-tiny.yaml", "training.steps=100000"]
    cmd += [f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.tensorboard_dir={tmp_path / 'tb'}"]
    code, out = signal_after_steps(cmd, signal.SIGINT, 240)  # the stop's bound is fault_tolerance.preempt_grace_s
    stopped = re.search(r"stopped at step (\d+) of 100000 on request \(Ctrl-C \(SIGINT\) to the local launcher\)", out)
    assert code == 130 and stopped is not None, out[-4000:]
    step = int(stopped.group(1))
    ckpt = tmp_path / "ckpt" / f"step-{step:08d}"
    path, unusable = newest_intact_checkpoint(
        tmp_path / "ckpt", num_layers=num_layers(load_config(ROOT / "configs/gpt2-tiny.yaml").model)
    )
    assert path == ckpt and not unusable and read_manifest(ckpt)["step"] == step
    assert out.splitlines()[-1] == (
        "[launcher] done: 4 node(s), 0 killed on purpose, 0 preempted, 0 failed; stopped on request (Ctrl-C "
        f"(SIGINT)); newest complete checkpoint: {ckpt}"
    ), out[-3000:]
    assert "stopping every node" not in out and "Traceback" not in out, out[-4000:]


def test_a_notice_to_every_agent_stops_the_job_with_a_checkpoint(tmp_path: Path) -> None:
    """Both agents of a 2-node job get SIGTERM at step 3, as torchrun's agents do when the scheduler
    ends the job (Slurm's scancel, a spot reclaim of every node): every node drains and none is left
    to plan on, so the leader asks the job to stop; the workers save the step they stopped at and
    every agent exits 0 well within the notices' grace, instead of being killed when it runs out."""
    cmd = [sys.executable, "-m", "launcher.local", "--nodes", "2", "--log-dir", str(tmp_path / "runs")]
    cmd += ["--preempt", "0@3:120", "--preempt", "1@3:120", "--"]
    cmd += ["examples/train.py", "--config", "configs/gpt2-tiny.yaml", "training.steps=100000"]
    cmd += [f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.tensorboard_dir={tmp_path / 'tb'}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    out = done.stdout
    stopped = re.search(
        r"stopped at step (\d+) of 100000 on request \(every node of the job is draining \(preemption notices or "
        r"oobleck kill-agent\) and no other is up\); its checkpoint: (\S+); the same command resumes it",
        out,
    )
    assert done.returncode == 0 and stopped is not None, out[-4000:]
    step = int(stopped.group(1))
    assert stopped.group(2) == str(tmp_path / "ckpt" / f"step-{step:08d}") and step >= 3
    assert read_manifest(Path(stopped.group(2)))["step"] == step
    assert out.splitlines()[-1] == "[launcher] done: 2 node(s), 0 killed on purpose, 2 preempted, 0 failed", out[-3000:]


def test_a_ctrl_c_to_the_single_process_stops_it_at_a_boundary_with_its_checkpoint(tmp_path: Path) -> None:
    """`python examples/train.py` (the single process): a first SIGINT stops it after the step in
    flight, saved; it exits 0 with its summary, which says why it stopped."""
    cmd = [sys.executable, "examples/train.py", "--config", "configs/gpt2-tiny.yaml", "training.steps=100000"]
    cmd += [f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.tensorboard_dir={tmp_path / 'tb'}"]
    code, out = signal_after_steps(cmd, signal.SIGINT, 120)
    stopped = re.search(r"stopped at step (\d+) of 100000 on request \(Ctrl-C\); its checkpoint: (\S+);", out)
    assert code == 0 and stopped is not None, out[-3000:]
    step = int(stopped.group(1))
    assert stopped.group(2) == str(tmp_path / "ckpt" / f"step-{step:08d}")
    assert read_manifest(Path(stopped.group(2)))["step"] == step
    assert "stopped before training.steps: Ctrl-C" in out and "Traceback" not in out, out[-3000:]
