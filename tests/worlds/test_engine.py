"""Invariant 1: any plan gives the same weights after k steps as one process on the same global
batches (1e-5 relative, fp32), for one pipeline, two pipelines of different lengths, and three
pipelines with unequal microbatch counts and tied weights split across stages; and the same after
2 steps on one plan, a checkpoint (weights + AdamW state), and the last step on another plan.
Four gloo ranks run everything one after another, re-initialising the process group each time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from oobleck_elastic.config import from_dict, load_config, to_dict
from oobleck_elastic.engine import checkpointing
from oobleck_elastic.engine.entry.devices import backend_for
from oobleck_elastic.engine.entry.groups import Holders
from oobleck_elastic.engine.resilience import nccl_rules
from oobleck_elastic.engine.trainer import Trainer
import helpers
import ranks
from oobleck_elastic.testing import node_plan
from helpers import RandomTokens, layout_plan

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
NUM_LAYERS = 6  # gpt2-tiny: embedding, 4 blocks, head


PLANS = [
    # one pipeline of four stages, 8 microbatches (1F1B)
    layout_plan([[(0, 2), (2, 3), (3, 4), (4, 6)]], [8], generation=1),
    # two pipelines of different lengths: one stage (3 microbatches) + three stages (5, 1F1B)
    layout_plan([[(0, 6)], [(0, 1), (1, 4), (4, 6)]], [3, 5], generation=2),
    # three pipelines, unequal microbatches; the last splits the tied wte/lm_head over two stages
    layout_plan([[(0, 6)], [(0, 6)], [(0, 3), (3, 6)]], [2, 3, 3], generation=3),
]


def config(**over):
    # eps=1e-6: the attention key bias has a mathematically zero gradient (softmax ignores a shift of
    # all keys), so its gradient is rounding noise of ~1e-10 that AdamW with eps=1e-8 would blow up to
    # a full lr-sized update in a random direction; a larger eps keeps noise-level gradients noise-level
    # and the comparison about the math, at the strict 1e-5 relative tolerance.
    cfg = load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=16",
            "training.global_batch_size=16",
            "training.microbatch_size=2",
            f"training.steps={STEPS}",
            "training.optimizer.eps=1e-6",
            *[f"{k}={v}" for k, v in over.items()],
        ],
    )
    return cfg


def _worker(rank: int, world: int, tmp: str, cfg_dict: dict) -> None:
    cfg = from_dict(cfg_dict)
    torch.set_num_threads(1)
    for k, plan in enumerate(PLANS):
        store = dist.FileStore(os.path.join(tmp, f"store{k}"), world)
        trainer = Trainer(cfg, dataset=RandomTokens(), plan=plan, rank=rank, store=store)
        # every group of the generation uses the device map: control on gloo, data on the device's backend
        groups = [trainer.groups.pipeline_group, *trainer.groups.sets.values()]
        configs = {dist.get_backend_config()} | {dist.get_backend_config(g) for g in groups if g is not None}
        assert configs == {"cpu:gloo,cuda:gloo"} and backend_for(trainer.device) == "gloo", configs
        for step in range(STEPS):
            trainer.train_step(step)
        _assert_connected_at_entry(trainer, plan, rank)
        torch.save(
            {f"{i}:{n}": t for i, layer in trainer.checkpoint_state.layer_state().items() for n, t in layer.items()},
            os.path.join(tmp, f"plan{k}-rank{rank}.pt"),
        )
        trainer.close()
    # resume under another plan: 2 steps on plan 1, checkpoint, 1 more step on plan 2
    ckpt_dir = os.path.join(tmp, "ckpt")
    for k, (plan, steps) in enumerate([(PLANS[1], range(0, 2)), (PLANS[2], range(2, STEPS))]):
        store = dist.FileStore(os.path.join(tmp, f"resume{k}"), world)
        trainer = Trainer(cfg, dataset=RandomTokens(), plan=plan, rank=rank, store=store)
        if k == 1:
            assert checkpointing.restore(trainer, os.path.join(ckpt_dir, "step-00000002")) == 2
        for step in steps:
            trainer.train_step(step)
        if k == 0:
            checkpointing.save(trainer, ckpt_dir, next_step=2)
        else:
            torch.save(
                {
                    f"{i}:{n}": t
                    for i, layer in trainer.checkpoint_state.layer_state().items()
                    for n, t in layer.items()
                },
                os.path.join(tmp, f"resumed-rank{rank}.pt"),
            )
        trainer.close()


def _assert_connected_at_entry(trainer: Trainer, plan, rank: int) -> None:
    """NCCL's rules (docs/nccl.md): every device group this rank used in its steps was first used in
    the entry's connect, by an all-reduce of all its members, in the generation's order: the default
    group (layer transfers), this rank's pipeline, then its holder sets (the checker raises at any
    other first use, so the steps' use of them is checked too)."""
    assert nccl_rules.CHECKER.active, "the tests run with OOBLECK_NCCL_RULES=1 (tests/conftest.py)"
    pipeline = plan.stage_of(rank)[0]
    expected = [tuple(range(plan.entry_world_size))]
    if len(pipeline.stages) > 1:
        expected.append(tuple(s.rank for s in pipeline.stages))
    expected += [s for s in Holders.of(plan, trainer.layer_model).group_sets() if rank in s]
    uses = list(nccl_rules.CHECKER.first.values())
    assert [(u.ranks, u.op, u.connecting) for u in uses] == [(r, "all_reduce", True) for r in expected], uses


def reference_state(cfg) -> dict[str, torch.Tensor]:
    return helpers.reference_state(cfg, RandomTokens(), STEPS)


@pytest.mark.slow
def test_three_plans_match_the_single_process_reference(tmp_path: Path) -> None:
    cfg = config()
    ref = reference_state(cfg)
    ranks.spawn(_worker, args=(4, str(tmp_path), to_dict(cfg)), nprocs=4)
    for k, name in [(0, "plan0"), (1, "plan1"), (2, "plan2"), ("resume", "resumed")]:
        merged: dict[str, list[torch.Tensor]] = {}
        for rank in range(4):
            for key, t in torch.load(tmp_path / f"{name}-rank{rank}.pt", weights_only=True).items():
                merged.setdefault(key, []).append(t)
        assert set(merged) == set(ref), f"plan {k}: parameters missing"
        for key, copies in merged.items():
            for t in copies:  # every replica equals the reference
                torch.testing.assert_close(t, ref[key], rtol=1e-5, atol=1e-6, msg=f"plan {k}: {key}")
    # the reference moved: every tensor differs from the fresh weights, so training happened
    fresh = helpers.reference_state(cfg, RandomTokens(), 0)
    moved = [k for k, t in ref.items() if not torch.equal(t, fresh[k])]
    assert len(moved) == len(ref)


_plan = node_plan


def test_transfers_come_from_surviving_holders_spread_over_them() -> None:
    from oobleck_elastic.engine.entry.reconfigure import plan_transfers

    old = _plan(1, [[("a", 0, 3), ("b", 3, 6)], [("c", 0, 3), ("d", 3, 6)], [("e", 0, 2), ("f", 2, 6)]])
    new = _plan(2, [[("a", 0, 2), ("c", 2, 4), ("e", 4, 6)], [("d", 0, 3), ("f", 3, 6)]])
    held = {k: v for k, v in old.layers_by_worker().items() if k[0] != "b"}  # b died
    transfers, lost = plan_transfers(held, new)
    assert lost == []
    got = {(t.layer, t.dst) for t in transfers}
    # c (rank 1) needs 2 (had 0-3: keeps 2) and 3; e (rank 2) needs 4, 5 (had 0-2); d (rank 3) needs 0-2
    assert got == {(3, 1), (4, 2), (5, 2), (0, 3), (1, 3), (2, 3)}
    rank_of = {s.node: s.rank for p in new.pipelines for s in p.stages}
    for t in transfers:  # every source really holds the layer
        src = next(n for n, r in rank_of.items() if r == t.src)
        assert t.layer in held[(src, 0)]
    sources_of_layer_0_to_2 = {t.src for t in transfers if t.dst == 3}
    assert len(sources_of_layer_0_to_2) > 1, "one receiver's layers are spread over several holders"


def test_a_drained_donor_is_a_source_and_never_a_receiver() -> None:
    """b and d (the second stage of both pipelines, the only holders of layers 3-5) are drained:
    named donors of generation 2, they take the entry ranks after the stages' and send layers 3-5
    to the survivors; without them those layers would be lost."""
    import dataclasses

    from oobleck_elastic.engine.entry.reconfigure import plan_transfers

    g1 = _plan(1, [[("a", 0, 3), ("b", 3, 6)], [("c", 0, 3), ("d", 3, 6)]])
    g2 = dataclasses.replace(_plan(2, [[("a", 0, 6)], [("c", 0, 6)]]), donors=("b", "d"))
    g2.check()
    assert g2.world_size == 2 and g2.entry_world_size == 4
    assert (g2.donor_rank("b", 0), g2.donor_rank("d", 0), g2.donor_rank("a", 0), g2.donor_rank("b", 1)) == (
        2,
        3,
        None,
        None,
    )
    assert g2.entry_ranks() == {("a", 0): 0, ("c", 0): 1, ("b", 0): 2, ("d", 0): 3}
    transfers, lost = plan_transfers(g1.layers_by_worker(), g2)
    assert lost == []
    assert sorted((t.layer, t.dst) for t in transfers) == [(3, 0), (3, 1), (4, 0), (4, 1), (5, 0), (5, 1)]
    assert {t.src for t in transfers} == {2, 3}  # both donors serve (spread), nobody sends to them
    without = dataclasses.replace(g2, donors=())
    assert plan_transfers(g1.layers_by_worker(), without)[1] == [3, 4, 5]


def test_transfers_use_each_workers_own_layout_after_a_half_done_entry() -> None:
    """Generation 2 was entered by some workers only (its entry failed half-way): a and b hold
    generation 2's layout, c and d still generation 1's. Both are valid copies at the same step,
    so nothing is lost; with generation 2's layout alone layers 4-5 (held by the dead e) would be."""
    from oobleck_elastic.engine.entry.reconfigure import plan_transfers

    g1 = _plan(1, [[("a", 0, 3), ("b", 3, 6)], [("c", 0, 3), ("d", 3, 6)]])
    g2 = _plan(2, [[("a", 0, 2), ("b", 2, 4), ("e", 4, 6)], [("c", 0, 3), ("d", 3, 6)]])
    g3 = _plan(3, [[("a", 0, 3), ("b", 3, 6)], [("c", 0, 3), ("d", 3, 6)]])
    held = {
        ("a", 0): g2.layers_by_worker()[("a", 0)],
        ("b", 0): g2.layers_by_worker()[("b", 0)],
        ("c", 0): g1.layers_by_worker()[("c", 0)],
        ("d", 0): g1.layers_by_worker()[("d", 0)],
    }
    transfers, lost = plan_transfers(held, g3)
    assert lost == []
    assert {(t.layer, t.dst) for t in transfers} == {(2, 0), (4, 1), (5, 1)}
    assert all(t.src == 3 for t in transfers if t.layer in (4, 5))  # only d holds them now
    assert next(t.src for t in transfers if t.layer == 2) in (1, 2)  # b (generation 2) or c (generation 1)
    only_g2 = {k: v for k, v in g2.layers_by_worker().items() if k[0] in "ab"}
    assert plan_transfers(only_g2, g3)[1] == [4, 5]


def _slow_stage_worker(rank: int, world: int, tmp: str, cfg_dict: dict) -> None:
    cfg = from_dict(cfg_dict)
    torch.set_num_threads(1)
    os.environ["OOBLECK_SLOW_AT"] = "0@0:4,0@1:4"  # the first stage's first two steps take 4 s
    store = dist.FileStore(os.path.join(tmp, "store-slow"), world)
    plan = layout_plan([[(0, 3), (3, 6)]], [8], generation=1)
    trainer = Trainer(cfg, dataset=RandomTokens(), node=f"n{rank}")  # holds nothing yet
    store.add("started", 1)
    while store.add("started", 0) < world:  # connect together: the connect timeout is 1 s
        pass
    trainer.enter_generation(plan, store)
    seconds = [trainer.train_step(step).seconds for step in range(STEPS)]
    torch.save(
        {f"{i}:{n}": t for i, layer in trainer.checkpoint_state.layer_state().items() for n, t in layer.items()},
        os.path.join(tmp, f"slow-rank{rank}.pt"),
    )
    torch.save(torch.tensor(seconds), os.path.join(tmp, f"slow-rank{rank}-seconds.pt"))
    trainer.close()


@pytest.mark.slow
def test_a_slow_stage_is_not_a_failure(tmp_path: Path) -> None:
    """A stage whose steps take 4x the connect timeout (a large model's first step: warm-up,
    compilation): the next stage waits for it in its pipeline receive under the step's timeout
    (`comm_timeout_s`), not the connect timeout (`join_timeout_s`), and the job ends with the
    reference weights. Before the fix, gloo's receive gave up after `join_timeout_s`."""
    cfg = config(**{"fault_tolerance.join_timeout_s": 1, "fault_tolerance.comm_timeout_s": 60})
    ranks.spawn(_slow_stage_worker, args=(2, str(tmp_path), to_dict(cfg)), nprocs=2)
    ref = reference_state(cfg)
    merged = {
        **torch.load(tmp_path / "slow-rank0.pt", weights_only=True),
        **torch.load(tmp_path / "slow-rank1.pt", weights_only=True),
    }
    assert set(merged) == set(ref)
    for key, t in merged.items():
        torch.testing.assert_close(t, ref[key], rtol=1e-5, atol=1e-6, msg=key)
    # the delay happened: the second stage waited out most of the first's 4 s in each of those
    # steps (it starts its own clock a little later), 3x its connect timeout or more: a lower
    # bound, true however fast the machine
    waited = torch.load(tmp_path / "slow-rank1-seconds.pt")
    assert (waited[:2] >= 3.0).all(), waited


def test_moves_name_each_sending_and_receiving_node_with_the_bytes() -> None:
    """b dies; the survivors become one 3-stage pipeline: c newly owns layer 3 (held by d only),
    a and d keep theirs. The entry's transfers read as node-to-node moves with their bytes."""
    from oobleck_elastic.engine.entry.reconfigure import Move, moves_of, plan_transfers

    g1 = _plan(1, [[("a", 0, 3), ("b", 3, 6)], [("c", 0, 3), ("d", 3, 6)]])
    g2 = _plan(2, [[("a", 0, 2), ("c", 2, 4), ("d", 4, 6)]])
    held = {k: v for k, v in g1.layers_by_worker().items() if k[0] != "b"}
    transfers, lost = plan_transfers(held, g2)
    assert lost == []
    moves = moves_of(transfers, g2, [10, 20, 30, 40, 50, 60])
    assert moves == (Move(src="d", dst="c", layers=(3,), bytes=40),)
    g3 = _plan(3, [[("e", 0, 6)], [("c", 0, 3), ("d", 3, 6)]])  # e joins: a full copy from c and d
    moves = moves_of(plan_transfers(g1.layers_by_worker(), g3)[0], g3, [1e6] * 6)
    assert [m.describe() for m in moves] == ["layers 0-2 c -> e (3.0 MB)", "layers 3-5 d -> e (3.0 MB)"]
