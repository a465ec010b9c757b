"""The progress line (engine/telemetry/metrics.py): short, an unknown MFU said once, the first
step of every generation reported whatever the interval, the estimate scaled on paced devices."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from oobleck_elastic.engine.step.result import StepResult
from oobleck_elastic.engine.telemetry.metrics import Metrics
from oobleck_elastic.testing import layout_plan


def test_progress_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics(
        tmp_path / "tb",
        enabled=True,
        samples_per_step=8,
        tokens_per_step=512,
        total_steps=8,
        log_interval=3,
        node="n0",
        flops_per_token=1e6,
        peak_tflops=None,
        paced=4.0,
    )
    gen1 = dataclasses.replace(layout_plan([[(0, 6)]], [8], generation=1), est_step_time_s=0.25)
    gen2 = dataclasses.replace(gen1, generation=2, est_step_time_s=0.5)
    with caplog.at_level(logging.INFO, logger="oobleck_elastic.train"):
        for step in range(8):
            result = StepResult(step=step, loss=3.0, seconds=1.0, grad_norm=1.0, peak_rss_bytes=10**9)
            metrics.step(result, lr=1e-3, plan=gen1 if step < 4 else gen2, wall_s=2.0 if step == 4 else 1.0)
    metrics.close()
    lines = [r.getMessage() for r in caplog.records if "s/step" in r.getMessage()]
    # steps done 1 (first of gen 1), 3, 5 (first of gen 2), 6, 8 (the last)
    assert [line.split(":")[0] for line in lines] == [
        "gen 1 step 1/8 node n0",
        "gen 1 step 3/8 node n0",
        "gen 2 step 5/8 node n0",
        "gen 2 step 6/8 node n0",
        "gen 2 step 8/8 node n0",
    ]
    assert "1.000 s/step (1.000 s since the last, plan est. 1.000 s)" in lines[0]  # 4 x 0.25 on paced devices
    assert "(2.000 s since the last, plan est. 2.000 s)" in lines[2]
    assert "MFU unknown (set training.peak_tflops)" in lines[0]
    assert not any("MFU" in line for line in lines[1:])  # said once
    assert len(lines[0]) < 215 and all(len(line) < 175 for line in lines[1:]), lines
