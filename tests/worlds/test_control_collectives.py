"""Control collectives pass torch's own checker (TORCH_DISTRIBUTED_DEBUG=DETAIL) across an entry
that moves layers and shadow copies between some ranks only, then a checkpoint retake and steps
(engine/step/collectives.py).

Three gloo ranks, with one shadow copy of every layer, re-plan (generation 2 moves layer 2 to
n1, and places the shadows again); every rank then retakes a checkpoint and trains on. Before
the control collectives had a group of their own, the entry's transfers ran on the group the
retake's all-reduce and the step's collectives ran on; gloo counts a rank's sends and receives
in its group's sequence number, so the checker reported "Detected mismatch between collectives
on ranks" at the retake (seen in a 4-node job's error record). The weights equal the
single-process reference.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from oobleck_elastic import checkpoint as ckpt
from oobleck_elastic.config import from_dict, load_config, to_dict
from oobleck_elastic.engine.checkpointing import CheckpointPolicy
from oobleck_elastic.engine.trainer import Trainer
from oobleck_elastic.planning import Plan
from oobleck_elastic.planning.tolerance.shadows import place_shadows
from oobleck_elastic.testing import node_plan
import helpers
import ranks
from helpers import RandomTokens

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
RETAKE_AT = 2


def _plan(generation: int, pipelines: list[list[tuple[str, int, int]]]) -> Plan:
    plan = node_plan(generation, pipelines, [4, 4])
    return dataclasses.replace(plan, shadows=place_shadows(plan, 1, [1] * 6, 100))


BEFORE = _plan(1, [[("n0", 0, 3), ("n1", 3, 6)], [("n2", 0, 6)]])
AFTER = _plan(2, [[("n0", 0, 2), ("n1", 2, 6)], [("n2", 0, 6)]])


def config(ckpt_dir: str = ""):
    return load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=16",
            "training.global_batch_size=16",
            "training.microbatch_size=2",
            f"training.steps={STEPS}",
            "training.optimizer.eps=1e-6",
            "fault_tolerance.fingerprint_interval_steps=1",  # the replica check's all-gather every step
            *([f"checkpoint.dir={ckpt_dir}"] if ckpt_dir else []),
        ],
    )


def _worker(rank: int, world: int, tmp: str, cfg_dict: dict) -> None:
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()  # read at import; set before any process group exists
    cfg = from_dict(cfg_dict)
    torch.set_num_threads(1)
    trainer = Trainer(cfg, dataset=RandomTokens(), plan=BEFORE, rank=rank, store=dist.FileStore(f"{tmp}/s1", world))
    for step in range(RETAKE_AT):
        trainer.train_step(step)
    trainer.enter_generation(AFTER, dist.FileStore(f"{tmp}/s2", world))
    policy = CheckpointPolicy(cfg, node=trainer.node)
    policy.retake(trainer, "test: a retake right after an entry", RETAKE_AT)
    for step in range(RETAKE_AT, STEPS):
        trainer.train_step(step)
    torch.save(trainer.checkpoint_state.layer_state(), os.path.join(tmp, f"layers-{rank}.pt"))
    trainer.close()


@pytest.mark.slow
def test_a_retake_after_an_entry_with_shadows_passes_torchs_collective_checker(tmp_path: Path) -> None:
    assert BEFORE.shadows is not None and AFTER.shadows is not None
    assert BEFORE.shadows.layers != AFTER.shadows.layers  # the entry seeds some shadows anew
    cfg = config(str(tmp_path / "ckpt"))
    ref = helpers.reference_state(config(), RandomTokens(), STEPS)
    ranks.spawn(_worker, args=(3, str(tmp_path), to_dict(cfg)), nprocs=3)  # a mismatch raises here
    assert ckpt.is_complete(ckpt.step_dir(tmp_path / "ckpt", RETAKE_AT))
    for rank in range(3):
        layers = torch.load(tmp_path / f"layers-{rank}.pt", weights_only=True)
        assert layers
        for i, params in layers.items():
            for name, t in params.items():
                torch.testing.assert_close(t, ref[f"{i}:{name}"], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {i}:{name}")
