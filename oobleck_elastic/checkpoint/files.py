"""One checkpoint's files: per-layer safetensors, the manifest, atomic writes, verified reads.

This module writes and reads the files of one step directory; `checkpoint.directory` finds step
directories under a checkpoint root. The layout, the atomic writes and the manifest:
docs/recovery.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
SAVING = "saving.json"
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


def fsync_dir(path: Path) -> None:
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
    fsync_dir(path.parent)


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
