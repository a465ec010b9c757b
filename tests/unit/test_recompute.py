"""What activation checkpointing keeps (models/recompute.py), measured: the bytes a stage's
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


def test_the_profile_measures_the_layers_as_the_engine_runs_them() -> None:
    """With `training.activation_checkpoint=full` the profiler measures each layer recomputed, as
    the engine runs it: a block keeps its input and random state, and the profile's key says so."""
    from oobleck_elastic.planning.profile.cache import profile_key
    from oobleck_elastic.planning.profile.profiler import profile_model

    over = ["data.seq_len=64", "training.microbatch_size=4", "training.global_batch_size=8"]
    profiles = {}
    for mode in ("none", "full"):
        cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", [*over, f"training.activation_checkpoint={mode}"])
        key = profile_key(cfg, device="cpu")
        assert key.get("activation_checkpoint") == (None if mode == "none" else "full")
        profiles[mode] = profile_model(cfg, device="cpu", key=key)
    block = {mode: p.layers[1] for mode, p in profiles.items()}
    x_bytes = 4 * 64 * 64 * 4  # the block's input: microbatch x sequence x hidden, fp32
    assert block["full"].activation_bytes == x_bytes + torch.get_rng_state().numel()
    assert block["none"].activation_bytes > 20 * x_bytes
    # its times include the replay (tests/worlds/test_recompute.py counts the forwards; timings on
    # a shared machine are not asserted here)


def test_a_profile_made_for_another_recompute_mode_is_refused_in_one_line() -> None:
    from oobleck_elastic.planning import load_profiles
    from oobleck_elastic.planning.profile.profile import ProfileError

    cfg = load_config(ROOT / "configs/gpt3-175b.yaml", [])
    assert cfg.training.activation_checkpoint == "full"  # what its analytic profile assumes
    assert set(load_profiles(cfg)) == {1}
    none = load_config(ROOT / "configs/gpt3-175b.yaml", ["training.activation_checkpoint=none"])
    try:
        load_profiles(none)
    except ProfileError as err:
        assert str(err) == (
            f"{ROOT / 'configs/profiles/gpt3-175b-tp1.json'} was made with training.activation_checkpoint=full (its "
            "backward times and activation bytes assume it) but this job has training.activation_checkpoint=none: "
            "set it to full, or use a profile made for it"
        )
    else:
        raise AssertionError("a profile made for recomputation planned a job without it")
