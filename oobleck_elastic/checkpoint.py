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

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

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

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
SAVING = "saving.json"
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_ASIDE_RE = re.compile(r"^step-(\d{8,})\.([a-z]+)-")
_LAYER_RE = re.compile(r"^layer-\d{3,}\.safetensors$")
_FALLBACK = "delete {dir} to fall back to an older checkpoint"


class CheckpointError(RuntimeError):
    """A missing, corrupt or malformed checkpoint; the message names the file."""


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    """`<ckpt_dir>/step-<8 digits>`."""
    return Path(ckpt_dir) / f"step-{int(step):08d}"


def layer_file(layer: int) -> str:
    """`layer-<3 digits>.safetensors`."""
    return f"layer-{int(layer):03d}.safetensors"


# ----------------------------------------------------------------------------- atomic writes


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic(path: Path, write: Callable[[Path], object]) -> None:
    """write(tmp) on a temp path next to `path`, fsync, rename to `path`, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- save


def _storable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors; repeats of a storage are cloned (safetensors refuses
    tensors that share memory)."""
    out, seen = {}, set()
    for key, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
        elif ptr is not None:
            seen.add(ptr)
        out[key] = t
    return out


def save_layer(
    ckpt_dir: str | Path,
    *,
    step: int,
    layer: int,
    params: dict[str, torch.Tensor],
    optimizer_state: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """Write one layer's parameters and optimizer state; returns {"file", "sha256", "bytes"}.

    Non-tensor optimizer values (a float `step`) are stored as 0-dim tensors and restored as
    Python numbers by `load_layer`.
    """
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, str] = {}
    for name, p in params.items():
        tensors[f"param.{name}"] = p
    for name, state in optimizer_state.items():
        if name not in params:
            raise ValueError(
                f"save_layer(layer={layer}): optimizer state for '{name}', which is "
                f"not a parameter of the layer ({sorted(params)})"
            )
        for key, value in state.items():
            if "." in key:
                raise ValueError(
                    f"save_layer(layer={layer}): optimizer state key '{key}' of '{name}' contains '.'; rename it"
                )
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{name}.{key}"] = value
            elif isinstance(value, (bool, int, float)):
                tensors[f"optim.{name}.{key}"] = torch.tensor(value)
                scalars[f"optim.{name}.{key}"] = type(value).__name__
            else:
                raise TypeError(
                    f"save_layer(layer={layer}): optimizer state '{name}.{key}' is a "
                    f"{type(value).__name__}; only tensors and numbers are stored"
                )
    metadata = {
        "format": "oobleck-layer",
        "schema_version": str(SCHEMA_VERSION),
        "step": str(int(step)),
        "layer": str(int(layer)),
        "scalars": json.dumps(scalars),
    }
    path = step_dir(ckpt_dir, step) / layer_file(layer)
    storable = _storable(tensors)
    _atomic(path, lambda tmp: save_file(storable, str(tmp), metadata=metadata))
    return {"file": path.name, "sha256": _sha256(path), "bytes": path.stat().st_size}


def begin_save(ckpt_dir: str | Path, *, step: int, num_layers: int, generation: int = 0) -> Path:
    """Write `saving.json` into the step directory before any layer file: what the save will
    write, so that the directory, if the save is interrupted, says how far it got."""
    path = step_dir(ckpt_dir, step) / SAVING
    blob = json.dumps({"step": int(step), "num_layers": int(num_layers), "generation": int(generation)}).encode()
    _atomic(path, lambda tmp: tmp.write_bytes(blob))
    return path


def write_manifest(
    ckpt_dir: str | Path,
    *,
    step: int,
    data_cursor: dict[str, Any],
    plan: dict[str, Any] | None,
    config: dict[str, Any],
    layers: list[dict[str, Any]],
    layer_names: list[str],
    hf_names: list[dict[str, str]],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `manifest.json` (last, atomically) after checking every layer file is in place."""
    sdir = step_dir(ckpt_dir, step)
    if not len(layers) == len(layer_names) == len(hf_names):
        raise ValueError(
            f"write_manifest: {len(layers)} layer entries, {len(layer_names)} "
            f"layer_names and {len(hf_names)} hf_names; give one per layer"
        )
    for i, entry in enumerate(layers):
        if entry is None or not {"file", "sha256", "bytes"} <= set(entry):
            raise ValueError(
                f"write_manifest: layer {i} entry {entry!r} lacks file/sha256/bytes (pass the dict save_layer returned)"
            )
        f = sdir / entry["file"]
        if not f.is_file() or f.stat().st_size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint file {f} is missing or has the wrong size; save "
                f"layer {i} before writing the manifest of step {step}"
            )
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "step": int(step),
        "created_unix": time.time(),
        "num_layers": len(layers),
        "data_cursor": data_cursor,
        "plan": plan,
        "config": config,
        "layer_names": list(layer_names),
        "hf_names": [dict(h) for h in hf_names],
        "layers": [{"file": e["file"], "sha256": e["sha256"], "bytes": int(e["bytes"])} for e in layers],
        "extra": extra or {},
    }
    blob = json.dumps(manifest, indent=1, sort_keys=True).encode()
    path = sdir / MANIFEST
    _atomic(path, lambda tmp: tmp.write_bytes(blob))
    return path


# ----------------------------------------------------------------------------- read


def _manifest_path(path: str | Path) -> Path:
    p = Path(path)
    return p / MANIFEST if p.is_dir() or p.name != MANIFEST else p


def read_manifest(path: str | Path) -> dict[str, Any]:
    """Parse and validate the manifest of a step directory (or the manifest file itself)."""
    mpath = _manifest_path(path)
    hint = _FALLBACK.format(dir=mpath.parent.name)

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint manifest {mpath} is malformed: {what}; {hint}")

    if not mpath.is_file():
        raise CheckpointError(
            f"checkpoint manifest {mpath} does not exist: the checkpoint "
            f"is incomplete (its save was interrupted); {hint}"
        )
    try:
        data = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad(f"not JSON ({err})") from None
    if not isinstance(data, dict):
        raise bad("not a JSON object")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise bad(f"schema_version {data.get('schema_version')!r} is not {SCHEMA_VERSION}")
    for key, typ in (
        ("step", int),
        ("layers", list),
        ("layer_names", list),
        ("hf_names", list),
        ("data_cursor", dict),
        ("config", dict),
    ):
        if not isinstance(data.get(key), typ):
            raise bad(f"key '{key}' is missing or not a {typ.__name__}")
    n = len(data["layers"])
    if len(data["layer_names"]) != n or len(data["hf_names"]) != n:
        raise bad(f"{n} layers but {len(data['layer_names'])} layer_names and {len(data['hf_names'])} hf_names")
    for i, e in enumerate(data["layers"]):
        if not (
            isinstance(e, dict)
            and isinstance(e.get("file"), str)
            and isinstance(e.get("sha256"), str)
            and isinstance(e.get("bytes"), int)
            and "/" not in e["file"]
            and ".." not in e["file"]
        ):
            raise bad(f"layers[{i}] is not {{file, sha256, bytes}}: {e!r}")
    return data


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


def _checked_file(sdir: Path, manifest: dict[str, Any], layer: int, *, verify: bool) -> Path:
    """The file of `layer`, after checking that it exists and (`verify`) its size and sha256."""
    hint = _FALLBACK.format(dir=sdir.name)
    entry = manifest["layers"][layer]
    path = sdir / entry["file"]
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing; {hint}")
    if verify:
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint file {path} is corrupt: truncated or resized "
                f"(expected {entry['bytes']} bytes, got {size}); {hint}"
            )
        digest = _sha256(path)
        if digest != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint file {path} is corrupt: sha256 mismatch (expected "
                f"{entry['sha256'][:12]}…, got {digest[:12]}…); {hint}"
            )
    return path


def verify_checkpoint(step_dir: str | Path) -> dict[str, Any]:
    """The manifest of a step directory after checking EVERY layer file against it (size and
    sha256), so that a resume restores all of a checkpoint or nothing. Raises CheckpointError
    naming the first bad file."""
    sdir = Path(step_dir)
    manifest = read_manifest(sdir)
    for layer in range(len(manifest["layers"])):
        _checked_file(sdir, manifest, layer, verify=True)
    return manifest


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
    _fsync_dir(sdir.parent)
    return target


def load_layer(
    step_dir: str | Path,
    layer: int,
    *,
    verify: bool = True,
    manifest: dict[str, Any] | None = None,
    device: str = "cpu",
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """(params, optimizer_state) of one layer; checks size and sha256 first when `verify`."""
    sdir = Path(step_dir)
    manifest = manifest if manifest is not None else read_manifest(sdir)
    hint = _FALLBACK.format(dir=sdir.name)
    if not 0 <= layer < len(manifest["layers"]):
        raise CheckpointError(f"checkpoint {sdir} has layers 0..{len(manifest['layers']) - 1}, not layer {layer}")
    path = _checked_file(sdir, manifest, layer, verify=verify)
    try:
        with safe_open(str(path), "pt", device=device) as fh:
            meta = fh.metadata() or {}
            tensors = {key: fh.get_tensor(key) for key in fh.keys()}
        scalars = json.loads(meta.get("scalars", "{}"))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {err}; {hint}") from None
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        kind, _, rest = key.partition(".")
        if kind == "param":
            params[rest] = t
        elif kind == "optim":
            name, _, skey = rest.rpartition(".")
            cast = {"int": int, "float": float, "bool": bool}.get(scalars.get(key, ""))
            optim.setdefault(name, {})[skey] = cast(t.item()) if cast else t
        else:
            raise CheckpointError(f"checkpoint file {path} has an unexpected tensor '{key}'; {hint}")
    return params, optim


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


def prune_checkpoints(ckpt_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints, and incomplete step directories
    older than the newest complete one (newer ones may still be being written)."""
    if keep < 1:
        raise ValueError(f"prune_checkpoints: keep must be >= 1 (got {keep})")
    dirs = list_checkpoints(ckpt_dir)
    complete = [d for d in dirs if is_complete(d)]
    if not complete:
        return []
    latest = complete[-1]
    keep_set = set(complete[-keep:])
    removed = []
    for d in dirs:
        if d in keep_set or _step(d) > _step(latest):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


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
