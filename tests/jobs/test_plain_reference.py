"""An independent reference: a plain PyTorch loop over the Hugging Face model, without the engine.

Every other "same weights as one process" test compares a job with the engine's own `Trainer` on
the one-worker plan, so a mistake in the engine's math (its layers, loss normalisation, clipping,
optimizer groups, learning-rate schedule) would be in both sides. Here the reference is
the Hugging Face model (`transformers.GPT2LMHeadModel`; `LlamaForCausalLM` for the Llama
configuration) trained by a loop written from the documented rules alone
(docs/training.md "Training"; docs/design.md invariant 1): the whole global batch in one forward, the token
cross-entropy summed and divided by the global token count, `torch.nn.utils.clip_grad_norm_`,
`torch.optim.AdamW` (not fused) with weight decay on matrices only, linear warm-up then cosine
decay to `min_lr_ratio`. It shares with the engine only what defines the run, not how it is
computed: the initial weights (the engine's step-0 checkpoint exported to a Hugging Face
directory, `oobleck export`), the data windows and the order of the samples (a function of
(seed, step), data/dataset.py). The engine's final weights, exported the same way, must match it
to 1e-5 relative (fp32, the tolerance of the other equality tests: the engine sums microbatches
and, in a job, pipelines and replicas in another order than one full-batch forward does).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from oobleck_elastic.config import load_config
from oobleck_elastic.data.sampler import GlobalBatchSampler
from oobleck_elastic.data.dataset import build_dataset
from oobleck_elastic.engine.run import train
from oobleck_elastic.engine.checkpointing import save
from oobleck_elastic.engine.reference import single_process
from oobleck_elastic.models.export import export_checkpoint
from helpers import ROOT, overrides, run_job, tiny_profile

STEPS = 8
RTOL, ATOL = 1e-5, 1e-6


def _lr(step: int, t) -> float:
    """Linear warm-up over warmup_steps, then cosine from the peak to min_lr_ratio x the peak."""
    s = t.lr_schedule
    if step < s.warmup_steps:
        return t.optimizer.lr * (step + 1) / s.warmup_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, t.steps - s.warmup_steps))
    assert s.decay == "cosine"
    return t.optimizer.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def plain_run(cfg, initial: Path, *, decay_everything: bool = False) -> dict[str, torch.Tensor]:
    """`STEPS` steps of the Hugging Face model in the directory `initial` (GPT2LMHeadModel or
    LlamaForCausalLM, as its config says); its state dict, a tied head left out. `decay_everything`:
    weight decay on biases and norms too (a common difference, to see the comparison fail)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(initial, attn_implementation="eager", torch_dtype=torch.float32)
    assert type(model).__name__ in ("GPT2LMHeadModel", "LlamaForCausalLM"), type(model)
    model.train()
    t = cfg.training
    params = list(model.parameters())  # unique: the tied head is the embedding
    decayed = [p for p in params if p.ndim >= 2 or decay_everything]
    opt = torch.optim.AdamW(
        [
            {"params": decayed, "weight_decay": t.optimizer.weight_decay},
            {"params": [p for p in params if all(p is not d for d in decayed)], "weight_decay": 0.0},
        ],
        lr=t.optimizer.lr,
        betas=tuple(t.optimizer.betas),
        eps=t.optimizer.eps,
        foreach=False,
    )
    dataset = build_dataset(cfg, log=lambda *_: None)
    order = GlobalBatchSampler(len(dataset), t.global_batch_size, t.seed)
    for step in range(STEPS):
        x, y = map(torch.stack, zip(*(dataset[i] for i in order.indices(step))))
        logits = model(input_ids=x).logits
        loss = (
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), reduction="sum"
            )
            / y.numel()
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.optimizer.grad_clip)
        for group in opt.param_groups:
            group["lr"] = _lr(step, t)
        opt.step()
    seen: set[int] = set()  # a tied head is the embedding: keep its first name only, as the export does
    out = {}
    for k, v in model.state_dict().items():
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            out[k] = v.detach()
    return out


def _initial(cfg, tmp: Path) -> Path:
    """The engine's initial weights (step 0) as a Hugging Face directory."""
    trainer = single_process(cfg, dataset=build_dataset(cfg, log=lambda *_: None))
    try:
        step_dir = save(trainer, tmp / "init-ckpt", next_step=0)
    finally:
        trainer.close()
    return export_checkpoint(step_dir, tmp / "init-hf", log=lambda *_: None)


def _exported(ckpt_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    export_checkpoint(ckpt_dir, out, log=lambda *_: None)
    return load_file(str(out / "model.safetensors"))


def _assert_match(engine: dict[str, torch.Tensor], plain: dict[str, torch.Tensor], initial: Path) -> None:
    start = load_file(str(initial / "model.safetensors"))
    assert set(engine) == set(plain), set(engine) ^ set(plain)
    for key in plain:
        assert not torch.equal(plain[key], start[key]), f"{key} did not train"
        torch.testing.assert_close(engine[key], plain[key], rtol=RTOL, atol=ATOL, msg=key)


def _cfg(tmp: Path, profile: Path, config: str = "gpt2-tiny"):
    return load_config(ROOT / f"configs/{config}.yaml", overrides(tmp, STEPS, profile))


@pytest.mark.core
@pytest.mark.parametrize("config", ["gpt2-tiny", "llama-tiny"])
def test_the_one_worker_engine_matches_a_plain_hugging_face_loop(tmp_path: Path, config: str) -> None:
    cfg = _cfg(tmp_path / "ref", tiny_profile(tmp_path / "profile.json"), config)
    initial = _initial(cfg, tmp_path)
    plain = plain_run(cfg, initial)
    train(cfg)
    _assert_match(_exported(Path(cfg.checkpoint.dir), tmp_path / "engine-hf"), plain, initial)


@pytest.mark.core
@pytest.mark.parametrize("config", ["gpt2-tiny", "llama-tiny"])
def test_the_reference_fails_when_the_math_differs(tmp_path: Path, config: str) -> None:
    """The comparison can fail: the same loop with weight decay on biases and norms too does not
    match the engine (which decays matrices only)."""
    cfg = _cfg(tmp_path / "ref", tiny_profile(tmp_path / "profile.json"), config)
    initial = _initial(cfg, tmp_path)
    train(cfg)
    engine = _exported(Path(cfg.checkpoint.dir), tmp_path / "engine-hf")
    with pytest.raises(AssertionError, match=r"^(transformer|model)\.\S+$"):  # names the first tensor off
        _assert_match(engine, plain_run(cfg, initial, decay_everything=True), initial)


@pytest.mark.slow
def test_a_four_node_job_matches_the_plain_loop(tmp_path: Path, etcd_server, run_id) -> None:
    """Two two-stage pipelines on four nodes, a node killed at step 3 (the job re-plans)."""
    profile = tiny_profile(tmp_path / "profile.json")
    out, _, _ = run_job(
        tmp_path, etcd_server, run_id, ["--nodes", "4", "--kill", "1@3"], STEPS, profile, reference=False
    )
    # the job re-planned around the kill (in generation 2, or a later one when an entry broke:
    # the weights are what this test is about; how fast it recovers is bench/recovery.py's)
    assert re.search(r"generation 1 -> \d+ \(failure: -node\d\)", out), out[-3000:]
    cfg = _cfg(tmp_path / "job", profile)
    initial = _initial(
        load_config(ROOT / "configs/gpt2-tiny.yaml", overrides(tmp_path / "init", STEPS, profile)), tmp_path
    )
    _assert_match(_exported(tmp_path / "job" / "ckpt", tmp_path / "job-hf"), plain_run(cfg, initial), initial)
