"""Activation checkpointing (`training.activation_checkpoint: full`, models/recompute.py)
under every schedule the engine runs: 1F1B (beside one-device pipelines), zero-bubble on one chunk,
interleaved 1F1B, interleaved zero-bubble and zbv, on the plans of
tests/worlds/test_engine_schedules.py. Every copy of every layer ends as the single-process
reference's trained without recomputation, and each layer's forward ran exactly twice per
microbatch: once in the forward, once again in the backward (a split backward's weight pass
recomputes nothing: it reads what its input pass recomputed). A plan whose stages differ in mode
(`auto`) is run as it says, stage by stage."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import helpers
import ranks
from oobleck_elastic.config import from_dict, load_config, to_dict
from oobleck_elastic.planning.plan.plan import Plan
from oobleck_elastic.models.recompute import Recomputed
from oobleck_elastic.engine.trainer import Trainer
from helpers import RandomTokens
from test_engine_schedules import (
    INTERLEAVED,
    PLANS,
    STEPS,
    ZBV,
    ZERO_BUBBLE_CHUNKS,
    _assert_every_copy_is_the_reference,
)

ROOT = Path(__file__).resolve().parents[2]
RUNS = {
    "1f1b": [
        helpers.layout_plan([[(0, 1), (1, 3), (3, 5), (5, 6)]], [8], generation=1),
        helpers.layout_plan([[(0, 2), (2, 4), (4, 6)], [(0, 6)]], [7, 1], generation=2),
    ],
    "interleaved": INTERLEAVED,
    "zero-bubble": PLANS,
    "zero-bubble-2": ZERO_BUBBLE_CHUNKS,
    "zbv": ZBV,
}


OVERRIDES = [
    "data.seq_len=16",
    "training.global_batch_size=16",
    "training.microbatch_size=2",
    f"training.steps={STEPS}",
    "training.optimizer.eps=1e-6",
]


def config(mode: str):
    return load_config(ROOT / "configs/gpt2-tiny.yaml", [*OVERRIDES, f"training.activation_checkpoint={mode}"])


def _worker(rank: int, world: int, tmp: str, cfg_dict: dict, name: str) -> None:
    cfg = from_dict(cfg_dict)
    torch.set_num_threads(1)
    for k, plan in enumerate(RUNS[name]):
        store = dist.FileStore(os.path.join(tmp, f"store{k}"), world)
        trainer = Trainer(cfg, dataset=RandomTokens(), plan=plan, rank=rank, store=store)
        wrapped = [m for m in trainer.stage_module.modules() if isinstance(m, Recomputed)]
        assert len(wrapped) == len(trainer.owned), (len(wrapped), trainer.owned)  # every layer it holds
        calls = [0]

        def count(*_: object, calls: list[int] = calls) -> None:
            calls[0] += 1

        hooks = [m.layer.register_forward_pre_hook(count) for m in wrapped]
        microbatches = trainer.pipeline.microbatches
        for step in range(STEPS):
            calls[0] = 0
            trainer.train_step(step)
            assert calls[0] == 2 * microbatches * len(wrapped), (name, k, calls[0], microbatches, len(wrapped))
        for h in hooks:
            h.remove()
        torch.save(
            {f"{i}:{n}": t for i, layer in trainer.checkpoint_state.layer_state().items() for n, t in layer.items()},
            os.path.join(tmp, f"{name}{k}-rank{rank}.pt"),
        )
        trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",  # 1f1b and zero-bubble at every landing; the chunked schedules in turns (tests/README.md)
    [n if n in ("1f1b", "zero-bubble") else pytest.param(n, marks=pytest.mark.extended) for n in RUNS],
)
def test_recomputed_layers_train_as_the_reference_under_every_schedule(tmp_path: Path, name: str) -> None:
    ref = helpers.reference_state(config("none"), RandomTokens(), STEPS)
    ranks.spawn(_worker, args=(4, str(tmp_path), to_dict(config("full")), name), nprocs=4)
    for k in range(len(RUNS[name])):
        _assert_every_copy_is_the_reference(tmp_path, f"{name}{k}", ref)


def _compiled_worker(rank: int, world: int, tmp: str, cfg_dict: dict) -> None:
    from oobleck_elastic.engine.stage.split_layer import split_counters

    cfg = from_dict(cfg_dict)
    torch.set_num_threads(1)
    for k, plan in enumerate(PLANS[:1]):
        store = dist.FileStore(os.path.join(tmp, f"store{k}"), world)
        trainer = Trainer(cfg, dataset=RandomTokens(), plan=plan, rank=rank, store=store)
        for step in range(STEPS):
            before = split_counters["replay"]
            trainer.train_step(step)
            replays = split_counters["replay"] - before  # one forward graph replayed per layer and microbatch
            assert replays == trainer.pipeline.microbatches * len(trainer.owned), (rank, step, replays)
        torch.save(
            {f"{i}:{n}": t for i, layer in trainer.checkpoint_state.layer_state().items() for n, t in layer.items()},
            os.path.join(tmp, f"compiled{k}-rank{rank}.pt"),
        )
        trainer.close()


@pytest.mark.extended  # runs in turns: its ground is covered at every landing (tests/README.md)
@pytest.mark.slow
def test_compiled_layers_replay_their_forward_graph_once_under_zero_bubble(tmp_path: Path) -> None:
    """Compiled layers keep their saved tensors outside autograd (engine/stage/split_layer.py): with
    recomputation they keep the forward graph's inputs and replay it once per layer and microbatch,
    in whichever of the input and weight passes runs first."""
    ref = helpers.reference_state(config("none"), RandomTokens(), STEPS)
    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", [*OVERRIDES, "training.activation_checkpoint=full"])
    cfg.training.compile = True
    ranks.spawn(_compiled_worker, args=(4, str(tmp_path), to_dict(cfg)), nprocs=4)
    _assert_every_copy_is_the_reference(tmp_path, "compiled0", ref)


@pytest.mark.slow
def test_tensor_parallel_layers_recompute_as_the_reference(tmp_path: Path) -> None:
    """One pipeline of two 2-lane stages (tests/worlds/test_tensor_parallel.py): sharded layers
    recomputed in the backward train as the reference without recomputation."""
    import test_tensor_parallel as tp

    ref = tp.reference_state(tp.config())
    cfg = tp.config()
    cfg.training.activation_checkpoint = "full"
    runs = [("one", tp.ONE_PIPELINE, list(range(tp.STEPS)), None, None)]
    ranks.spawn(tp._train_worker, args=(4, str(tmp_path), to_dict(cfg), runs), nprocs=4)
    tp.check_runs(tmp_path, ref, "one", 4)


def _modes(plan: Plan, modes: list[list[str]]) -> Plan:
    """`plan` with each stage's `activation_checkpoint` from `modes` (per pipeline, per stage)."""
    pipelines = tuple(
        dataclasses.replace(
            p, stages=tuple(dataclasses.replace(s, activation_checkpoint=m) for s, m in zip(p.stages, ms, strict=True))
        )
        for p, ms in zip(plan.pipelines, modes, strict=True)
    )
    return dataclasses.replace(plan, pipelines=pipelines)


MIXED = [  # two pipelines of two stages: in each, one stage recomputes and one does not
    _modes(
        helpers.layout_plan([[(0, 3), (3, 6)], [(0, 2), (2, 6)]], [4, 4], generation=1, schedule=schedule),
        [["full", "none"], ["none", "full"]],
    )
    for schedule in ("1f1b", "zero-bubble")
]


def _mixed_worker(rank: int, world: int, tmp: str, cfg_dict: dict) -> None:
    cfg = from_dict(cfg_dict)
    torch.set_num_threads(1)
    for k, plan in enumerate(MIXED):
        store = dist.FileStore(os.path.join(tmp, f"store{k}"), world)
        trainer = Trainer(cfg, dataset=RandomTokens(), plan=plan, rank=rank, store=store)
        _, stage = plan.stage_of(rank)
        wrapped = [m for m in trainer.stage_module.modules() if isinstance(m, Recomputed)]
        assert len(wrapped) == (len(trainer.owned) if stage.activation_checkpoint == "full" else 0), (rank, k)
        for step in range(STEPS):
            trainer.train_step(step)
        torch.save(
            {f"{i}:{n}": t for i, layer in trainer.checkpoint_state.layer_state().items() for n, t in layer.items()},
            os.path.join(tmp, f"mixed{k}-rank{rank}.pt"),
        )
        trainer.close()


@pytest.mark.slow
def test_stages_recompute_as_the_plan_says_and_train_as_the_reference(tmp_path: Path) -> None:
    """`training.activation_checkpoint: auto` leaves the choice to the plan: each worker recomputes
    when its stage says `full` (engine/stage/build.py `recomputes`), under 1F1B and zero-bubble,
    and the weights are the reference's."""
    ref = helpers.reference_state(config("none"), RandomTokens(), STEPS)
    ranks.spawn(_mixed_worker, args=(4, str(tmp_path), to_dict(config("auto"))), nprocs=4)
    for k in range(len(MIXED)):
        _assert_every_copy_is_the_reference(tmp_path, f"mixed{k}", ref)
