"""Saving and restoring a trainer's layers (weights AND optimizer state) with checkpoint.py.

Save: each layer is written once, by its primary holder (the lowest rank holding it), which
also leaves a small JSON receipt (file, sha256, bytes) beside it; after a barrier over the
generation, rank 0 reads the receipts and writes the manifest, which completes the checkpoint.
The data cursor is just the next step: the data order is a function of (seed, step).

Never in place: a complete checkpoint already at the step being saved is set aside first.

Restore: a worker loads exactly the layers it now owns, whatever plan wrote them, copies the
weights into its parameters and installs the optimizer state, and training resumes at the
manifest's step. Tied parameters load the same values from both layers' files.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from .. import checkpoint as ckpt
from ..config import to_dict
from .trainer import Trainer

log = logging.getLogger(__name__)


def _receipt(step_path: Path, layer: int) -> Path:
    return step_path / f"layer-{layer:03d}.receipt.json"


def save(trainer: Trainer, ckpt_dir: str | Path, *, next_step: int) -> Optional[Path]:
    """Write this worker's share of a checkpoint; rank 0 completes it. Returns the step dir."""
    plan = trainer.plan
    if plan is None:
        raise RuntimeError("a trainer saves a checkpoint only after entering a generation")
    primary = {i: min(plan.holders(i)) for i in trainer.owned}
    mine = trainer.state_dict()
    params, optim = mine["layers"], mine["optimizer"]
    step_path = ckpt.step_dir(ckpt_dir, next_step)
    if trainer.rank == 0 and (step_path / ckpt.MANIFEST).exists():
        # never rewrite a checkpoint in place (e.g. a run with checkpoint.resume=false in a used dir)
        moved = ckpt.set_aside(step_path, "replaced")
        log.warning("gen %d step %d node %s: checkpoint %s existed; kept as %s", trainer.generation, next_step,
                    trainer.node, step_path, moved)
    dist.barrier(group=trainer.step_group)  # nobody writes before the old directory is out of the way
    for i in trainer.owned:
        if primary[i] == trainer.rank:
            info = ckpt.save_layer(ckpt_dir, step=next_step, layer=i, params=params[i], optimizer_state=optim[i])
            _receipt(step_path, i).write_text(json.dumps(info))
    dist.barrier(group=trainer.step_group)
    if trainer.rank != 0:
        return step_path
    lm = trainer.layer_model
    layers = []
    for i in range(lm.num_layers):
        path = _receipt(step_path, i)
        layers.append(json.loads(path.read_text()))
        path.unlink()
    manifest = ckpt.write_manifest(ckpt_dir, step=next_step, data_cursor={"step": next_step,
                                                                          "seed": trainer.cfg.training.seed},
                                   plan=plan.to_json(), config=to_dict(trainer.cfg),
                                   layers=layers, layer_names=list(lm.names), hf_names=list(lm.hf_names))
    log.info("gen %d step %d node %s: checkpoint %s", trainer.generation, next_step, trainer.node, manifest.parent)
    return manifest.parent


def restore(trainer: Trainer, path: str | Path) -> int:
    """Load the owned layers' weights and optimizer state from a checkpoint into the trainer
    (`Trainer.load_state_dict`); returns the checkpoint's step, where training goes on."""
    step_path = Path(path)
    manifest = ckpt.read_manifest(step_path)
    if len(manifest["layers"]) != trainer.layer_model.num_layers:
        raise ckpt.CheckpointError(f"checkpoint {step_path} has {len(manifest['layers'])} layers but the model has "
                                   f"{trainer.layer_model.num_layers}: it belongs to another model config")
    layers, optim = {}, {}
    for i in trainer.owned:
        layers[i], optim[i] = ckpt.load_layer(step_path, i, manifest=manifest)
    try:
        trainer.load_state_dict({"next_step": int(manifest["step"]), "layers": layers, "optimizer": optim})
    except KeyError as err:
        raise ckpt.CheckpointError(f"checkpoint {step_path}: {err.args[0]}") from None
    return int(manifest["step"])
