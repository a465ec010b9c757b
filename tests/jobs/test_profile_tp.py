"""The tensor-parallel profiler under torchrun (planning/profile/tp.py): `torchrun --nproc-per-node T
-m oobleck_elastic.planning.profile.tp` measures the layers sharded over T workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from oobleck_elastic.planning import ModelProfile

ROOT = Path(__file__).resolve().parents[2]


def _profile(tmp: Path, workers: int) -> ModelProfile:
    """gpt2-tiny's profile measured by `workers` torchrun workers (tensor parallel over them)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(workers),
            "--standalone",
            "-m",
            "oobleck_elastic.planning.profile.tp",
            "--config",
            str(ROOT / "configs/gpt2-tiny.yaml"),
            "--out",
            str(tmp / "p-tp{tp}.json"),
            "planning.profile_repeats=1",
        ],
        check=True,
        capture_output=True,
        timeout=300,
        cwd=ROOT,
    )
    return ModelProfile.load(tmp / f"p-tp{workers}.json")


def test_profile_tp_measures_sharded_layers_with_torchrun(tmp_path: Path) -> None:
    """Two processes profile gpt2-tiny's layers sharded over both: per-device block bytes halve
    (but for the replicated norms and row-wise biases), embedding and head stay whole."""
    p1, p2 = _profile(tmp_path, 1), _profile(tmp_path, 2)
    assert (p1.tensor_parallel, p2.tensor_parallel) == (1, 2)
    h = 64
    replicated = 4 * (2 * h + 2 * h + h + h)  # ln_1, ln_2 (weight, bias), attn c_proj and mlp c_proj biases, fp32
    block1, block2 = p1.layers[1].param_bytes, p2.layers[1].param_bytes
    assert block2 == (block1 - replicated) // 2 + replicated
    assert [p2.layers[i].param_bytes for i in (0, -1)] == [p1.layers[i].param_bytes for i in (0, -1)]
