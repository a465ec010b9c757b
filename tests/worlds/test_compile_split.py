"""Compiled layers with the backward split (engine/stage/split_graphs.py, split_layer.py): torch's
zero-bubble passes run each layer's input-gradient graph in the I pass and its weight-gradient
graph in the W pass, a whole backward runs each once, the gradients are eager autograd's (fp32),
and a zero-bubble job with training.compile=true ends with the single-process reference's weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from oobleck_elastic.config import from_dict, load_config, to_dict
from oobleck_elastic.engine.stage.compiled import CompiledLayer, compiled_stage
from oobleck_elastic.engine.stage.split_layer import split_counters
from oobleck_elastic.engine.trainer import Trainer
from oobleck_elastic.models import build_layer_model, num_layers
import helpers
import ranks
from helpers import RandomTokens, layout_plan

ROOT = Path(__file__).resolve().parents[2]


def _counts() -> dict[str, int]:
    counts = dict(split_counters)
    split_counters.update(dict.fromkeys(split_counters, 0))
    return counts


def _grads(stage: nn.Module, x: torch.Tensor, grad: torch.Tensor, split: bool) -> list[torch.Tensor]:
    """The input's then every parameter's gradient of `stage(x)` for output gradient `grad`: by a
    whole backward, or by torch's split passes (I, then W) with the split counted per pass."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    for p in stage.parameters():
        p.grad = None
    xi = x.detach().requires_grad_()
    out = stage(xi)
    _counts()
    if not split:
        out.backward(grad)
        return [xi.grad, *(p.grad for p in stage.parameters())]
    (dx,), groups = stage_backward_input([out], [grad], [xi], stage.parameters())
    assert _counts() == {"input": len(stage), "weight": 0, "weight_only": 0, "replay": 0}  # I graphs only
    assert all(p.grad is None for p in stage.parameters())
    stage_backward_weight(stage.parameters(), groups)
    assert _counts() == {"input": 0, "weight": len(stage), "weight_only": 0, "replay": 0}  # W graphs only
    return [dx, *(p.grad for p in stage.parameters())]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_split_passes_run_each_graph_once_and_give_eager_gradients(family: str) -> None:
    cfg = load_config(
        ROOT / "configs/gpt2-tiny.yaml", ["data.seq_len=16", f"model.family={family}", "model.num_layers=2"]
    )
    n = num_layers(cfg.model)
    model = build_layer_model(cfg.model, seed=1, owned=list(range(n)), device="cpu")
    layers = [model.held(i) for i in range(1, n)]  # the blocks and the head: every input takes a gradient
    eager, compiled = nn.Sequential(*layers), compiled_stage(layers)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, cfg.model.hidden_size, generator=gen)
    grad = torch.randn(2, 16, cfg.model.vocab_size, generator=gen)
    want = _grads(eager, x, grad, split=False)
    for split in (False, True):
        got = _grads(compiled, x, grad, split)
        if not split:  # a whole backward: each layer's I then W graph, never W alone
            assert _counts() == {"input": len(layers), "weight": len(layers), "weight_only": 0, "replay": 0}
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    # the embedding (token ids: no input gradient) computes its weight gradient alone
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=gen)
    compiled_stage([model.held(0)])(ids).sum().backward()
    assert _counts() == {"input": 0, "weight": 0, "weight_only": 1, "replay": 0}


STEPS = 3
PLAN = layout_plan([[(0, 1), (1, 3), (3, 5), (5, 6)]], [8], generation=1, schedule="zero-bubble")
"""One pipeline of four stages, 8 microbatches: ZB-H1 over compiled layers, the tied wte / lm_head
on the first and last stages."""


def _worker(rank: int, world: int, tmp: str, cfg_dict: dict) -> None:
    cfg = from_dict(cfg_dict)
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    trainer = Trainer(cfg, dataset=RandomTokens(), plan=PLAN, rank=rank, store=store)
    assert type(trainer.schedule).__name__ == "OneChunkZeroBubble", type(trainer.schedule)  # ZB-H1, one chunk
    assert any(isinstance(m, CompiledLayer) for m in trainer.stage_module.modules())
    _counts()
    for step in range(STEPS):
        trainer.train_step(step)
    counts = _counts()
    layers = len(trainer.stage.layers())
    if rank == 0:  # the first stage's W pass is a whole backward; its embedding has no input gradient
        assert counts == {
            "input": (layers - 1) * 8 * STEPS,
            "weight": (layers - 1) * 8 * STEPS,
            "weight_only": 8 * STEPS,
            "replay": 0,  # no activation checkpointing: nothing replayed
        }
    else:
        assert counts == {"input": layers * 8 * STEPS, "weight": layers * 8 * STEPS, "weight_only": 0, "replay": 0}, (
            counts
        )
    torch.save(
        {f"{i}:{n}": t for i, layer in trainer.checkpoint_state.layer_state().items() for n, t in layer.items()},
        f"{tmp}/rank{rank}.pt",
    )
    trainer.close()


def _config(cache: Path, compile_: bool):
    return load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=16",
            "training.global_batch_size=16",
            "training.microbatch_size=2",
            f"training.steps={STEPS}",
            "training.optimizer.eps=1e-6",  # as tests/worlds/test_engine_schedules.py
            f"training.compile={str(compile_).lower()}",
            "planning.schedule=zero-bubble",
            f"data.cache_dir={cache}",
        ],
    )


@pytest.mark.slow
def test_a_compiled_zero_bubble_job_matches_the_single_process_reference(tmp_path: Path) -> None:
    """Four gloo ranks, one ZB-H1 pipeline of four stages over compiled layers: every weight ends as
    the eager single-process reference's (fp32)."""
    cfg = _config(tmp_path / "cache", True)
    ref = helpers.reference_state(_config(tmp_path / "cache", False), RandomTokens(), STEPS)
    ranks.spawn(_worker, args=(4, str(tmp_path), to_dict(cfg)), nprocs=4)
    merged: dict[str, torch.Tensor] = {}
    for rank in range(4):
        merged.update(torch.load(tmp_path / f"rank{rank}.pt", weights_only=True))
    assert set(merged) == set(ref)
    for key, t in merged.items():
        torch.testing.assert_close(t, ref[key], rtol=1e-5, atol=1e-6, msg=key)


CHUNKED = {
    # two devices, four virtual stages: device 0 holds layers 0 and 5 (zbv's V) or 0 and 3-4 (loop)
    "zbv": layout_plan([[(0, 1), (1, 3), (3, 5), (5, 6)]], [8], generation=1, schedule="zbv", chunks=2),
    "zero-bubble-2": layout_plan(
        [[(0, 1), (1, 3), (3, 5), (5, 6)]], [8], generation=2, schedule="zero-bubble", chunks=2
    ),
}


def _chunked_worker(rank: int, world: int, tmp: str, cfg_dict: dict) -> None:
    cfg = from_dict(cfg_dict)
    torch.set_num_threads(1)
    for name, plan in CHUNKED.items():
        store = dist.FileStore(os.path.join(tmp, f"store-{name}"), world)
        trainer = Trainer(cfg, dataset=RandomTokens(), plan=plan, rank=rank, store=store)
        assert any(isinstance(m, CompiledLayer) for m in trainer.stage_module.modules())
        _counts()
        for step in range(STEPS):
            trainer.train_step(step)
        assert _counts()["input"] > 0  # the split graphs ran
        state = {f"{i}:{n}": t for i, layer in trainer.checkpoint_state.layer_state().items() for n, t in layer.items()}
        torch.save(state, f"{tmp}/{name}-rank{rank}.pt")
        trainer.close()


@pytest.mark.extended  # runs in turns: its ground is covered at every landing (tests/README.md)
@pytest.mark.slow
def test_compiled_zbv_and_zero_bubble_with_chunks_match_the_single_process_reference(tmp_path: Path) -> None:
    """Two gloo ranks, each holding two chunks of compiled layers: under zbv (the tied wte /
    lm_head on the first and the last chunk of device 0) and under zero-bubble with 2 chunks, every
    weight ends as the eager single-process reference's (fp32)."""
    cfg = _config(tmp_path / "cache", True)
    ref = helpers.reference_state(_config(tmp_path / "cache", False), RandomTokens(), STEPS)
    ranks.spawn(_chunked_worker, args=(2, str(tmp_path), to_dict(cfg)), nprocs=2)
    for name in CHUNKED:
        merged: dict[str, torch.Tensor] = {}
        for rank in range(2):
            merged.update(torch.load(tmp_path / f"{name}-rank{rank}.pt", weights_only=True))
        assert set(merged) == set(ref), name
        for key, t in merged.items():
            torch.testing.assert_close(t, ref[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
