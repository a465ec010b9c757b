"""The torch internals the engine uses: all present in the pinned torch, a missing one named at
start (one line, a known error), and pyproject.toml pinning the releases they were read against."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from torch.distributed.pipelining import schedules

from oobleck_elastic.config import load_config
from oobleck_elastic.engine import torch_internals
from oobleck_elastic.engine.resilience.progress import Progress, watch_pipeline_waits
from oobleck_elastic.engine.startup import KNOWN_ERRORS, check_start, one_line

ROOT = Path(__file__).resolve().parents[2]


def test_this_torch_has_every_internal() -> None:
    assert torch_internals.missing_internals() == []


def test_a_missing_internal_is_named_and_refuses_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(schedules, "_wait_batch_p2p")
    cfg = load_config(ROOT / "configs" / "gpt2-tiny.yaml", [])
    with pytest.raises(torch_internals.TorchInternalsError) as caught:
        check_start(cfg)
    assert isinstance(caught.value, KNOWN_ERRORS)
    line = one_line(caught.value)
    assert "torch.distributed.pipelining.schedules._wait_batch_p2p (marks a pipeline's waits" in line
    pin = torch_internals.SUPPORTED_TORCH
    assert line.endswith(f"install torch{pin}, the releases whose internals this version of oobleck_elastic uses")
    with pytest.raises(RuntimeError, match="_wait_batch_p2p is missing"):
        watch_pipeline_waits(Progress())


def test_pyproject_pins_the_releases_the_internals_were_read_against() -> None:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    pins = re.findall(r'"torch([<>=!~][^"]*)"', text)
    assert pins == [torch_internals.SUPPORTED_TORCH]
