"""The engine runs zero-bubble (ZB-H1, one chunk per device: torch's interleaved zero-bubble schedule
on one stage per worker, the backward split into input and weight gradients, at any microbatch
count), and with several non-contiguous virtual stages per worker interleaved 1F1B, interleaved
zero-bubble and zbv (the V: device d holds stages d and 2 D - 1 - d). Invariant 1 holds under each:
four gloo ranks train plans whose pipelines all run zero-bubble (two pipelines of two stages;
three stages beside one stage, with fewer microbatches than stages; four stages in two rounds;
three stages with 7 microbatches, which torch's rounds rule refuses) or, with two chunks per
device, interleaved-1f1b or zero-bubble (two pipelines of two devices; three devices of one-layer
chunks beside a one-device pipeline) or zbv (two pipelines of two devices; three devices with
fewer microbatches than the V holds, device 0 holding the tied first and last layers) and end
with the single-process reference's weights (1e-5 relative, fp32); every layer shared with
another pipeline had its all-reduce posted during the schedule. A node killed under each is
tests/jobs/test_recovery.py's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from oobleck_elastic.config import from_dict, load_config, to_dict
from oobleck_elastic.engine.trainer import Trainer
import helpers
import ranks
from helpers import RandomTokens, layout_plan

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3

PLANS = [
    # f+1 = two pipelines of two stages, 4 microbatches each (two rounds of two)
    layout_plan([[(0, 3), (3, 6)], [(0, 2), (2, 6)]], [4, 4], generation=1, schedule="zero-bubble"),
    # three stages with 2 microbatches (fewer than stages), beside a one-stage pipeline
    layout_plan([[(0, 1), (1, 3), (3, 6)], [(0, 6)]], [2, 6], generation=2, schedule="zero-bubble"),
    # one pipeline of four stages, 8 microbatches: the tied wte / lm_head on the first and last
    layout_plan([[(0, 1), (1, 3), (3, 5), (5, 6)]], [8], generation=3, schedule="zero-bubble"),
    # three stages with 7 microbatches, which torch's rounds rule refuses (7 // 3 = 2 rounds) and one
    # chunk does not need (engine/stage/zero_bubble.py), beside a one-stage pipeline of one microbatch
    layout_plan([[(0, 2), (2, 4), (4, 6)], [(0, 6)]], [7, 1], generation=4, schedule="zero-bubble"),
]


def config():
    # the same run as tests/worlds/test_engine.py (eps=1e-6: see there)
    return load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=16",
            "training.global_batch_size=16",
            "training.microbatch_size=2",
            f"training.steps={STEPS}",
            "training.optimizer.eps=1e-6",
        ],
    )


def _train_and_save(trainer: Trainer, path: str) -> None:
    """STEPS steps, then this worker's layers saved to `path`. After every step, each layer shared
    with another pipeline had its all-reduce posted during the schedule (found final by its last
    W pass, or by the accumulation hooks in every chunk: engine/step/grad_sync.py)."""
    for step in range(STEPS):
        trainer.train_step(step)
        sync = trainer.grad_sync
        assert sync is not None and sync.posted_early == sum(len(v) for v in sync.sequence.values())
    torch.save(
        {f"{i}:{n}": t for i, layer in trainer.checkpoint_state.layer_state().items() for n, t in layer.items()}, path
    )
    trainer.close()


def _assert_every_copy_is_the_reference(tmp: Path, name: str, ref: dict[str, torch.Tensor]) -> None:
    """Every rank's saved copy of every parameter (`<name>-rank<r>.pt`) equals the reference."""
    merged: dict[str, list[torch.Tensor]] = {}
    for rank in range(4):
        for key, t in torch.load(tmp / f"{name}-rank{rank}.pt", weights_only=True).items():
            merged.setdefault(key, []).append(t)
    assert set(merged) == set(ref), f"{name}: parameters missing"
    for key, copies in merged.items():
        for t in copies:  # every replica equals the reference
            torch.testing.assert_close(t, ref[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")


def _worker(rank: int, world: int, tmp: str, cfg_dict: dict) -> None:
    cfg = from_dict(cfg_dict)
    torch.set_num_threads(1)
    for k, plan in enumerate(PLANS):
        store = dist.FileStore(os.path.join(tmp, f"store{k}"), world)
        trainer = Trainer(cfg, dataset=RandomTokens(), plan=plan, rank=rank, store=store)
        if len(trainer.pipeline.stages) > 1:
            # torch's zero-bubble schedule, whose weight-gradient passes are timed and progress points
            # like the forward and the input-gradient passes (engine/resilience/{straggler,progress}.py)
            # (with one round whatever the microbatches: the order torch builds where it accepts them)
            assert type(trainer.schedule).__name__ == "OneChunkZeroBubble", type(trainer.schedule)
            (stage,) = trainer.schedule._stages
            order = trainer.schedule.pipeline_order[trainer.stage.index]
            kinds = {a.computation_type.value for a in order if a is not None}
            assert {"F", "I", "W"} <= kinds, kinds
            for chunk in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                assert chunk in vars(stage) and hasattr(vars(stage)[chunk], "__wrapped__"), chunk
        _train_and_save(trainer, os.path.join(tmp, f"plan{k}-rank{rank}.pt"))


@pytest.mark.slow
def test_zero_bubble_plans_match_the_single_process_reference(tmp_path: Path) -> None:
    cfg = config()
    ref = helpers.reference_state(cfg, RandomTokens(), STEPS)
    ranks.spawn(_worker, args=(4, str(tmp_path), to_dict(cfg)), nprocs=4)
    for k in range(len(PLANS)):
        _assert_every_copy_is_the_reference(tmp_path, f"plan{k}", ref)
    fresh = helpers.reference_state(cfg, RandomTokens(), 0)  # training happened: every tensor moved
    assert all(not torch.equal(t, fresh[k]) for k, t in ref.items())


INTERLEAVED = [
    # two pipelines of two devices, two chunks each: device 0 holds layers 0-1 and 3, device 1 layer 2 and 4-5
    layout_plan(
        [[(0, 2), (2, 3), (3, 4), (4, 6)], [(0, 1), (1, 2), (2, 4), (4, 6)]],
        [4, 4],
        generation=1,
        schedule="interleaved-1f1b",
        chunks=2,
    ),
    # three devices of two one-layer chunks (6 microbatches: two rounds of three), beside one device
    # holding both chunks of a one-device pipeline
    layout_plan(
        [[(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)], [(0, 3), (3, 6)]],
        [6, 2],
        generation=2,
        schedule="interleaved-1f1b",
        chunks=2,
    ),
]


ZERO_BUBBLE_CHUNKS = [
    # interleaved zero-bubble: the layouts of INTERLEAVED, each backward split into I and W
    layout_plan(
        [[(0, 2), (2, 3), (3, 4), (4, 6)], [(0, 1), (1, 2), (2, 4), (4, 6)]],
        [4, 4],
        generation=1,
        schedule="zero-bubble",
        chunks=2,
    ),
    layout_plan(
        [[(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)], [(0, 3), (3, 6)]],
        [6, 2],
        generation=2,
        schedule="zero-bubble",
        chunks=2,
    ),
]

ZBV = [
    # the V on two devices: device 0 holds stages 0 and 3 (layers 0 and 3-5), device 1 stages 1 and 2
    layout_plan(
        [[(0, 1), (1, 2), (2, 3), (3, 6)], [(0, 2), (2, 3), (3, 4), (4, 6)]],
        [4, 4],
        generation=1,
        schedule="zbv",
        chunks=2,
    ),
    # three devices of one-layer stages, 2 microbatches (fewer than the V's 2 D - 1 = 5): device 0
    # holds the first and the last layer (the tied wte and lm_head), beside a one-device pipeline
    layout_plan(
        [[(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)], [(0, 3), (3, 6)]],
        [2, 6],
        generation=2,
        schedule="zbv",
        chunks=2,
    ),
]

CHUNKED = {
    "interleaved": (INTERLEAVED, "ScheduleInterleaved1F1B"),
    "zero-bubble-2": (ZERO_BUBBLE_CHUNKS, "ScheduleInterleavedZeroBubble"),
    "zbv": (ZBV, "ScheduleZBVZeroBubble"),
}
"""Plans with two chunks per device, and the torch schedule each worker must run them with."""


def _chunked_worker(rank: int, world: int, tmp: str, cfg_dict: dict, name: str) -> None:
    cfg = from_dict(cfg_dict)
    torch.set_num_threads(1)
    plans, cls_name = CHUNKED[name]
    for k, plan in enumerate(plans):
        store = dist.FileStore(os.path.join(tmp, f"store{k}"), world)
        trainer = Trainer(cfg, dataset=RandomTokens(), plan=plan, rank=rank, store=store)
        assert trainer.owned == sorted(trainer.stage.layers())  # every chunk's layers, not one range
        if len(trainer.pipeline.stages) > 1:
            assert type(trainer.schedule).__name__ == cls_name, type(trainer.schedule)
            d, i = len(trainer.pipeline.stages), trainer.stage.index
            # the planner's placement (planning/schedules/schedules.py): loop, or the V of zbv
            held = [i, 2 * d - 1 - i] if name == "zbv" else [i, d + i]
            assert [s.stage_index for s in trainer.schedule._stages] == held
            assert trainer.holds_first_last == (i == 0, i == (0 if name == "zbv" else d - 1))
            order = trainer.schedule.pipeline_order[i]
            kinds = {a.computation_type.value for a in order if a is not None}
            assert kinds == ({"F", "B"} if name == "interleaved" else {"F", "I", "W"}), kinds
        _train_and_save(trainer, os.path.join(tmp, f"{name}{k}-rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHUNKED))
def test_plans_with_two_chunks_per_device_match_the_single_process_reference(tmp_path: Path, name: str) -> None:
    """Interleaved 1F1B, interleaved zero-bubble and zbv, each on its plans above."""
    cfg = config()
    ref = helpers.reference_state(cfg, RandomTokens(), STEPS)
    ranks.spawn(_chunked_worker, args=(4, str(tmp_path), to_dict(cfg), name), nprocs=4)
    for k in range(len(CHUNKED[name][0])):
        _assert_every_copy_is_the_reference(tmp_path, f"{name}{k}", ref)
