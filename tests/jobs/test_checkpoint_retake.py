"""Partial checkpoints and the retake after a re-plan.

- The copies of each layer in a plan (distinct nodes, plus shadow copies) and the decision to
  retake a checkpoint are pure functions, tested on made-up plans.
- A save interrupted by a failure (a step directory without a manifest) is described by what it
  left, set aside with one log line before the next save or at the start, never resumed from;
  `oobleck export` on a directory holding only partial checkpoints names each one and why.
- A trainer retakes the checkpoint it is asked to, once (not over a complete one), and in a real
  job a re-plan to one pipeline retakes it, so that the next failure, which takes the last copy
  of some layers, is recovered from it (no interval checkpoints are configured).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from oobleck_elastic import checkpoint as ckpt
from oobleck_elastic.cli import main
from oobleck_elastic.config import load_config
from oobleck_elastic.engine import checkpointing
from oobleck_elastic.engine.checkpointing import CheckpointPolicy, retake_reason
from oobleck_elastic.engine.reference import single_process
from oobleck_elastic.planning import PipelineSpec, Plan, StagePlacement, layer_copies, shortfall
from helpers import RandomTokens, assert_same, layout_plan, paced, run_job, tiny_profile

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- copies of each layer


def test_copies_count_the_distinct_nodes_holding_each_layer() -> None:
    two = layout_plan([[(0, 6)], [(0, 3), (3, 6)]], [4, 4], generation=2)
    assert layer_copies(two) == [2] * 6
    one = layout_plan([[(0, 2), (2, 6)]], [8], generation=2)
    assert layer_copies(one) == [1] * 6
    # shadow copies count by node; a node that holds the layer on its devices adds nothing
    assert layer_copies(one, {0: ["n7"], 3: ["n0", "n1"], 5: ["n7", "n8"]}) == [2, 1, 1, 2, 1, 3]
    with pytest.raises(ValueError, match=r"^extra copies of layer 6: the plan has layers 0\.\.5$"):
        layer_copies(one, {6: ["n7"]})


def test_two_stages_of_one_node_are_one_copy() -> None:
    # a node with two devices running two stages of different pipelines: its failure takes both
    stages = [
        StagePlacement(index=0, start=0, end=6, node="a", local_rank=0, rank=0),
        StagePlacement(index=0, start=0, end=6, node="a", local_rank=1, rank=1),
    ]
    pipes = tuple(
        PipelineSpec(index=i, template_nodes=1, nodes=("a",), microbatches=4, stages=(s,), est_time_s=1.0)
        for i, s in enumerate(stages)
    )
    plan = Plan(
        generation=2,
        nodes=("a",),
        spares=(),
        gpus_per_node=2,
        num_layers=6,
        microbatch_size=2,
        pipelines=pipes,
        est_step_time_s=1.0,
        f=1,
    )
    assert layer_copies(plan) == [1] * 6
    assert shortfall(plan) is not None


def test_shortfall_names_the_layer_with_fewest_copies() -> None:
    one = layout_plan([[(0, 2), (2, 6)]], [8], generation=2)
    short = shortfall(one)
    assert short is not None and (short.layer, short.copies, short.needed, short.short) == (0, 1, 2, tuple(range(6)))
    assert short.describe() == "layer 0 has 1 copy < f+1=2 (6 of 6 layers have fewer than 2)"
    shadows = {i: ["n9"] for i in (0, 1, 2, 4, 5)}  # layer 3 alone keeps one copy
    assert shortfall(one, shadows).describe() == "layer 3 has 1 copy < f+1=2"  # type: ignore[union-attr]
    assert shortfall(one, {i: ["n9"] for i in range(6)}) is None
    three = layout_plan([[(0, 6)], [(0, 6)], [(0, 3), (3, 6)]], [2, 3, 3], generation=2)
    assert shortfall(three) is None and shortfall(three, f=2) is None
    assert shortfall(three, f=3).describe() == "layer 0 has 3 copies < f+1=4 (6 of 6 layers have fewer than 4)"  # type: ignore[union-attr]


def test_retake_after_a_replan_that_leaves_a_layer_short() -> None:
    one = layout_plan([[(0, 2), (2, 6)]], [8], generation=3)
    assert retake_reason(one, previous=2, step=7, steps=20) == (
        "generation 3: layer 0 has 1 copy < f+1=2 (6 of 6 layers have fewer than 2); checkpoint at step 7"
    )
    assert retake_reason(one, previous=0, step=0, steps=20) is None  # the job's first start: no re-plan
    assert retake_reason(one, previous=2, step=20, steps=20) is None  # done: the final checkpoint follows
    assert retake_reason(replace(one, rebalanced=True), previous=2, step=7, steps=20) is None  # same layout
    assert retake_reason(one, previous=2, step=7, steps=20, extra={i: ["n9"] for i in range(6)}) is None
    two = layout_plan([[(0, 6)], [(0, 3), (3, 6)]], [4, 4], generation=3)
    assert retake_reason(two, previous=2, step=7, steps=20) is None


# ----------------------------------------------------------------------------- partial checkpoints


def partial(root: Path, step: int, *, files: int, of: int | None, tmp: int = 0) -> Path:
    """A step directory as an interrupted save leaves it: `files` layer files, `tmp` temp files of
    killed writers, no manifest (and `saving.json` when `of` is given)."""
    if of is not None:
        ckpt.begin_save(root, step=step, num_layers=of, generation=2)
    sdir = ckpt.step_dir(root, step)
    sdir.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (sdir / ckpt.layer_file(i)).write_bytes(b"x")
        (sdir / f"layer-{i:03d}.receipt.json").write_text("{}")
    for i in range(tmp):
        (sdir / f".{ckpt.layer_file(files + i)}.tmp-123-abcd{i}").write_bytes(b"x")
    return sdir


def complete(root: Path, step: int) -> Path:
    info = ckpt.save_layer(root, step=step, layer=0, params={}, optimizer_state={})
    ckpt.write_manifest(
        root, step=step, data_cursor={}, plan=None, config={}, layers=[info], layer_names=["l"], hf_names=[{}]
    )
    return ckpt.step_dir(root, step)


def test_a_partial_checkpoint_says_how_far_its_save_got(tmp_path: Path) -> None:
    sdir = partial(tmp_path, 10, files=5, of=10, tmp=1)
    assert ckpt.describe_partial(sdir) == "no manifest (5 of 10 layer files, 1 .tmp file)"
    bare = partial(tmp_path, 20, files=3, of=None, tmp=2)  # no saving.json: the count comes from the caller
    assert ckpt.describe_partial(bare) == "no manifest (3 layer files, 2 .tmp files)"
    assert ckpt.describe_partial(bare, num_layers=6) == "no manifest (3 of 6 layer files, 2 .tmp files)"
    done = complete(tmp_path, 4)
    path, unusable = ckpt.newest_intact_checkpoint(tmp_path, num_layers=6)
    assert path == done
    assert [(u.path.name, u.reason, u.damaged) for u in unusable] == [
        ("step-00000020", "no manifest (3 of 6 layer files, 2 .tmp files)", False),
        ("step-00000010", "no manifest (5 of 10 layer files, 1 .tmp file)", False),
    ]
    moved = ckpt.set_aside_partials(tmp_path, num_layers=6)
    assert [(old.name, new.name.startswith(f"{old.name}.partial-"), why) for old, new, why in moved] == [
        ("step-00000010", True, "no manifest (5 of 10 layer files, 1 .tmp file)"),
        ("step-00000020", True, "no manifest (3 of 6 layer files, 2 .tmp files)"),
    ]
    assert ckpt.list_checkpoints(tmp_path) == [done]  # the complete one stays
    assert ckpt.set_aside_partials(tmp_path) == []
    assert sorted(p.name for p in moved[0][1].iterdir())[-2:] == ["layer-004.safetensors", "saving.json"]  # kept


def test_export_of_only_partial_checkpoints_names_each_and_why(tmp_path: Path, capsys) -> None:
    root = tmp_path / "ckpt"
    partial(root, 10, files=5, of=10, tmp=1)
    partial(root, 20, files=2, of=10)
    assert main(["export", str(root), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == (
        f"oobleck export: error: no intact checkpoint under {root}, only partial or damaged ones: "
        "step-00000010: no manifest (5 of 10 layer files, 1 .tmp file); "
        "step-00000020: no manifest (2 of 10 layer files)\n"
    )
    sdir = root / "step-00000010"  # the step directory itself
    assert main(["export", str(sdir), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == (
        f"oobleck export: error: '{sdir}' is a partial checkpoint: step-00000010: no manifest (5 of 10 "
        "layer files, 1 .tmp file); give an intact step directory or the directory holding them (checkpoint.dir)\n"
    )
    moved = {old.name: new.name for old, new, _ in ckpt.set_aside_partials(root)}  # what a job leaves
    assert main(["export", str(root), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == (
        f"oobleck export: error: no intact checkpoint under {root}, only partial or damaged ones: "
        f"{moved['step-00000010']}: set aside as partial, no manifest (5 of 10 layer files, 1 .tmp file); "
        f"{moved['step-00000020']}: set aside as partial, no manifest (2 of 10 layer files)\n"
    )
    assert not (tmp_path / "hf").exists()


@pytest.mark.core
def test_export_names_a_damaged_checkpoint_beside_a_partial_one(tmp_path: Path, capsys) -> None:
    root = tmp_path / "ckpt"
    bad = complete(root, 4) / ckpt.layer_file(0)
    size = bad.stat().st_size
    bad.write_bytes(bad.read_bytes()[:-1])
    partial(root, 8, files=0, of=6)
    assert main(["export", str(root), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == (
        f"oobleck export: error: no intact checkpoint under {root}, only partial or damaged ones: "
        f"step-00000004: checkpoint file {bad} is corrupt: truncated or resized (expected {size} bytes, got "
        f"{size - 1}); delete step-00000004 to fall back to an older checkpoint; "
        "step-00000008: no manifest (0 of 6 layer files)\n"
    )


# ----------------------------------------------------------------------------- a trainer's saves


def _cfg(tmp: Path):
    return load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=8",
            "training.global_batch_size=8",
            "training.microbatch_size=2",
            "training.steps=4",
            f"checkpoint.dir={tmp / 'ckpt'}",
        ],
    )


@pytest.mark.core
def test_a_trainer_retakes_once_and_sets_partial_saves_aside(tmp_path: Path, caplog) -> None:
    cfg = _cfg(tmp_path)
    root = Path(cfg.checkpoint.dir)
    trainer = single_process(cfg, dataset=RandomTokens(n=32, seq_len=8))
    try:
        n = trainer.layer_model.num_layers
        trainer.train_step(0)
        partial(root, 1, files=2, of=n, tmp=1)  # the interrupted save of step 1
        policy = CheckpointPolicy(cfg, node="local")
        reason = "generation 2: layer 0 has 1 copy < f+1=2; checkpoint at step 1"
        with caplog.at_level(logging.INFO, logger="oobleck_elastic"):
            saved = policy.retake(trainer, reason, 1)
        assert saved == root / "step-00000001" and ckpt.verify_checkpoint(saved)["step"] == 1
        assert sorted(p.name for p in saved.iterdir()) == [*(ckpt.layer_file(i) for i in range(n)), "manifest.json"]
        lines = [r.getMessage() for r in caplog.records]
        aside = next(p for p in root.iterdir() if p.name.startswith("step-00000001.partial-"))
        said = f"interrupted checkpoint {root / 'step-00000001'} set aside as {aside.name}: no manifest (2 of {n}"
        assert f"gen 1 step 1 node local: {said} layer files, 1 .tmp file)" in lines, lines
        assert f"gen 1 step 1 node local: {reason}" in lines, lines
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="oobleck_elastic"):
            assert policy.retake(trainer, reason, 1) is None  # a complete one of that step exists
        said = f"gen 1 step 1 node local: {reason} exists already (not retaken)"
        assert [r.getMessage() for r in caplog.records] == [said]
        assert len(list(root.iterdir())) == 2
        assert checkpointing.restore(trainer, saved) == 1
    finally:
        trainer.close()


# ----------------------------------------------------------------------------- a real job


@pytest.mark.slow
def test_a_replan_to_one_pipeline_retakes_the_checkpoint_the_next_failure_needs(
    tmp_path: Path, etcd_server, run_id
) -> None:
    """Four nodes, two 2-stage pipelines (f=1), no interval checkpoints, and an interrupted save
    left in the checkpoint directory. Node 1 dies at step 3: three nodes make one pipeline, so
    every layer has one copy, and the survivors retake a checkpoint before their first step. A
    second node dies at step 7 and takes the only copy of its layers: the job restores the
    retaken checkpoint (without it there would be none) and ends with the reference weights."""
    profile = tiny_profile(tmp_path / "profile.json")
    root = tmp_path / "job" / "ckpt"
    partial(root, 2, files=3, of=6, tmp=1)
    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4", "--kill", "1@3", "--kill", "follower@7"],
        10,
        profile,
        env=paced(2, 10, 0.5),
        killed_by_test=0,
    )
    assert "interrupted checkpoint" in out and "step-00000002 set aside as step-00000002.partial-" in out, out[-4000:]
    assert "no manifest (3 of 6 layer files, 1 .tmp file)" in out
    retakes = [line for line in out.splitlines() if "generation 2: layer 0 has 1 copy < f+1=2" in line]
    assert len(retakes) == 1 and "; checkpoint at step " in retakes[0], out[-4000:]
    step = int(retakes[0].rsplit(" ", 1)[1])
    assert 3 <= step < 7
    # the second failure is recovered from the retaken checkpoint, the only one there was
    assert f"had no surviving copy; restored checkpoint {root / f'step-{step:08d}'} and continue" in out, out[-4000:]
    assert_same(job, ref)
