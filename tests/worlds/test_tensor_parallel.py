"""Tensor parallelism inside a node: sharded layers equal the full ones, and plans whose stages
span two devices (2 lanes) give the single-process reference's weights (1e-5 relative, fp32, per
tensor in the L2 norm: sharded matmuls sum in another order, and AdamW turns the rounding of the
smallest gradient entries into element errors of a few 1e-6), for one pipeline, two
heterogeneous pipelines, and checkpoints resumed at another degree."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from oobleck_elastic.config import from_dict, load_config, to_dict
from oobleck_elastic.engine import checkpointing
from oobleck_elastic.engine.entry.reconfigure import plan_transfers
from oobleck_elastic.engine.trainer import Trainer
from oobleck_elastic.planning import PipelineSpec, Plan, StagePlacement
import helpers
import ranks
from helpers import RandomTokens, assert_same, run_job, tiny_profile

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def tp_plan(
    layout: list[list[tuple[int, int]]],
    microbatches: list[int],
    *,
    generation: int,
    tp: int = 2,
    gpus_per_node: int = 2,
) -> Plan:
    """A plan from layer ranges per stage; gpus_per_node / tp stages per node, nodes `n0`, `n1`, ..."""
    per_node = gpus_per_node // tp
    pipelines, slot = [], 0
    for index, (ranges, mb) in enumerate(zip(layout, microbatches, strict=True)):
        stages = []
        for s, (u, v) in enumerate(ranges):
            node, lr = divmod(slot, per_node)
            stages.append(
                StagePlacement(
                    index=s, start=u, end=v, node=f"n{node}", local_rank=lr * tp, rank=node * gpus_per_node + lr * tp
                )
            )
            slot += 1
        assert slot % per_node == 0, "a pipeline must fill its nodes"
        pipelines.append(
            PipelineSpec(
                index=index,
                template_nodes=len(ranges) // per_node,
                nodes=tuple(dict.fromkeys(st.node for st in stages)),
                microbatches=mb,
                stages=tuple(stages),
                est_time_s=1.0,
            )
        )
    plan = Plan(
        generation=generation,
        nodes=tuple(f"n{i}" for i in range(slot // per_node)),
        spares=(),
        gpus_per_node=gpus_per_node,
        num_layers=6,
        microbatch_size=2,
        pipelines=tuple(pipelines),
        est_step_time_s=1.0,
        f=1,
        tensor_parallel=tp,
    )
    plan.check()
    return plan


def config(family: str = "gpt2"):
    # eps=1e-6: see tests/worlds/test_engine.py (noise-level gradients stay noise-level at 1e-5 relative)
    return load_config(
        ROOT / f"configs/{family}-tiny.yaml",
        [
            "data.seq_len=16",
            "training.global_batch_size=16",
            "training.microbatch_size=2",
            f"training.steps={STEPS}",
            "training.optimizer.eps=1e-6",
            "planning.gpus_per_node=2",
            "model.num_layers=4",
            "model.num_kv_heads=2" if family == "llama" else "model.dropout=0.0",
        ],
    )


def reference_state(cfg) -> dict[str, torch.Tensor]:
    return helpers.reference_state(cfg, RandomTokens(), STEPS)


def flat_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {f"{i}:{n}": t for i, layer in trainer.checkpoint_state.layer_state().items() for n, t in layer.items()}


def _layers_worker(rank: int, world: int, tmp: str, family: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    from oobleck_elastic.models import build_layer_model
    from oobleck_elastic.models.tensor_parallel import from_full, local, parallelize_layer, to_full

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(tmp, "store"), world), rank=rank, world_size=world
    )
    cfg = config(family).model
    ref, mine = build_layer_model(cfg, seed=7), build_layer_model(cfg, seed=7)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for layer in mine.layers:
        parallelize_layer(layer, mesh)
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    out_ref, out = ref(x), mine(x)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    out_ref.square().mean().backward()
    out.square().mean().backward()
    sharded = 0
    for layer_ref, layer in zip(ref.layers, mine.layers):
        for (name, p_ref), (_, p) in zip(layer_ref.named_parameters(), layer.named_parameters()):
            assert torch.equal(to_full(layer, name, p.detach()), p_ref.detach()), name  # same full weights
            assert torch.equal(from_full(layer, name, p_ref.detach()), local(p).detach()), name
            torch.testing.assert_close(to_full(layer, name, p.grad), p_ref.grad, rtol=1e-5, atol=1e-6, msg=name)
            sharded += local(p).numel() < p_ref.numel()
    assert sharded >= 4 * cfg.num_layers  # every block's projections are sharded
    # tear down as the trainer does: no tensor or mesh of the group outlives it (a gloo group
    # freed during interpreter shutdown intermittently aborts the process)
    del ref, mine, mesh, out_ref, out
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_sharded_layers_equal_the_full_layers(tmp_path: Path, family: str) -> None:
    ranks.spawn(_layers_worker, args=(2, str(tmp_path), family), nprocs=2)


def _train_worker(rank: int, world: int, tmp: str, cfg_dict: dict, runs: list) -> None:
    """Each run: (name, plan, steps, restore from, save to); ranks beyond a plan's world idle."""
    cfg = from_dict(cfg_dict)
    torch.set_num_threads(1)
    for k, (name, plan, steps, restore, save) in enumerate(runs):
        if rank >= plan.world_size:
            continue
        store = dist.FileStore(os.path.join(tmp, f"store{k}"), plan.world_size)
        trainer = Trainer(cfg, dataset=RandomTokens(), plan=plan, rank=rank, store=store)
        if restore:
            assert checkpointing.restore(trainer, os.path.join(tmp, restore)) == steps[0]
        for step in steps:
            trainer.train_step(step)
        if save:
            checkpointing.save(trainer, os.path.join(tmp, save), next_step=steps[-1] + 1)
        torch.save(flat_state(trainer), os.path.join(tmp, f"{name}-rank{rank}.pt"))
        trainer.close()


def check_runs(tmp: Path, ref: dict[str, torch.Tensor], name: str, world: int) -> None:
    merged: dict[str, list[torch.Tensor]] = {}
    for rank in range(world):
        for key, t in torch.load(tmp / f"{name}-rank{rank}.pt", weights_only=True).items():
            merged.setdefault(key, []).append(t)
    assert set(merged) == set(ref), f"{name}: parameters missing"
    for key, copies in merged.items():
        for t in copies:  # every replica and every lane's gathered tensor equals the reference
            assert t.shape == ref[key].shape, f"{name}: {key}"
            error = ((t - ref[key]).norm() / ref[key].norm()).item()
            assert error <= 1e-5, f"{name}: {key} differs from the reference by {error:.2e} (relative, L2)"


ONE_PIPELINE = tp_plan([[(0, 3), (3, 6)]], [8], generation=1)  # 2 nodes x 2 lanes
TWO_PIPELINES = tp_plan([[(0, 6)], [(0, 2), (2, 6)]], [3, 5], generation=2)  # 1 node + 2 nodes


@pytest.mark.slow
# llama takes turns in CI (extended): its sharding is checked at every landing by
# test_sharded_layers_equal_the_full_layers[llama], the pipeline against the reference by gpt2
@pytest.mark.parametrize("family", ["gpt2", pytest.param("llama", marks=pytest.mark.extended)])
def test_one_tensor_parallel_pipeline_matches_the_reference(tmp_path: Path, family: str) -> None:
    cfg = config(family)
    ref = reference_state(cfg)
    runs = [("one", ONE_PIPELINE, list(range(STEPS)), None, None)]
    ranks.spawn(_train_worker, args=(4, str(tmp_path), to_dict(cfg), runs), nprocs=4)
    check_runs(tmp_path, ref, "one", 4)


@pytest.mark.slow
def test_two_heterogeneous_tensor_parallel_pipelines_match_the_reference(tmp_path: Path) -> None:
    cfg = config()
    ref = reference_state(cfg)
    runs = [("two", TWO_PIPELINES, list(range(STEPS)), None, None)]
    ranks.spawn(_train_worker, args=(6, str(tmp_path), to_dict(cfg), runs), nprocs=6)
    check_runs(tmp_path, ref, "two", 6)


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
@pytest.mark.slow
def test_a_checkpoint_resumes_at_another_tensor_parallel_degree(tmp_path: Path) -> None:
    cfg = config()
    ref = reference_state(cfg)
    tp1 = tp_plan([[(0, 2), (2, 6)], [(0, 4), (4, 6)]], [3, 5], generation=3, tp=1)  # 2 stages on each node
    runs = [
        ("a", ONE_PIPELINE, [0, 1], None, "ck-tp2"),  # tp=2 -> checkpoint -> tp=1
        ("tp2-to-tp1", tp1, [2], "ck-tp2/step-00000002", None),
        ("b", tp1, [0, 1], None, "ck-tp1"),  # tp=1 -> checkpoint -> tp=2
        ("tp1-to-tp2", ONE_PIPELINE, [2], "ck-tp1/step-00000002", None),
    ]
    ranks.spawn(_train_worker, args=(6, str(tmp_path), to_dict(cfg), runs), nprocs=6)
    check_runs(tmp_path, ref, "tp2-to-tp1", tp1.world_size)
    check_runs(tmp_path, ref, "tp1-to-tp2", 4)


def test_layers_move_lane_to_lane() -> None:
    old = tp_plan([[(0, 3), (3, 6)], [(0, 6)]], [4, 4], generation=1)  # n0, n1 | n2
    new = tp_plan([[(0, 6)], [(0, 6)]], [4, 4], generation=2)  # n0 | n1 (n2 died)
    held = {k: v for k, v in old.layers_by_worker().items() if k[0] != "n2"}
    transfers, lost = plan_transfers(held, new)
    assert lost == []
    # n0's lanes (ranks 0, 1) need layers 3-5 from n1's lanes (ranks 2, 3), lane to lane; n1 needs 0-2 from n0
    assert {(t.layer, t.src, t.dst) for t in transfers} == (
        {(layer, 2 + lane, lane) for layer in (3, 4, 5) for lane in (0, 1)}
        | {(layer, lane, 2 + lane) for layer in (0, 1, 2) for lane in (0, 1)}
    )


@pytest.mark.slow
@pytest.mark.extended  # tests/jobs/test_matrix.py kills a holder under tensor parallelism at every landing
def test_a_killed_node_under_tensor_parallelism_moves_layers_lane_to_lane(tmp_path: Path, etcd_server, run_id) -> None:
    """Four nodes of two workers run two 2-stage pipelines, each stage sharded over a node's two
    workers; node 1 is SIGKILLed at step 3: the three survivors re-plan into one 3-stage
    pipeline in-process, receive lane j of the layers they newly own from lane j of a surviving
    holder, and finish with the reference weights."""
    profile = tiny_profile(tmp_path / "profile.json", tensor_parallel=2)
    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4", "--nproc-per-node", "2", "--kill", "1@3"],
        8,
        profile,
        extra=["planning.gpus_per_node=2", "planning.tensor_parallel=2"],
    )
    assert "[launcher] killed node 1" in out and "entered from generation 1" in out, out[-4000:]
    moved = [line for line in out.splitlines() if "entered from generation 1" in line and " 0 layer bytes" not in line]
    assert len(moved) >= 2, "both lanes of some survivor must have received layers"
    assert_same(job, ref)


@pytest.mark.slow
@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
def test_compiled_tensor_parallel_layers_match_the_reference(tmp_path: Path) -> None:
    """Compiled layers over DTensor shards (engine/stage/compiled.py): the eager reference's weights."""
    cfg = load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=16",
            "training.global_batch_size=16",
            "training.microbatch_size=2",
            f"training.steps={STEPS}",
            "training.optimizer.eps=1e-6",
            "planning.gpus_per_node=2",
            "model.num_layers=4",
            "training.compile=true",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
    )
    ref = reference_state(from_dict({**to_dict(cfg), "training": {**to_dict(cfg)["training"], "compile": False}}))
    runs = [("compiled", ONE_PIPELINE, list(range(STEPS)), None, None)]
    ranks.spawn(_train_worker, args=(4, str(tmp_path), to_dict(cfg), runs), nprocs=4)
    check_runs(tmp_path, ref, "compiled", 4)
