"""What `oobleck export` checks before it writes anything: the model config against the tensors.

A mismatch between the Hugging Face config the export would write and the checkpoint's tensors is
an error naming the field, found before any file is written. The story: docs/training.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from safetensors import SafetensorError, safe_open

from .. import checkpoint as ckpt
from ..config import ModelConfig

__all__ = ["RECORDED_KEYS", "stored_shapes", "checkpoint_values", "override_conflict", "shape_mismatch"]

Shape = tuple[int, ...]

RECORDED_KEYS = ("family", "num_heads")
"""model.* keys no tensor shape shows but the weights depend on: compared with the recorded config."""

_PARAM = "param."  # a layer file's parameter keys (checkpoint/files.py)


def stored_shapes(sdir: Path, manifest: dict[str, Any]) -> list[dict[str, Shape]]:
    """Per layer, each stored parameter's local name -> shape, from the files' headers."""
    out = []
    for i, entry in enumerate(manifest["layers"]):
        path = sdir / entry["file"]
        try:
            with safe_open(str(path), "pt") as fh:
                shapes = {
                    k[len(_PARAM) :]: tuple(fh.get_slice(k).get_shape()) for k in fh.keys() if k.startswith(_PARAM)
                }
        except (SafetensorError, OSError) as err:
            ckpt.load_layer(sdir, i, manifest=manifest)  # names a missing, resized or altered file
            raise ckpt.CheckpointError(f"checkpoint file {path} is corrupt: {err}") from None
        out.append(shapes)
    return out


def checkpoint_values(
    shapes: Sequence[Mapping[str, Shape]],
    hf_names: Sequence[Mapping[str, str]],
    *,
    num_heads: Optional[int] = None,
) -> dict[str, tuple[int, str]]:
    """model.* key -> (its value in the checkpoint, what shows it), from the stored shapes."""
    by_hf: dict[str, Shape] = {}
    for layer, names in zip(shapes, hf_names):
        by_hf.update({names[local]: shape for local, shape in layer.items() if local in names})
    found: dict[str, tuple[int, str]] = {"num_layers": (len(shapes) - 2, f"it has {len(shapes)} layers")}
    emb = next((s for k, s in by_hf.items() if k.endswith(("wte.weight", "embed_tokens.weight"))), None)
    if emb is not None and len(emb) == 2:
        found["vocab_size"] = (emb[0], f"its embedding has {emb[0]} rows")
        found["hidden_size"] = (emb[1], f"its embedding has {emb[1]} columns")
    wpe = by_hf.get("transformer.wpe.weight")
    if wpe is not None:
        found["max_seq_len"] = (wpe[0], f"its position embedding has {wpe[0]} rows")
    if (fc := by_hf.get("transformer.h.0.mlp.c_fc.weight")) is not None:
        found["intermediate_size"] = (fc[1], f"its MLP is {fc[1]} wide")
    if (gate := by_hf.get("model.layers.0.mlp.gate_proj.weight")) is not None:
        found["intermediate_size"] = (gate[0], f"its MLP is {gate[0]} wide")
    k_proj = by_hf.get("model.layers.0.self_attn.k_proj.weight")
    if k_proj is not None and emb is not None and num_heads and emb[1] % num_heads == 0:
        head_dim = emb[1] // num_heads
        if k_proj[0] % head_dim == 0:
            kv = k_proj[0] // head_dim
            found["num_kv_heads"] = (kv, f"its key projection has {k_proj[0]} rows ({kv} heads of {head_dim})")
    return found


def _effective(model: ModelConfig, key: str) -> Any:
    if key == "intermediate_size":
        return model.intermediate_size or 4 * model.hidden_size
    if key == "num_kv_heads":
        return model.num_kv_heads or model.num_heads
    return getattr(model, key)


def override_conflict(
    overrides: Sequence[str],
    model: ModelConfig,
    recorded: Mapping[str, Any],
    values: Mapping[str, tuple[int, str]],
    where: str,
) -> Optional[str]:
    """The message refusing the first model.* override that contradicts the checkpoint, or None.

    `model` is the config with the overrides applied, `recorded` the model section recorded in
    the checkpoint, `values` what `checkpoint_values` found, `where` the checkpoint's directory.
    """
    for override in overrides:
        key, _, raw = override.partition("=")
        section, _, name = key.strip().partition(".")
        if section != "model":
            continue
        if name in values:
            value, shown = values[name]
            if _effective(model, name) != value:
                return (
                    f"override {key.strip()}={raw} contradicts checkpoint {where}: {shown} "
                    f"(model.{name}={value}); drop the override"
                )
        elif name in RECORDED_KEYS and name in recorded and getattr(model, name) != recorded[name]:
            return (
                f"override {key.strip()}={raw} contradicts checkpoint {where}: it was trained with "
                f"model.{name}={recorded[name]}; drop the override"
            )
    return None


def shape_mismatch(
    stored: Sequence[Mapping[str, Shape]],
    expected: Sequence[Mapping[str, Shape]],
    layer_names: Sequence[str],
    where: str,
) -> Optional[str]:
    """The first difference between the stored parameters and the config's layers, or None."""
    hint = "export it with the model config it was trained with"
    for i, (have, want) in enumerate(zip(stored, expected)):
        if have.keys() != want.keys():
            extra, missing = sorted(have.keys() - want.keys()), sorted(want.keys() - have.keys())
            return (
                f"checkpoint {where}: layer {i} ({layer_names[i]}) stores parameters {extra} but the config's "
                f"layer has {missing} instead: {hint}"
            )
        for name in sorted(have):
            if tuple(have[name]) != tuple(want[name]):
                return (
                    f"checkpoint {where}: parameter '{name}' of layer {i} ({layer_names[i]}) has shape "
                    f"{list(have[name])} but the config gives {list(want[name])}: {hint}"
                )
    return None
