"""What activation checkpointing keeps (engine/stage/recompute.py), measured: the bytes a stage's
forward leaves allocated for its backward, read from torch's CPU memory profiler (every
allocation and free of the forward, by the operator that made it)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from oobleck_elastic.config import load_config
from oobleck_elastic.engine.stage.build import stage_module
from oobleck_elastic.models.build import build_layer_model

ROOT = Path(__file__).resolve().parents[2]


def _left_by_forward(recompute: bool) -> tuple[int, int, int]:
    """(bytes the forward of GPT-2 blocks 1-4 leaves allocated, one activation's bytes, blocks)."""
    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", [])
    model = build_layer_model(cfg.model, seed=1)
    blocks = model.num_layers - 2
    module = stage_module(model, 1, 1 + blocks, compile=False, dtype=None, recompute=recompute)
    x = torch.randn(4, 128, cfg.model.hidden_size, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = module(x)
    left = sum(e.self_cpu_memory_usage for e in prof.events())
    y.sum().backward()  # what was dropped is recomputed: the backward still runs
    assert x.grad is not None and all(p.grad is not None for p in module.parameters())
    return left, y.numel() * y.element_size(), blocks


def test_a_recomputed_stage_keeps_only_each_layers_input_and_its_random_state() -> None:
    kept, activation, blocks = _left_by_forward(recompute=True)
    rng = torch.get_rng_state().numel()
    # the output, and each block's input made inside the stage (the first is the caller's), and
    # each block's random state for its replay (5,056 bytes, allocated as 5,080): nothing else
    extra = kept - blocks * activation
    assert blocks * rng <= extra <= blocks * (rng + 64), (kept, activation, blocks)
    everything, _, _ = _left_by_forward(recompute=False)
    assert everything > 20 * kept, (everything, kept)  # 14.7 MB against 0.54 MB, measured
