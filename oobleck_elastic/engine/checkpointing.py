"""Saving and restoring a trainer's layers, weights AND optimizer state, with checkpoint.py
(`save`, `restore`), and when (`CheckpointPolicy`).

Invariant: a checkpoint holds only applied steps, one file per layer, complete only once rank 0
wrote its manifest; it never overwrites a complete one nor builds on a partial one; it restores
into any plan (engine/checkpoint_state.py). A resume is all or nothing: the newest checkpoint
whose every file verifies is found before anything is restored. A re-plan that leaves a layer
short of f+1 copies saves one at once ("retake"). Only `checkpoint.keep_last` are kept (`prune`),
and a save that does not fit on disk is skipped by every worker alike. docs/recovery.md,
docs/training.md.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import torch
import torch.distributed as dist

from .. import checkpoint as ckpt
from ..config import JobConfig, to_dict
from ..data.errors import DataError
from ..data.tokenizer import save_tokenizer_files
from ..logs import JobLog
from ..models.identity import model_identity
from ..planning import Plan, shortfall
from .step.collectives import Collective, retake_collectives, save_collectives
from .resilience.guard import StepGuard
from .entry.reconfigure import LayerSources
from .trainer import LayersLost, Trainer

log = JobLog(logging.getLogger(__name__))


class NothingToRestore(RuntimeError):
    """Some layer has no surviving copy and no checkpoint holds it: the job cannot go on. The
    worker closes the job as failed (engine/worker.py), so no agent restarts its workers into a
    job that would train from step 0 again on re-initialised layers."""


def _receipt(step_path: Path, layer: int) -> Path:
    return step_path / f"layer-{layer:03d}.receipt.json"


def guard_record(trainer: Trainer, guard: Optional[StepGuard]) -> dict[str, Any]:
    """The step guard's state a checkpoint keeps (`extra.guard`): the running maximum of the loss
    (the same on every worker after the commit) and the skipped steps."""
    return {"max_loss": trainer.state.max_loss, **(guard.state_dict() if guard is not None else {})}


def load_guard_record(trainer: Trainer, guard: Optional[StepGuard], manifest: Mapping[str, Any]) -> None:
    """Back to a checkpoint's guard state (none recorded: no maximum yet, nothing skipped)."""
    record = (manifest.get("extra") or {}).get("guard") or {}
    trainer.state.max_loss = float(record.get("max_loss", 0.0))
    if guard is not None:
        guard.load_state_dict(record)


def save(
    trainer: Trainer,
    ckpt_dir: str | Path,
    *,
    next_step: int,
    guard: Optional[StepGuard] = None,
    began: Optional[float] = None,
    keep_last: int = 0,
) -> Optional[Path]:
    """Write this worker's share of a checkpoint; rank 0 completes it. Returns the step dir, or
    None when every worker skipped it for want of disk space.
    Rank 0 first sets aside a complete checkpoint already at this step and every partial one
    (`step-XXXXXXXX.partial-<time>`, one log line each) and measures the free space; one
    all-reduce (`save_collectives`) sums it with the previous checkpoint's size and every worker's
    bytes to write, and every worker takes the same decision from those sums (`room_for_save`):
    a checkpoint that does not fit is skipped, with one warning naming the keys to change. Each
    layer is written once, by its primary holder (the lowest rank holding it), with a JSON receipt
    (file, sha256, bytes) beside it; after a barrier rank 0 copies the job's tokenizer into
    `<step>/tokenizer/` and writes the manifest, which completes the checkpoint, with the model's
    identity (`extra.model`, models/identity.py), then keeps the `keep_last` newest intact ones
    (`prune`; 0: all). The data cursor is just the next step.
    `guard`: the step guard whose skip history goes in the manifest (`guard_record`). The
    `checkpoint` line's `seconds` run from `began` (`time.perf_counter()`; default: now) to the
    manifest, on this clock, not the goodput ledger's (tests cross-check the two)."""
    t0 = time.perf_counter() if began is None else began
    plan = trainer.plan
    if plan is None:
        raise RuntimeError("a trainer saves a checkpoint only after entering a generation")
    primary = {i: min(plan.holders(i)) for i in trainer.owned}
    mine = trainer.checkpoint_state.state_dict()
    params, optim = mine["layers"], mine["optimizer"]
    for i, layer in params.items():  # the step guard never applies a non-finite step (engine/resilience/guard.py)
        bad = [n for n, t in layer.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if bad:
            raise ckpt.CheckpointError(
                f"layer {i} parameter(s) {bad} hold non-finite values at step {next_step}: "
                "not saved (the newest intact checkpoint stays the newest)"
            )
    step_path = ckpt.step_dir(ckpt_dir, next_step)
    lm = trainer.layer_model
    at = log.at(gen=trainer.generation, step=next_step, node=trainer.node)
    writes = sum(_bytes(params[i]) + _bytes(optim[i]) for i in trainer.owned if primary[i] == trainer.rank)
    room = torch.tensor([writes, 0, 0], dtype=torch.int64, device=trainer.device)
    if trainer.rank == 0:
        if (step_path / ckpt.MANIFEST).exists():
            # never rewrite a checkpoint in place (e.g. a run with checkpoint.resume=false in a used dir)
            moved = ckpt.set_aside(step_path, "replaced")
            at.warning("checkpoint %s existed; kept as %s", step_path, moved)
        for old, new, why in ckpt.set_aside_partials(ckpt_dir, lm.num_layers):
            at.warning(
                "interrupted checkpoint %s set aside as %s: %s",
                old,
                new.name,
                why,
                event="checkpoint_partial",
                fields={"path": str(old), "moved_to": str(new), "why": why},
            )
        previous = ckpt.latest_checkpoint(ckpt_dir)
        room[1] = ckpt.free_bytes(ckpt_dir)
        room[2] = ckpt.checkpoint_bytes(previous) if previous is not None else 0
        ckpt.begin_save(ckpt_dir, step=next_step, num_layers=lm.num_layers, generation=trainer.generation)
    # nobody writes before the old directory is out of the way; the sums decide alike everywhere
    dist.all_reduce(room, op=dist.ReduceOp.SUM, group=trainer.step_group)
    state, free, before = (int(v) for v in room.tolist())
    verdict = ckpt.room_for_save(previous=before, state=state, free=free)
    if Collective.CHECKPOINT_BARRIER not in save_collectives(fits=verdict.fits):
        if trainer.rank == 0:
            at.warning(
                "checkpoint %s skipped: it needs about %d bytes (%s) and %s has %d free; the newest "
                "checkpoint stays the newest; free space, lower checkpoint.keep_last or move checkpoint.dir",
                step_path.name,
                verdict.needed,
                verdict.estimate,
                ckpt_dir,
                verdict.free,
                event="checkpoint_skipped",
                fields={
                    "path": str(step_path),
                    "needed": verdict.needed,
                    "free": verdict.free,
                    "seconds": time.perf_counter() - t0,  # the look, charged to checkpointing like a retake's
                },
            )
            try:  # only its `saving.json` is there; left behind, the next save sets it aside
                (step_path / ckpt.SAVING).unlink()
                step_path.rmdir()
            except OSError:
                pass
        return None
    for i in trainer.owned:
        if primary[i] == trainer.rank:
            info = ckpt.save_layer(ckpt_dir, step=next_step, layer=i, params=params[i], optimizer_state=optim[i])
            _receipt(step_path, i).write_text(json.dumps(info))
    dist.barrier(group=trainer.step_group)
    if trainer.rank != 0:
        return step_path
    layers = []
    for i in range(lm.num_layers):
        path = _receipt(step_path, i)
        layers.append(json.loads(path.read_text()))
        path.unlink()
    extra: dict[str, Any] = {"guard": guard_record(trainer, guard), ckpt.MODEL_KEY: model_identity(trainer.cfg.model)}
    files = getattr(trainer.dataset, "tokenizer", None)
    if files is not None:  # the tokenizer goes along, for `oobleck export` (models/export_tokenizer.py)
        try:
            record = save_tokenizer_files(files, step_path)
        except (DataError, OSError) as err:
            record = None
            at.warning("checkpoint %s carries no tokenizer: %s", step_path, err)
        if record is not None:
            extra["tokenizer"] = record
    manifest = ckpt.write_manifest(
        ckpt_dir,
        step=next_step,
        data_cursor={"step": next_step, "seed": trainer.cfg.training.seed},
        plan=plan.to_json(),
        config=to_dict(trainer.cfg),
        layers=layers,
        layer_names=list(lm.names),
        hf_names=list(lm.hf_names),
        extra=extra,
    )
    (step_path / ckpt.SAVING).unlink(missing_ok=True)  # the manifest says it all now
    seconds = time.perf_counter() - t0
    at.info(
        "checkpoint %s (%.3f s)",
        manifest.parent,
        seconds,
        event="checkpoint",
        fields={"path": str(manifest.parent), "seconds": seconds},
    )
    prune(ckpt_dir, keep_last, at)
    return manifest.parent


def prune(ckpt_dir: str | Path, keep_last: int, at: Any) -> None:
    """Rank 0, once its checkpoint is complete: keep the `keep_last` newest intact checkpoints
    (checkpoint/directory.py `checkpoints_to_prune`; 0: all). Every worker of the generation has
    passed the save's collectives, so none is still restoring (restores happen at the entry). A
    newer generation's restore reads the newest intact checkpoint at its start: this one or, when
    it looked before this manifest, the previous one, so `checkpoint.keep_last` is 0 or >= 2.
    Shadow copies are seeded from memory (`Trainer.reseed_shadows`), never from a checkpoint.
    Pruning never fails the job: a directory that cannot be removed is one warning."""
    if keep_last <= 0:
        return
    try:
        pruning, errors = ckpt.prune_checkpoints(ckpt_dir, keep_last)
    except OSError as err:
        pruning, errors = ckpt.Pruning(removed=(), kept=()), [str(err)]
    if errors:
        at.warning("could not remove old checkpoints under %s: %s", ckpt_dir, "; ".join(errors))
    gone = [d.name for d in pruning.removed]
    if gone:
        kept = [d.name for d in pruning.kept]
        at.info(
            "removed checkpoints %s (checkpoint.keep_last=%d keeps %s)",
            ", ".join(gone),
            keep_last,
            ", ".join(kept),
            event="checkpoint_pruned",
            fields={"removed": gone, "kept": kept},
        )


def _bytes(tree: Any) -> int:
    """Bytes of the tensors in a nested dict (a layer's parameters or optimizer state)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, Mapping):
        return sum(_bytes(v) for v in tree.values())
    return 0


def restore(trainer: Trainer, path: str | Path, *, guard: Optional[StepGuard] = None) -> int:
    """Load the owned layers' weights and optimizer state from a checkpoint into the trainer
    (`Trainer.checkpoint_state.load_state_dict`), and the step guard's state (`load_guard_record`); returns the
    checkpoint's step, where training goes on. Whatever plan wrote it; tied parameters load the
    same values from both layers' files. A checkpoint of another model (its identity record,
    `checkpoint.different_model`) is refused before any file is read."""
    step_path = Path(path)
    manifest = ckpt.read_manifest(step_path)
    foreign = ckpt.different_model(
        step_path.parent, step_path.name, ckpt.model_record(manifest), model_identity(trainer.cfg.model)
    )
    if foreign:
        raise ckpt.CheckpointError(foreign)
    if len(manifest["layers"]) != trainer.layer_model.num_layers:
        raise ckpt.CheckpointError(
            f"checkpoint {step_path} has {len(manifest['layers'])} layers but the model has "
            f"{trainer.layer_model.num_layers}: it belongs to another model config"
        )
    layers, optim = {}, {}
    for i in trainer.owned:
        layers[i], optim[i] = ckpt.load_layer(step_path, i, manifest=manifest)
    try:
        trainer.checkpoint_state.load_state_dict(
            {"next_step": int(manifest["step"]), "layers": layers, "optimizer": optim}
        )
    except KeyError as err:
        raise ckpt.CheckpointError(f"checkpoint {step_path}: {err.args[0]}") from None
    load_guard_record(trainer, guard, manifest)
    trainer.reseed_shadows()  # the shadow copies were older than the restored layers
    return int(manifest["step"])


def restored_sources(plan: Optional[Plan], path: str | Path, num_layers: int) -> LayerSources:
    """Where the layers came from after a restore of the checkpoint at `path` into `plan`: every
    layer from disk, the bytes its manifest gives for the files every worker read (the single
    process, with no plan, reads every layer once)."""
    sizes = [int(e["bytes"]) for e in ckpt.read_manifest(path)["layers"]]
    if plan is None:
        return LayerSources(disk=tuple(range(num_layers)), disk_bytes=sum(sizes))
    return LayerSources.of_restore(plan, sizes)


def retake_reason(
    plan: Plan, *, previous: int, step: int, steps: int, extra: Optional[Mapping[int, Iterable[str]]] = None
) -> Optional[str]:
    """Why the workers entering `plan`'s generation at `step` must save a checkpoint before its
    first step, or None: the plan leaves some layer with fewer than f+1 copies (planning/tolerance/copies.py:
    distinct nodes holding it, plus shadow copies), so the next failure could take its last copy
    and force a restore of an old checkpoint. Not at the job's first start, not on a plan that
    only re-splits the batch, not after the last step. `previous`: the newest generation any of
    them was in (0 at the job's first start); `steps`: training.steps; `extra`: shadow copies
    ({layer: nodes}, planning/tolerance/copies.py)."""
    if previous <= 0 or plan.rebalanced or step >= steps:
        return None
    short = shortfall(plan, extra)
    if short is None:
        return None
    return f"generation {plan.generation}: {short.describe()}; checkpoint at step {step}"


class CheckpointPolicy:
    """When a worker resumes (`checkpoint.resume`, at the first start), restores (a layer lost),
    saves (every `checkpoint.interval_steps` and at the end, keeping `checkpoint.keep_last`) and
    retakes (`retake_reason`: once per generation, unless a complete checkpoint of the step exists
    or one was just restored)."""

    def __init__(self, cfg: JobConfig, *, node: str, guard: Optional[StepGuard] = None) -> None:
        self.cfg, self.node, self.guard = cfg, node, guard
        self.resumed: Optional[int] = None
        """Step of the checkpoint the job resumed from at its start, if any."""
        self.final_dir: Optional[Path] = None
        """The final checkpoint, once written."""
        self._saved: Optional[tuple[int, Path]] = None
        """The step and directory of the newest checkpoint this worker saved or resumed from."""

    def intact_checkpoint(self, trainer: Trainer) -> Optional[Path]:
        """The newest checkpoint whose every file verifies, found before anything is restored, so
        a resume is all or nothing. Newer unusable ones are named in the log and set aside (kept,
        never resumed from nor rewritten in place). Damaged ones and no intact one: an error
        naming the bad file, never "no checkpoint"."""
        path, unusable = ckpt.newest_intact_checkpoint(
            self.cfg.checkpoint.dir, num_layers=trainer.layer_model.num_layers
        )
        at = log.at(gen=trainer.generation, node=self.node)
        damaged = [u for u in unusable if u.damaged]
        for u in damaged:
            at.warning("checkpoint %s cannot be used: %s", u.path.name, u.reason)
        if damaged and path is None:
            raise ckpt.CheckpointError(f"no intact checkpoint under {self.cfg.checkpoint.dir}: {damaged[0].reason}")
        for u in unusable:
            moved = ckpt.set_aside(u.path, "corrupt" if u.damaged else "partial")
            if moved is not None and not u.damaged:  # the worker that moved it says so, once
                at.warning(
                    "interrupted checkpoint %s set aside as %s: %s",
                    u.path,
                    moved.name,
                    u.reason,
                    event="checkpoint_partial",
                    fields={"path": str(u.path), "moved_to": str(moved), "why": u.reason},
                )
        if unusable and path is not None:
            log.at(gen=trainer.generation, node=self.node).warning("using checkpoint %s instead", path.name)
        return path

    def resume(self, trainer: Trainer) -> int:
        """At the job's first start: the step to begin at (0, or a checkpoint's when resuming)."""
        latest = self.intact_checkpoint(trainer) if self.cfg.checkpoint.resume else None
        if latest is None:
            return 0
        self.resumed = restore(trainer, latest, guard=self.guard)
        self._saved = (self.resumed, latest)
        trainer.samples.restored(self.resumed, generation=trainer.generation, rank=trainer.rank)
        log.at(gen=trainer.generation, step=self.resumed, node=self.node).info(
            "resumed from %s", latest, event="resumed"
        )
        return self.resumed

    def restore_lost(self, trainer: Trainer, err: LayersLost) -> tuple[int, str]:
        """Some layer has no surviving copy: restore the newest checkpoint (all workers do).
        Returns (the step to go on from, a line saying what happened)."""
        latest = self.intact_checkpoint(trainer)
        if latest is None:
            raise NothingToRestore(
                f"{err} and no checkpoint in {self.cfg.checkpoint.dir}: cannot continue without "
                "training on re-initialised layers; set checkpoint.interval_steps"
            ) from err
        step = restore(trainer, latest, guard=self.guard)
        trainer.samples.restored(step, generation=trainer.generation, rank=trainer.rank)
        sources = restored_sources(trainer.plan, latest, trainer.layer_model.num_layers)
        text = (
            f"generation {trainer.generation}: layers {err.layers} had no surviving copy; restored checkpoint "
            f"{latest} and continue from step {step}; {sources.describe()}"
        )
        log.at(gen=trainer.generation, step=step, node=self.node).warning(
            "%s", text, event="restored", fields={"lost": list(err.layers), "sources": sources.fields()}
        )
        return step, text

    def retake(self, trainer: Trainer, reason: str, step: int) -> Optional[Path]:
        """Save the checkpoint `retake_reason` asked for (every worker calls this), unless a
        complete one of `step` exists already: rank 0 looks, one all-reduce tells the others
        (`retake_collectives`, on the step group like every checkpoint collective). The time
        counted (`seconds` of the `checkpoint` or `checkpoint_retake` line) includes the look."""
        t0 = time.perf_counter()
        exists = torch.zeros(1, device=trainer.device)
        if trainer.rank == 0:
            exists[0] = float(ckpt.is_complete(ckpt.step_dir(self.cfg.checkpoint.dir, step)))
        dist.all_reduce(exists, op=dist.ReduceOp.MAX, group=trainer.step_group)
        at = log.at(gen=trainer.generation, step=step, node=self.node)
        if Collective.CHECKPOINT_ROOM not in retake_collectives(exists=bool(exists.item())):
            if trainer.rank == 0:
                at.info(
                    "%s exists already (not retaken)",
                    reason,
                    event="checkpoint_retake",
                    fields={"saved": False, "seconds": time.perf_counter() - t0},
                )
            return None
        if trainer.rank == 0:
            at.warning("%s", reason, event="checkpoint_retake", fields={"saved": True})
        return self._save(trainer, step, began=t0)

    def after_step(self, trainer: Trainer, done: int) -> None:
        """`done` steps are complete: save every `checkpoint.interval_steps` (not the last: `finish`)."""
        every = self.cfg.checkpoint.interval_steps
        if every and done % every == 0 and done < self.cfg.training.steps:
            self._save(trainer, done)

    def finish(self, trainer: Trainer, *, trained: bool, step: Optional[int] = None) -> Optional[str]:
        """The final checkpoint at `step` (default `training.steps`; earlier when the job was asked
        to stop), unless this run resumed there and trained nothing, or this step was just saved.
        Returns why the job ends without it (it did not fit on disk: `save`), or None."""
        step = self.cfg.training.steps if step is None else step
        if self._saved is not None and self._saved[0] == step:
            self.final_dir = self._saved[1]
            return None
        if not trained and self.resumed is not None:
            return None
        self.final_dir = self._save(trainer, step)
        if self.final_dir is not None:
            return None
        return (
            f"the final checkpoint (step {step}) did not fit in {self.cfg.checkpoint.dir}: the {step} steps "
            "trained are not saved past the newest checkpoint; free space, lower checkpoint.keep_last or "
            "move checkpoint.dir, then run the job again to resume"
        )

    def _save(self, trainer: Trainer, step: int, *, began: Optional[float] = None) -> Optional[Path]:
        cfg = self.cfg.checkpoint
        path = save(trainer, cfg.dir, next_step=step, guard=self.guard, began=began, keep_last=cfg.keep_last)
        if path is not None:
            self._saved = (step, path)
        return path
