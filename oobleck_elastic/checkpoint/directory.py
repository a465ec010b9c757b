"""The checkpoint root: which step directories it holds, the newest usable one, partial saves
set aside, old ones pruned (`checkpoint.keep_last`), the room a save needs, and the model state
of the newest.

A step directory is complete when its manifest is there (`checkpoint.files` writes it last);
partial checkpoints are set aside, never resumed from. The story: docs/recovery.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .files import MANIFEST, SAVING, CheckpointError, fsync_dir, load_layer, read_manifest, verify_checkpoint

_STEP_RE = re.compile(r"^step-(\d{8,})$")
_ASIDE_RE = re.compile(r"^step-(\d{8,})\.([a-z]+)-")
_LAYER_RE = re.compile(r"^layer-\d{3,}\.safetensors$")


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Every step directory under `ckpt_dir` (complete or not), oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The newest step directory whose manifest exists and parses; None if there is none."""
    return next((d for d in reversed(list_checkpoints(ckpt_dir)) if is_complete(d)), None)


def nothing_to_do(ckpt_dir: str | Path, steps: int) -> str | None:
    """Why a run resuming from `ckpt_dir` has no step left to train (its newest complete checkpoint
    is already at `steps`, training.steps), or None. Cheap: the manifest is read, no file verified."""
    latest = latest_checkpoint(ckpt_dir)
    if latest is None or _step(latest) < steps:
        return None
    return (
        f"nothing to do: checkpoint {latest.name} in {ckpt_dir} is already at training.steps={steps}; "
        f"raise training.steps, point checkpoint.dir elsewhere or set checkpoint.resume=false"
    )


@dataclass(frozen=True)
class Unusable:
    """A step directory a resume cannot use."""

    path: Path
    """The step directory."""
    reason: str
    """Why (names the bad file)."""
    damaged: bool
    """A manifest is there but it, or a file it lists, is bad (not just an interrupted save)."""


def newest_intact_checkpoint(
    ckpt_dir: str | Path, *, num_layers: int | None = None
) -> tuple[Path | None, list[Unusable]]:
    """The newest step directory that verifies completely (`verify_checkpoint`), and every newer
    one that does not, newest first. A directory without a manifest is an interrupted save
    (`describe_partial` says why); one whose manifest or files are bad is damaged."""
    unusable: list[Unusable] = []
    for sdir in reversed(list_checkpoints(ckpt_dir)):
        if not (sdir / MANIFEST).exists():
            unusable.append(Unusable(path=sdir, reason=describe_partial(sdir, num_layers), damaged=False))
            continue
        try:
            verify_checkpoint(sdir)
            return sdir, unusable
        except CheckpointError as err:
            unusable.append(Unusable(path=sdir, reason=str(err), damaged=True))
    return None, unusable


def describe_partial(sdir: str | Path, num_layers: int | None = None) -> str:
    """Why a step directory without a manifest is no checkpoint, from what its save left:
    `no manifest (5 of 10 layer files, 1 .tmp file)`. The layer count is the one its
    `saving.json` recorded, else `num_layers` (unknown: `5 layer files`)."""
    try:
        names = [p.name for p in Path(sdir).iterdir()]
    except OSError:  # another worker set it aside meanwhile
        names = []
    expected: int | None
    try:
        expected = int(json.loads((Path(sdir) / SAVING).read_text())["num_layers"])
    except (OSError, ValueError, TypeError, KeyError):
        expected = num_layers
    layers = sum(1 for n in names if _LAYER_RE.match(n))
    tmp = sum(1 for n in names if ".tmp-" in n)
    parts = [f"{layers} of {expected} layer files" if expected is not None else f"{layers} layer files"]
    if tmp:
        parts.append(f"{tmp} .tmp file{'s' if tmp > 1 else ''}")
    return f"no manifest ({', '.join(parts)})"


def set_aside_partials(ckpt_dir: str | Path, num_layers: int | None = None) -> list[tuple[Path, Path, str]]:
    """Rename every step directory without a manifest (an interrupted save) out of the listing,
    as `step-XXXXXXXX.partial-<time>` (`set_aside`): (directory, new name, why) for each one this
    call moved."""
    moved = []
    for sdir in list_checkpoints(ckpt_dir):
        if (sdir / MANIFEST).exists():
            continue
        why = describe_partial(sdir, num_layers)
        target = set_aside(sdir, "partial")
        if target is not None:
            moved.append((sdir, target, why))
    return moved


def find_checkpoint(path: str | Path) -> tuple[Path, str | None]:
    """The step directory `path` names: itself when it has a manifest, else the newest intact one
    under it; with a note saying which was chosen and what was skipped (None when `path` is one).
    Raises CheckpointError naming every partial or damaged step directory and why, on one line,
    when there is no intact one."""
    p = Path(path).expanduser()
    if (p / MANIFEST).is_file():
        return p, None
    if p.is_dir() and (_STEP_RE.match(p.name) or _ASIDE_RE.match(p.name)):
        raise CheckpointError(
            f"'{p}' is a partial checkpoint: {p.name}: {describe_partial(p)}; give an intact step "
            "directory or the directory holding them (checkpoint.dir)"
        )
    aside = sorted(
        (d for d in p.iterdir() if d.is_dir() and _ASIDE_RE.match(d.name)) if p.is_dir() else [],
        key=lambda d: (_step(d), d.name),
    )
    if not list_checkpoints(p) and not aside:
        raise CheckpointError(
            f"'{p}' is not a checkpoint: give a step directory (step-XXXXXXXX with "
            f"{MANIFEST}) or the directory holding them (checkpoint.dir)"
        )
    found, unusable = newest_intact_checkpoint(p)
    if found is None:
        named = [(u.path, u.reason) for u in unusable]
        for d in aside:
            why = _ASIDE_RE.match(d.name)
            state = describe_partial(d) if not (d / MANIFEST).exists() else "has a manifest"
            named.append((d, f"set aside as {why.group(2) if why else '?'}, {state}"))
        reasons = "; ".join(f"{d.name}: {why}" for d, why in sorted(named, key=lambda e: (_step(e[0]), e[0].name)))
        raise CheckpointError(f"no intact checkpoint under {p}, only partial or damaged ones: {reasons}")
    skipped = "".join(f"; skipped {u.path.name} ({'damaged' if u.damaged else 'incomplete'})" for u in unusable)
    return found, f"checkpoint {found.name} (newest intact under {p}{skipped})"


def set_aside(step_dir: str | Path, why: str) -> Path | None:
    """Rename a step directory out of the checkpoint listing (`step-XXXXXXXX.<why>-<time>`), so that
    it is kept for a post-mortem but never resumed from nor rewritten in place. Several workers
    may race to do it: the loser gets None."""
    sdir = Path(step_dir)
    target = sdir.with_name(f"{sdir.name}.{why}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}")
    try:
        os.rename(sdir, target)
    except FileNotFoundError:
        return None
    fsync_dir(sdir.parent)
    return target


def load_model_state(path: str | Path, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """The full model state dict under Hugging Face names, from a step directory or a checkpoint
    root (its latest complete checkpoint). Tied weights appear under every HF name."""
    p = Path(path)
    if (p / MANIFEST).is_file() or p.name == MANIFEST:
        sdir = p.parent if p.name == MANIFEST else p
    else:
        found = latest_checkpoint(p)
        if found is None:
            raise CheckpointError(
                f"no complete checkpoint under {p}: expected a step-XXXXXXXX "
                f"directory with {MANIFEST} (or such a directory itself)"
            )
        sdir = found
    manifest = read_manifest(sdir)
    state: dict[str, torch.Tensor] = {}
    for i, names in enumerate(manifest["hf_names"]):
        params, _ = load_layer(sdir, i, verify=verify, manifest=manifest)
        for local, tensor in params.items():
            if local not in names:
                raise CheckpointError(
                    f"checkpoint {sdir}: parameter '{local}' of layer {i} "
                    f"({manifest['layer_names'][i]}) has no Hugging Face name "
                    f"in {MANIFEST}"
                )
            state[names[local]] = tensor
    return state


@dataclass(frozen=True)
class Pruning:
    """What `checkpoints_to_prune` decided: the step directories to remove and the intact ones kept."""

    removed: tuple[Path, ...]
    kept: tuple[Path, ...]


def checkpoints_to_prune(dirs: Sequence[tuple[Path, bool]], keep_last: int) -> Pruning:
    """Which step directories a save leaves behind, from `dirs` ((directory, intact), oldest first,
    every listed `step-XXXXXXXX`; intact: its manifest parses and every file it lists is there).
    The `keep_last` newest intact ones are kept, so the newest intact one always is; of the rest
    only those older than the oldest kept one go, intact or damaged; a directory newer than it
    (the newest intact may be followed by a save in progress or a damaged one) stays. 0 keeps all.
    Directories set aside (`set_aside`) are not listed: they stay, for a post-mortem."""
    if keep_last <= 0:
        return Pruning(removed=(), kept=tuple(d for d, ok in dirs if ok))
    kept = [d for d, ok in dirs if ok][-keep_last:]
    if not kept:
        return Pruning(removed=(), kept=())
    oldest = _step(kept[0])
    return Pruning(removed=tuple(d for d, _ in dirs if _step(d) < oldest), kept=tuple(kept))


def prune_checkpoints(ckpt_dir: str | Path, keep_last: int) -> tuple[Pruning, list[str]]:
    """Remove the step directories `checkpoints_to_prune` names under `ckpt_dir`: what it decided,
    and a line for each directory that could not be removed (an OSError; the rest go on)."""
    dirs = [(d, is_whole(d)) for d in list_checkpoints(ckpt_dir)]
    pruning = checkpoints_to_prune(dirs, keep_last)
    errors = []
    for d in pruning.removed:
        try:
            shutil.rmtree(d)
        except FileNotFoundError:  # another pruner was first
            continue
        except OSError as err:
            errors.append(f"{d.name}: {err}")
    return pruning, errors


def is_whole(sdir: Path) -> bool:
    """The step directory's manifest parses and every layer file it lists is there with its size
    (cheap: no file is hashed; a resume still verifies every file, `newest_intact_checkpoint`)."""
    try:
        manifest = read_manifest(sdir)
        return all((sdir / e["file"]).stat().st_size == e["bytes"] for e in manifest["layers"])
    except (CheckpointError, OSError):
        return False


def checkpoint_bytes(sdir: str | Path) -> int:
    """Bytes a step directory takes: the sizes of every file under it."""
    return sum(p.stat().st_size for p in Path(sdir).rglob("*") if p.is_file())


@dataclass(frozen=True)
class Room:
    """Whether a checkpoint fits in its directory's filesystem (`room_for_save`)."""

    needed: int
    """Estimated bytes of the checkpoint."""
    free: int
    """Bytes free on the filesystem."""
    estimate: str
    """Where `needed` comes from."""

    @property
    def fits(self) -> bool:
        return self.needed <= self.free


def room_for_save(*, previous: int, state: int, free: int) -> Room:
    """Whether a checkpoint fits in `free` bytes: its size is the previous checkpoint's on disk
    (`previous`, 0: none) when there is one, else `state`, the bytes of the parameters and
    optimizer state the workers are about to write."""
    if previous > 0:
        return Room(needed=previous, free=free, estimate="the size of the previous checkpoint")
    return Room(needed=state, free=free, estimate="the parameters and optimizer state to save")


def free_bytes(ckpt_dir: str | Path) -> int:
    """Bytes free to this user on the filesystem of `ckpt_dir` (of its nearest existing parent
    when it is not there yet)."""
    p = Path(ckpt_dir).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def is_complete(sdir: Path) -> bool:
    """The step directory has a manifest that parses (its files are not checked)."""
    try:
        read_manifest(sdir)
    except CheckpointError:
        return False
    return True


def _step(sdir: Path) -> int:
    m = _STEP_RE.match(sdir.name) or _ASIDE_RE.match(sdir.name)
    return int(m.group(1)) if m else -1
