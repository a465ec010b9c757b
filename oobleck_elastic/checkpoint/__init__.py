"""Per-layer safetensors checkpoints with a manifest, atomic writes and verified loads.

Layout (one directory per saved step):

    <dir>/step-00000042/layer-000.safetensors    parameters + optimizer state of layer 0
    <dir>/step-00000042/layer-001.safetensors
    ...
    <dir>/step-00000042/manifest.json             written last: the checkpoint is complete

A layer file holds `param.<name>` for every parameter of the layer (local names, as in
`layer.named_parameters()`) and `optim.<name>.<key>` for every optimizer state tensor of that
parameter (AdamW: `exp_avg`, `exp_avg_sq`, `step`). One file per layer lets any stage write the
layers it owns, in parallel with the others, and lets a re-planned job load exactly the layers a
worker now holds, whatever the old stage split was. Tied weights (GPT-2 `wte` = `lm_head`) are
stored in both layers' files, as each stage holds its own copy.

Every file is written to a temporary name in the same directory, fsynced and renamed (then the
directory is fsynced), so a crash leaves either the old state or the new file, never a partial
one. The manifest (`schema_version`, step, data cursor, plan, config, per-layer file, sha256 and
size, layer names, Hugging Face names) is written only after every layer file is in place, so
`latest_checkpoint` treats a step directory without a readable manifest as incomplete and
falls back to the previous one. `load_layer` checks the size and sha256 recorded in the
manifest before parsing, so a corrupt or truncated file is reported by name instead of
silently loading bad weights. `load_model_state` maps local names to Hugging Face names, so a
checkpoint loads into a fresh `transformers` model with `load_state_dict`.

Partial checkpoints. A save interrupted by a failure leaves a step directory without a manifest:
some layer files, maybe a `.tmp-` file of a writer that was killed. A save first writes
`saving.json` (the step, how many layer files it will write, the generation), so such a
directory says how far its save got (`describe_partial`: "no manifest (5 of 10 layer files,
1 .tmp file)"). Nothing resumes from it; `set_aside_partials` renames every one out of the
listing (`step-XXXXXXXX.partial-<time>`, kept for a post-mortem) and says why, and
`find_checkpoint` (`oobleck export`) names each partial or damaged one when there is no intact
checkpoint.
"""

from .directory import (
    Unusable,
    describe_partial,
    find_checkpoint,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    load_model_state,
    newest_intact_checkpoint,
    nothing_to_do,
    prune_checkpoints,
    set_aside,
    set_aside_partials,
)
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
]
