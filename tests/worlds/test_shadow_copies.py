"""Shadow copies kept current and restored from (engine/step/shadows.py): who sends what to
whom (pure functions on made-up plans), and four gloo workers where both device copies of some
layers are lost and the survivors go on from the shadows, ending with the single-process
reference weights and shadows bit-identical to the holders' layers; the same end for two gloo
workers running zero-bubble with two chunks per device, each keeping the other's layers."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from oobleck_elastic.config import from_dict, load_config, to_dict
from oobleck_elastic.engine.entry.reconfigure import Transfer, plan_transfers
from oobleck_elastic.engine.entry.shadow_seeding import keepers_by_identity, seed_transfers
from oobleck_elastic.engine.step.shadows import SLOW_KEEPER_ENV, keepers, routes
from oobleck_elastic.engine.telemetry.board import ShadowFigures
from oobleck_elastic.engine.trainer import Trainer
from oobleck_elastic.models.build import build_meta_layers
from oobleck_elastic.planning import Plan
from oobleck_elastic.planning.tolerance.shadows import place_shadows
import helpers
import ranks
from oobleck_elastic.testing import layout_plan, node_plan
from helpers import RandomTokens

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def _plan(
    generation: int, pipelines: list[list[tuple[str, int, int]]], microbatches: list[int], shadows: int = 1
) -> Plan:
    """`node_plan` with `shadows` shadow copies of every layer placed."""
    plan = node_plan(generation, pipelines, microbatches)
    return dataclasses.replace(plan, shadows=place_shadows(plan, shadows, [1] * 6, 100)) if shadows else plan


# generation 1: two pipelines of two stages; generation 2: n0 and n2 (both holders of layers 0-2)
# are gone, and n1 and n3 run one pipeline of two stages
BEFORE = _plan(1, [[("n0", 0, 3), ("n1", 3, 6)], [("n2", 0, 3), ("n3", 3, 6)]], [4, 4])
AFTER = _plan(2, [[("n1", 0, 3), ("n3", 3, 6)]], [8])
# the chain the workers run: BEFORE; n1 (keeper of layers 0 and 2) is lost, the shadows are placed
# again and seeded (MID); then n0 and n2, both holders of layers 0-2 in MID, are lost (LAST)
MID = _plan(2, [[("n0", 0, 3), ("n3", 3, 6)], [("n2", 0, 6)]], [4, 4])
LAST = _plan(3, [[("n3", 0, 6)]], [8], shadows=0)


def test_the_placement_the_tests_rely_on() -> None:
    assert BEFORE.shadows is not None and AFTER.shadows is not None
    assert BEFORE.shadows.layers == (("n1",), ("n3",), ("n1",), ("n0",), ("n2",), ("n0",))
    assert AFTER.shadows.layers == (("n3",), ("n3",), ("n3",), ("n1",), ("n1",), ("n1",))
    assert MID.shadows is not None and LAST.shadows is None
    assert MID.shadows.layers == (("n3",), ("n3",), ("n3",), ("n0",), ("n0",), ("n0",))


def test_keepers_and_the_step_routes() -> None:
    """Each shadow is kept by its node's worker, and one holder sends it each step's gradients,
    the holders taking turns."""
    assert keepers(BEFORE) == {0: (1,), 1: (3,), 2: (1,), 3: (0,), 4: (2,), 5: (0,)}
    assert keepers_by_identity(BEFORE) == {("n1", 0): [0, 2], ("n3", 0): [1], ("n0", 0): [3, 5], ("n2", 0): [4]}
    # layer l is held by ranks 0 and 2 (l < 3) or 1 and 3; sender = holders[(l + k) % 2]
    assert routes(BEFORE) == [(0, 0, 1), (1, 2, 3), (2, 0, 1), (3, 3, 0), (4, 1, 2), (5, 3, 0)]


def test_a_layer_without_a_device_copy_comes_from_a_surviving_shadow() -> None:
    """n0 and n2 are lost: layers 0-2 have no device copy left. n1 keeps shadows of 0 and 2 and
    holds them in the new plan (a local copy), n3 keeps 1's and sends it; 3-5 stay where they are."""
    held = {("n1", 0): range(3, 6), ("n3", 0): range(3, 6)}
    shadows = {("n1", 0): [0, 2], ("n3", 0): [1]}
    transfers, lost = plan_transfers(held, AFTER, shadows)
    assert lost == []
    assert transfers == [
        Transfer(layer=0, src=0, dst=0, from_shadow=True),
        Transfer(layer=1, src=1, dst=0, from_shadow=True),
        Transfer(layer=2, src=0, dst=0, from_shadow=True),
    ]
    # without the shadows those layers are lost; a device copy always wins over a shadow
    assert plan_transfers(held, AFTER)[1] == [0, 1, 2]
    both = {("n1", 0): [0, 1, 2, 3], ("n3", 0): [1]}
    moved, _ = plan_transfers({**held, ("n3", 0): range(0, 6)}, AFTER, both)
    assert not [t for t in moved if t.from_shadow]
    # shadows lost too: lost
    assert plan_transfers(held, AFTER, {("n3", 0): [1]})[1] == [0, 2]


def test_seeding_keeps_the_shadows_a_keeper_has_and_sends_the_others_from_holders() -> None:
    """After the loss n3 keeps layer 1's shadow again; 0 and 2 come from their new holder n1
    (rank 0), and n1 gets 3-5 from n3 (rank 1)."""
    kept = {("n1", 0): [], ("n3", 0): [1]}
    assert seed_transfers(AFTER, kept) == [
        Transfer(layer=3, src=1, dst=0),
        Transfer(layer=4, src=1, dst=0),
        Transfer(layer=5, src=1, dst=0),
        Transfer(layer=0, src=0, dst=1),
        Transfer(layer=2, src=0, dst=1),
    ]


def config():
    # eps=1e-6 as tests/worlds/test_engine.py (noise-level gradients of the attention key bias)
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


def _dump(trainer: Trainer, path: str) -> None:
    """The worker's layers and its shadows, with their optimizer state."""
    shadows = trainer.state.shadows
    if shadows is not None:
        shadows.settle()  # the last step's update runs in the background
    out = {
        "layers": trainer.checkpoint_state.layer_state(),
        "optim": trainer.checkpoint_state.optimizer_state(),
        "shadows": {},
        "shadow_optim": {},
    }
    if shadows is not None and shadows.optimizer is not None:
        for i in shadows.layers:
            layer = shadows.layer_model.held(i)
            out["shadows"][i] = {n: p.detach().clone() for n, p in layer.named_parameters()}
            out["shadow_optim"][i] = {
                n: {k: v.clone() for k, v in shadows.optimizer.state[p].items()} for n, p in layer.named_parameters()
            }
        out["shadow_step"] = shadows.step
    torch.save(out, path)


SLOW_KEEPER_S = 4.0
"""How long the slowed keeper's (n1's) background updates sleep in generation 1: longer than a
step's forward and backward here, so step 1's gradients reach n1 while step 0's update still runs."""


def _worker(rank: int, world: int, tmp: str, cfg_dict: dict) -> None:
    cfg = from_dict(cfg_dict)
    torch.set_num_threads(1)
    if rank == 1:  # n1, the keeper of layers 0 and 2, is slow in generation 1 (engine/step/shadows.py)
        os.environ[SLOW_KEEPER_ENV] = str(SLOW_KEEPER_S)
    trainer = Trainer(cfg, dataset=RandomTokens(), plan=BEFORE, rank=rank, store=dist.FileStore(f"{tmp}/s1", world))
    os.environ.pop(SLOW_KEEPER_ENV, None)
    node = trainer.entry.identity[0]
    for step in range(2):
        result = trainer.train_step(step)
    link, store = trainer.shadow_link, trainer.state.shadows
    assert link is not None and store is not None
    figures = ShadowFigures.of(1, trainer.plan, store, traffic_bytes=link.bytes_per_step, seconds=result.shadow_s)
    assert figures is not None
    seen = {"lag": figures.lag_steps, "host": figures.host_bytes, "shadow_s": result.shadow_s}
    torch.save({**seen, "traffic": figures.traffic_bytes, "nbytes": store.nbytes()}, os.path.join(tmp, f"tb-{node}.pt"))
    _dump(trainer, os.path.join(tmp, f"g1-{node}.pt"))
    for plan, gone, step in [(MID, "n1", 2), (LAST, "n0 n2", 3)]:
        if node in gone.split():
            trainer.close()
            return
        info = trainer.enter_generation(plan, dist.FileStore(f"{tmp}/s{plan.generation}", plan.world_size))
        torch.save(
            {"from_shadows": info.from_shadows, "lost": info.lost_layers},
            os.path.join(tmp, f"info{plan.generation}-{node}.pt"),
        )
        trainer.train_step(step)
        _dump(trainer, os.path.join(tmp, f"g{plan.generation}-{node}.pt"))
    trainer.close()


def _route_bytes(plan: Plan) -> dict[int, int]:
    """Rank -> bytes it sends plus receives for the shadows each step, from `routes` and the
    layers' parameter counts (a flat fp32 gradient with one presence flag per parameter)."""
    layers = build_meta_layers(config().model, plan.num_layers, seed=0)
    size = [4 * sum(1 + p.numel() for p in layer.parameters()) for layer in layers]
    out = dict.fromkeys(range(plan.world_size), 0)
    for layer, src, keeper in routes(plan):
        out[src] += size[layer]
        out[keeper] += size[layer]
    return out


def _assert_shadows_equal_holders(dumps: list[dict]) -> int:
    """Every shadow equals (bit for bit) every holder's copy, parameters and AdamW state; the
    number of shadows compared."""
    compared = 0
    for keeper in dumps:
        for i, params in keeper["shadows"].items():
            holders = [d for d in dumps if i in d["layers"]]
            assert holders, f"layer {i} has no holder"
            for h in holders:
                for name, t in params.items():
                    assert torch.equal(t, h["layers"][i][name]), (i, name)
                    for k, v in keeper["shadow_optim"][i][name].items():
                        assert torch.equal(v, h["optim"][i][name][k].to(v.dtype)), (i, name, k)
            compared += 1
    return compared


@pytest.mark.slow
def test_a_keepers_loss_then_both_holders_loss_goes_on_from_the_new_shadows(tmp_path: Path) -> None:
    """BEFORE -> MID -> LAST: the keeper's loss re-places the shadows (seeded from the holders,
    bit-identical to them), and the next loss of both holders of layers 0-2 is recovered from
    those new shadows, ending with the reference weights of four steps. Keeper n1 is slowed in
    BEFORE: its lag shows, and its shadows are still bit-identical (slow costs time, not data)."""
    cfg = config()
    ref = helpers.reference_state(cfg, RandomTokens(), STEPS)
    ranks.spawn(_worker, args=(4, str(tmp_path), to_dict(cfg)), nprocs=4)
    g1 = [torch.load(tmp_path / f"g1-n{r}.pt", weights_only=True) for r in range(4)]
    assert _assert_shadows_equal_holders(g1) == 6
    # what TensorBoard shows of them (engine/telemetry/board.py): the lag measured at step 1's
    # exchange (1 on the slowed keeper n1, whose step-0 update was still running; 0 where it had
    # settled), the store's bytes, the gradient traffic the routes imply (4 bytes per element, 1
    # presence flag per parameter), time spent (on n1, the wait for its update)
    expected = _route_bytes(BEFORE)
    for r in range(4):
        tb = torch.load(tmp_path / f"tb-n{r}.pt", weights_only=True)
        assert tb["lag"] == (1 if r == 1 else 0), (r, tb)
        assert tb["host"] == tb["nbytes"] > 0 and tb["traffic"] == expected[r], (r, tb)
        assert tb["shadow_s"] > 0, (r, tb)
    assert torch.load(tmp_path / "tb-n1.pt", weights_only=True)["shadow_s"] > SLOW_KEEPER_S / 2
    assert all(d["shadow_step"] == 1 for d in g1)
    g2 = [torch.load(tmp_path / f"g2-{n}.pt", weights_only=True) for n in ("n0", "n2", "n3")]
    assert _assert_shadows_equal_holders(g2) == 6  # placed again, seeded, one step on
    assert all(d.get("shadow_step", 2) == 2 for d in g2)
    for n in ("n0", "n2", "n3"):
        assert torch.load(tmp_path / f"info2-{n}.pt", weights_only=True) == {"from_shadows": (), "lost": ()}
    assert torch.load(tmp_path / "info3-n3.pt", weights_only=True) == {"from_shadows": (0, 1, 2), "lost": ()}
    last = torch.load(tmp_path / "g3-n3.pt", weights_only=True)
    merged = {f"{i}:{n}": t for i, layer in last["layers"].items() for n, t in layer.items()}
    assert set(merged) == set(ref)
    for key, t in merged.items():
        torch.testing.assert_close(t, ref[key], rtol=1e-5, atol=1e-6, msg=key)


# one pipeline of three stages; n0 and n1 are lost: layer 1 keeps its shadow on n2, layers 0, 2
# and 3 lose every holder and every shadow
CHAIN = _plan(1, [[("n0", 0, 2), ("n1", 2, 4), ("n2", 4, 6)]], [8])
ALONE = _plan(2, [[("n2", 0, 6)]], [8], shadows=0)


def _fallback_worker(rank: int, world: int, tmp: str, cfg_dict: dict) -> None:
    from oobleck_elastic.engine import checkpointing
    from oobleck_elastic.engine.entry.enter import LayersLost

    cfg = from_dict(cfg_dict)
    torch.set_num_threads(1)
    trainer = Trainer(cfg, dataset=RandomTokens(), plan=CHAIN, rank=rank, store=dist.FileStore(f"{tmp}/s1", world))
    trainer.train_step(0)
    checkpointing.save(trainer, os.path.join(tmp, "ckpt"), next_step=1)
    trainer.train_step(1)
    if trainer.entry.identity[0] != "n2":
        trainer.close()
        return
    try:
        trainer.enter_generation(ALONE, dist.FileStore(f"{tmp}/s2", 1))
        raise AssertionError("no layer was lost")
    except LayersLost as err:
        lost = err.layers
    step = checkpointing.restore(trainer, os.path.join(tmp, "ckpt", "step-00000001"))
    for s in range(step, STEPS):
        trainer.train_step(s)
    torch.save({"lost": lost, "layers": trainer.checkpoint_state.layer_state()}, os.path.join(tmp, "alone.pt"))
    trainer.close()


@pytest.mark.slow
def test_when_the_shadows_are_lost_too_the_checkpoint_is_restored(tmp_path: Path) -> None:
    """Holders and shadows of some layers lost at once: the entry names exactly those layers (not
    the one whose shadow survived) and the job falls back to the newest checkpoint."""
    assert CHAIN.shadows is not None
    assert CHAIN.shadows.layers == (("n1",), ("n2",), ("n0",), ("n0",), ("n1",), ("n0",))
    cfg = config()
    ref = helpers.reference_state(cfg, RandomTokens(), STEPS)
    ranks.spawn(_fallback_worker, args=(3, str(tmp_path), to_dict(cfg)), nprocs=3)
    out = torch.load(tmp_path / "alone.pt", weights_only=True)
    assert out["lost"] == [0, 2, 3]
    merged = {f"{i}:{n}": t for i, layer in out["layers"].items() for n, t in layer.items()}
    assert set(merged) == set(ref)
    for key, t in merged.items():
        torch.testing.assert_close(t, ref[key], rtol=1e-5, atol=1e-6, msg=key)


# one zero-bubble pipeline of two devices with two chunks each: n0 runs layers 0-1 and 3, n1 layer
# 2 and 4-5; each keeps the shadows of the other's layers
_CHUNKED = layout_plan([[(0, 2), (2, 3), (3, 4), (4, 6)]], [8], generation=1, schedule="zero-bubble", chunks=2)
ZERO_BUBBLE = dataclasses.replace(_CHUNKED, shadows=place_shadows(_CHUNKED, 1, [1] * 6, 100))
ZB_STEPS = 2


def test_with_chunks_every_shadow_is_kept_off_its_holders_and_sent_by_another_rank() -> None:
    """A stage's start/end are its first chunk's only: a keeper placed by them would hold layer 3
    itself and send itself its gradients (gloo: "Pair is not connected")."""
    assert ZERO_BUBBLE.shadows is not None
    assert ZERO_BUBBLE.shadows.layers == (("n1",), ("n1",), ("n0",), ("n1",), ("n0",), ("n0",))
    assert routes(ZERO_BUBBLE) == [(0, 0, 1), (1, 0, 1), (2, 1, 0), (3, 0, 1), (4, 1, 0), (5, 1, 0)]


def _zero_bubble_worker(rank: int, world: int, tmp: str, cfg_dict: dict) -> None:
    cfg = from_dict(cfg_dict)
    torch.set_num_threads(1)
    trainer = Trainer(cfg, dataset=RandomTokens(), plan=ZERO_BUBBLE, rank=rank, store=dist.FileStore(f"{tmp}/s", world))
    assert type(trainer.schedule).__name__ == "ScheduleInterleavedZeroBubble", type(trainer.schedule)
    for step in range(ZB_STEPS):
        trainer.train_step(step)
    _dump(trainer, os.path.join(tmp, f"zb-rank{rank}.pt"))
    trainer.close()


@pytest.mark.slow
def test_zero_bubble_with_chunks_keeps_its_shadows_and_matches_the_reference(tmp_path: Path) -> None:
    """Two gloo ranks run ZERO_BUBBLE with one shadow copy of every layer: both steps are taken,
    the weights are the single-process reference's and every shadow is bit-identical to its
    holder's layer."""
    cfg = config()
    ref = helpers.reference_state(cfg, RandomTokens(), ZB_STEPS)
    ranks.spawn(_zero_bubble_worker, args=(2, str(tmp_path), to_dict(cfg)), nprocs=2)
    dumps = [torch.load(tmp_path / f"zb-rank{r}.pt", weights_only=True) for r in range(2)]
    assert all(d["shadow_step"] == ZB_STEPS - 1 for d in dumps)
    assert _assert_shadows_equal_holders(dumps) == 6
    merged = {f"{i}:{n}": t for d in dumps for i, layer in d["layers"].items() for n, t in layer.items()}
    assert set(merged) == set(ref)
    for key, t in merged.items():
        torch.testing.assert_close(t, ref[key], rtol=1e-5, atol=1e-6, msg=key)
