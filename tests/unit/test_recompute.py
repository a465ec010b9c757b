"""What activation checkpointing keeps (models/recompute.py), measured: the bytes a stage's
forward leaves allocated for its backward, read from torch's CPU memory profiler (every
allocation and free of the forward, by the operator that made it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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


def test_the_profile_has_the_numbers_of_both_modes() -> None:
    """The profiler measures each layer without recomputation and counts, on one more forward, what
    it keeps recomputed (its input and random state); its backward recomputed is its measured
    backward plus its forward. One profile so plans every `training.activation_checkpoint`."""
    from oobleck_elastic.planning.profile.cache import profile_key
    from oobleck_elastic.planning.profile.profile import ModelProfile
    from oobleck_elastic.planning.profile.profiler import profile_model

    over = ["data.seq_len=64", "training.microbatch_size=4", "training.global_batch_size=8"]
    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", [*over, "training.activation_checkpoint=full"])
    key = profile_key(cfg, device="cpu")
    assert "activation_checkpoint" not in key and key["recomputed_variant"] == "derived"
    prof = profile_model(cfg, device="cpu", key=key)
    assert prof.modes == ("none", "full")
    block = prof.layers[1]
    x_bytes = 4 * 64 * 64 * 4  # the block's input: microbatch x sequence x hidden, fp32
    assert block.recomputed_activation_bytes == x_bytes + torch.get_rng_state().numel()
    assert block.activation_bytes > 20 * x_bytes
    assert block.recomputed_backward_s == block.backward_s + block.forward_s
    full = prof.in_mode("full")
    assert full.layers[1].activation_bytes == block.recomputed_activation_bytes
    assert full.layers[1].backward_s == block.recomputed_backward_s
    assert full.layers[1].input_grad_s == block.input_grad_s + block.forward_s  # the replay is I's
    assert full.layers[1].weight_grad_s == block.weight_grad_s
    assert full.modes == ("full",) and prof.in_mode("none") is prof
    # the last layer keeps, recomputed, its input and what the loss saves (the logits)
    head = prof.layers[-1]
    assert block.recomputed_activation_bytes < head.recomputed_activation_bytes < head.activation_bytes
    assert ModelProfile.from_json(prof.to_json()).layers == prof.layers


def _old_profile(tmp_path: Path, key: dict) -> str:
    """A profile file as written before the recomputed variant: one mode's numbers only."""
    layer = {"name": "block.0", "forward_s": 1.0, "backward_s": 2.0, "param_bytes": 8, "grad_bytes": 8}
    layer |= {"optimizer_bytes": 16, "activation_bytes": 100}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema_version": 1, "key": key, "layers": [layer]}))
    return str(path)


def test_an_older_profile_offers_the_mode_it_was_made_for(tmp_path: Path) -> None:
    from oobleck_elastic.planning.profile.profile import ModelProfile, ProfileError

    unstated = ModelProfile.load(_old_profile(tmp_path, {}))  # planned as it is for none and full (as before)
    assert unstated.modes == ("none",) and unstated.mode_unstated
    assert unstated.in_mode("full") is unstated and unstated.in_mode("none") is unstated
    with pytest.raises(ProfileError, match="not auto"):
        unstated.in_mode("auto")
    for key in ({"recompute": True}, {"activation_checkpoint": "full"}):
        old = ModelProfile.load(_old_profile(tmp_path, key))
        assert old.modes == ("full",) and old.in_mode("full") is old
        try:
            old.in_mode("none")
        except ProfileError as err:
            assert "not none" in str(err)
        else:
            raise AssertionError("numbers measured recomputed were read as those without recomputation")


def test_a_profile_without_the_jobs_mode_is_refused_in_one_line(tmp_path: Path) -> None:
    from oobleck_elastic.planning import load_profiles
    from oobleck_elastic.planning.profile.profile import ProfileError

    for mode in ("none", "full"):  # the analytic profiles have both
        cfg = load_config(ROOT / "configs/gpt3-175b.yaml", [f"training.activation_checkpoint={mode}"])
        assert set(load_profiles(cfg)) == {1}
    path = _old_profile(tmp_path, {"recompute": True})
    none = load_config(ROOT / "configs/gpt3-175b.yaml", ["training.activation_checkpoint=none"])
    try:
        load_profiles(none, path)
    except ProfileError as err:
        assert str(err) == (
            f"{path} has numbers for training.activation_checkpoint=full only (its backward times and activation "
            "bytes assume it) but this job has training.activation_checkpoint=none: set it to full, or use a "
            "profile made with both modes (profiles made now have both)"
        )
    else:
        raise AssertionError("a profile made for recomputation planned a job without it")
