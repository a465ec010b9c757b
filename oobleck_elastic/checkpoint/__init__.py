"""Per-layer safetensors checkpoints with a manifest, atomic writes and verified loads.

One directory per saved step, one file per layer (parameters and optimizer state), the manifest
written last. Invariant: a step directory without a readable manifest is never resumed from (it
is set aside as partial), and a layer file whose size or sha256 differs from the manifest is
reported by name, never loaded; a checkpoint of another model is refused before any file is
read (`different_model`). The story: docs/recovery.md.
"""

from .directory import (
    Pruning,
    Room,
    Unusable,
    checkpoint_bytes,
    checkpoints_to_prune,
    describe_partial,
    find_checkpoint,
    free_bytes,
    is_complete,
    is_whole,
    latest_checkpoint,
    list_checkpoints,
    load_model_state,
    newest_intact_checkpoint,
    nothing_to_do,
    prune_checkpoints,
    room_for_save,
    set_aside,
    set_aside_partials,
)
from .identity import MODEL_KEY, describe_model, different_model, foreign_checkpoint, model_record
from .files import (
    MANIFEST,
    SAVING,
    SCHEMA_VERSION,
    CheckpointError,
    begin_save,
    layer_file,
    load_layer,
    read_manifest,
    save_layer,
    step_dir,
    verify_checkpoint,
    write_manifest,
)

__all__ = [
    "CheckpointError",
    "SCHEMA_VERSION",
    "MANIFEST",
    "step_dir",
    "layer_file",
    "save_layer",
    "write_manifest",
    "read_manifest",
    "latest_checkpoint",
    "nothing_to_do",
    "list_checkpoints",
    "load_layer",
    "load_model_state",
    "prune_checkpoints",
    "checkpoints_to_prune",
    "Pruning",
    "is_whole",
    "checkpoint_bytes",
    "free_bytes",
    "room_for_save",
    "Room",
    "verify_checkpoint",
    "newest_intact_checkpoint",
    "set_aside",
    "set_aside_partials",
    "Unusable",
    "SAVING",
    "begin_save",
    "describe_partial",
    "find_checkpoint",
    "is_complete",
    "MODEL_KEY",
    "describe_model",
    "different_model",
    "foreign_checkpoint",
    "model_record",
]
