"""Which model a checkpoint holds: the identity record its manifest keeps, and the refusal of a
checkpoint of another model before any of its tensors is loaded.

The record (`extra.model` in the manifest) holds what fixes the shapes of the layers' tensors:
family, blocks, widths, heads, vocabulary. A checkpoint from before the record is accepted as it
was. The story: docs/training.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from .directory import latest_checkpoint
from .files import CheckpointError, read_manifest

__all__ = ["MODEL_KEY", "describe_model", "different_model", "foreign_checkpoint", "model_record"]

MODEL_KEY = "model"
"""The key of the identity record in the manifest's `extra`."""

_ALWAYS = ("family", "num_layers", "hidden_size", "vocab_size")
"""What a description always names; the other keys only when they differ."""

_WORDS = {
    "num_layers": "{} layers",
    "hidden_size": "hidden {}",
    "vocab_size": "vocab {}",
    "num_heads": "{} heads",
    "num_kv_heads": "{} key/value heads",
    "intermediate_size": "MLP {}",
    "positions": "{} positions",
    "factory": "factory {}",
}


def model_record(manifest: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """The identity record of a checkpoint's manifest; None for a checkpoint written before it."""
    record = (manifest.get("extra") or {}).get(MODEL_KEY)
    return dict(record) if isinstance(record, Mapping) and record else None


def describe_model(identity: Mapping[str, Any], also: tuple[str, ...] = ()) -> str:
    """`gpt2, 4 layers, hidden 128, vocab 512`, and the keys `also` that it holds."""
    keys = [k for k in (*_ALWAYS, *also) if k in identity]
    return ", ".join(str(identity[k]) if k == "family" else _WORDS.get(k, k + " {}").format(identity[k]) for k in keys)


def different_model(
    ckpt_dir: str | Path, step_name: str, recorded: Optional[Mapping[str, Any]], job: Mapping[str, Any]
) -> Optional[str]:
    """Why the checkpoint `step_name` in `ckpt_dir` (its identity record `recorded`) is no
    checkpoint of the job's model `job`, on one line; None when every key both hold agrees, or
    when it has no record (written before there was one). Both models are described by
    `describe_model`, with the other keys that differ when family, layers, hidden size and
    vocabulary agree."""
    if not recorded:
        return None
    differ = tuple(k for k in recorded if k in job and recorded[k] != job[k])
    if not differ:
        return None
    also = () if set(differ) & set(_ALWAYS) else differ  # a wider model has a wider MLP: named once
    return (
        f"checkpoint.dir={ckpt_dir} holds a checkpoint of another model ({step_name}: "
        f"{describe_model(recorded, also)}; this job: {describe_model(job, also)}): set checkpoint.dir "
        "to a directory of its own"
    )


def foreign_checkpoint(ckpt_dir: str | Path, job: Mapping[str, Any]) -> Optional[str]:
    """`different_model` for the newest complete checkpoint in `ckpt_dir` (the one a resume looks
    at first), or None when there is none. Cheap: its manifest is read, no file verified."""
    latest = latest_checkpoint(ckpt_dir)
    try:
        manifest = read_manifest(latest) if latest is not None else None
    except CheckpointError:  # set aside meanwhile by another worker: the resume says what it finds
        return None
    return different_model(ckpt_dir, latest.name, model_record(manifest), job) if latest and manifest else None
