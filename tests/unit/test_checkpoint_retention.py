"""Checkpoints that do not fill the disk: which step directories a save keeps
(`checkpoint.keep_last`), whether a save fits in the free space, and a one-process run that keeps
two checkpoints and resumes from them, or skips a save that does not fit and says so."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from oobleck_elastic import checkpoint as ckpt
from oobleck_elastic.checkpoint import checkpoints_to_prune, prune_checkpoints, room_for_save
from oobleck_elastic.config import CheckpointConfig, load_config
from oobleck_elastic.engine.resilience.errors import JobFailed
from oobleck_elastic.engine.run import train

ROOT = Path(__file__).resolve().parents[2]


def dirs(*states: str) -> list[tuple[Path, bool]]:
    """Step directories 1, 2, ... in the given states: "i" intact, "d" damaged or partial."""
    return [(Path(f"step-{k + 1:08d}"), s == "i") for k, s in enumerate(states)]


def names(paths) -> list[int]:
    return [int(p.name[5:]) for p in paths]


def test_the_newest_intact_checkpoints_are_kept_and_only_older_ones_removed() -> None:
    decided = checkpoints_to_prune(dirs("i", "i", "i", "i", "i"), 2)
    assert (names(decided.removed), names(decided.kept)) == ([1, 2, 3], [4, 5])


def test_damaged_and_partial_directories_do_not_count_and_newer_ones_stay() -> None:
    # 5 is a save in progress (or damaged), 3 damaged: the two newest intact are 2 and 4
    decided = checkpoints_to_prune(dirs("i", "i", "d", "i", "d"), 2)
    assert (names(decided.removed), names(decided.kept)) == ([1], [2, 4])


def test_the_newest_intact_checkpoint_is_always_kept() -> None:
    decided = checkpoints_to_prune(dirs("i", "d", "d"), 2)
    assert (names(decided.removed), names(decided.kept)) == ([], [1])
    assert checkpoints_to_prune(dirs("d", "d"), 2).removed == ()  # no intact one: nothing goes


def test_keep_last_0_keeps_all() -> None:
    decided = checkpoints_to_prune(dirs("i", "i", "d", "i"), 0)
    assert (names(decided.removed), names(decided.kept)) == ([], [1, 2, 4])


def _step(root: Path, step: int, *, intact: bool = True) -> Path:
    sdir = root / f"step-{step:08d}"
    sdir.mkdir(parents=True)
    (sdir / "layer-000.safetensors").write_bytes(b"x" * 10)
    if intact:
        (sdir / ckpt.MANIFEST).write_text("{}")
    return sdir


def test_pruning_on_disk_leaves_set_aside_directories_and_reports_what_it_cannot_remove(tmp_path, monkeypatch) -> None:
    for step in (1, 2, 3):
        _step(tmp_path, step)
    aside = tmp_path / "step-00000001.partial-20260101-000000-abcd"
    aside.mkdir()
    monkeypatch.setattr(ckpt.directory, "is_whole", lambda d: (d / ckpt.MANIFEST).exists())
    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path).name == "step-00000001":
            raise PermissionError(13, "Permission denied", str(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    pruning, errors = prune_checkpoints(tmp_path, 1)
    assert names(pruning.removed) == [1, 2] and names(pruning.kept) == [3]
    assert errors == [f"step-00000001: [Errno 13] Permission denied: '{tmp_path / 'step-00000001'}'"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", aside.name, "step-00000003"]


def test_whole_means_a_manifest_and_every_file_it_lists_at_its_size(tmp_path) -> None:
    assert not ckpt.is_whole(_step(tmp_path, 1, intact=False))
    assert ckpt.checkpoint_bytes(tmp_path / "step-00000001") == 10


def test_a_save_fits_by_the_previous_checkpoints_size_else_by_the_state_to_write() -> None:
    assert room_for_save(previous=100, state=10, free=100).fits
    assert not room_for_save(previous=101, state=10, free=100).fits  # the previous one says it is bigger
    assert room_for_save(previous=0, state=100, free=100).fits  # the job's first save
    assert not room_for_save(previous=0, state=101, free=100).fits
    assert room_for_save(previous=0, state=5, free=4).estimate == "the parameters and optimizer state to save"


def test_keep_last_must_be_0_or_at_least_2() -> None:
    assert CheckpointConfig(keep_last=-1).validate() == ["'checkpoint.keep_last' must be >= 0 (got -1)"]
    assert CheckpointConfig(keep_last=1).validate() == [
        "'checkpoint.keep_last' must be 0 (keep all) or >= 2 (got 1): a restore begun from the previous "
        "checkpoint while the newest was completed could find its files removed"
    ]
    assert CheckpointConfig(keep_last=0).validate() == CheckpointConfig(keep_last=2).validate() == []


def _config(tmp: Path, steps: int, *extra: str) -> object:
    return load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=16",
            "training.global_batch_size=4",
            "training.microbatch_size=2",
            f"training.steps={steps}",
            f"checkpoint.dir={tmp / 'ckpt'}",
            "checkpoint.interval_steps=1",
            f"logging.tensorboard_dir={tmp / 'runs'}",
            f"data.cache_dir={tmp / 'cache'}",
            *extra,
        ],
    )


def test_a_run_keeps_the_last_two_checkpoints_and_resumes_from_them(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="oobleck_elastic")
    train(_config(tmp_path, 5, "checkpoint.keep_last=2"))
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "ckpt")] == ["step-00000004", "step-00000005"]
    pruned = [r for r in caplog.records if getattr(r, "oobleck_event", None) == "checkpoint_pruned"]
    assert [r.oobleck_fields["removed"] for r in pruned][-1] == ["step-00000003"]
    second = train(_config(tmp_path, 6, "checkpoint.keep_last=2"))
    assert second.resumed_from == 5 and second.final_step == 6
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "ckpt")] == ["step-00000005", "step-00000006"]


def test_a_save_that_does_not_fit_is_skipped_and_a_missing_final_one_fails_the_job(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(ckpt, "free_bytes", lambda d: 1000)
    with pytest.raises(JobFailed, match=r"the final checkpoint \(step 2\) did not fit in .*checkpoint.keep_last"):
        train(_config(tmp_path, 2))
    skipped = [r.getMessage() for r in caplog.records if getattr(r, "oobleck_event", None) == "checkpoint_skipped"]
    assert len(skipped) == 2 and "checkpoint step-00000001 skipped: it needs about" in skipped[0], skipped
    assert "has 1000 free" in skipped[0] and "checkpoint.dir" in skipped[0]
    assert ckpt.list_checkpoints(tmp_path / "ckpt") == []  # nothing begun is left behind
