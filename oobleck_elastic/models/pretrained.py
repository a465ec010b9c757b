"""Pretrained Hugging Face weights, read per layer: a worker reads only the tensors of its layers.

The whole model is never in one process's memory; a `model.*` field that disagrees with the
directory's config.json is an error naming the field. The story: docs/training.md.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import safe_open
from torch import nn

from ..config import ModelConfig
from .hf import EMBED_NAME, HF_FAMILIES, assemble, check_owned
from .layers import LayerModel, RopeDecoderLayer, check_attn_implementation

__all__ = [
    "WEIGHTS_FILE",
    "INDEX_FILE",
    "pretrained_dir",
    "pretrained_config",
    "is_tied",
    "WeightReader",
    "build_pretrained",
]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_BASE_PREFIX = {"gpt2": "transformer."}  # the other families: "model."


def pretrained_dir(pretrained_path: str | Path) -> Path:
    """The local Hugging Face directory named by `model.pretrained_path`; it must hold config.json."""
    path = Path(str(pretrained_path)).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.pretrained_path '{path}' "
            + ("has no config.json" if path.is_dir() else "does not exist")
            + ": give a local directory written by save_pretrained (config.json + *.safetensors); "
            "hub downloads are disabled"
        )
    return path


def is_tied(config: Any) -> bool:
    """Whether the checkpoint's head shares the embedding (`tie_word_embeddings`, default True)."""
    return bool(getattr(config, "tie_word_embeddings", True))


def _defaults() -> dict[str, Any]:
    return {f.name: f.default for f in fields(ModelConfig)}


def _directory_values(config: Any) -> dict[str, Any]:
    """The directory's value of each checked ModelConfig field."""
    gpt2 = config.model_type == "gpt2"
    heads = config.num_attention_heads
    inter = (config.n_inner or 4 * config.hidden_size) if gpt2 else getattr(config, "intermediate_size", None)
    return {
        "num_layers": ("num_hidden_layers", config.num_hidden_layers),
        "hidden_size": ("hidden_size", config.hidden_size),
        "num_heads": ("num_attention_heads", heads),
        "num_kv_heads": (
            "num_key_value_heads",
            heads if gpt2 else getattr(config, "num_key_value_heads", None) or heads,
        ),
        "intermediate_size": ("n_inner" if gpt2 else "intermediate_size", inter),
        "vocab_size": ("vocab_size", config.vocab_size),
    }


def _check_agreement(cfg: ModelConfig, config: Any, path: Path) -> None:
    """Raise ValueError on the first `model.*` field set against config.json (docs/training.md)."""
    default = _defaults()
    where = f"model.pretrained_path '{path}'"
    model_type = config.model_type
    if cfg.family != default["family"] and cfg.family != model_type:
        raise ValueError(
            f"{where} holds a {model_type} model but model.family is {cfg.family}: set model.family={model_type}"
        )
    for name, (hf_key, theirs) in _directory_values(config).items():
        mine = getattr(cfg, name)
        if mine is not None and mine != default[name] and mine != theirs:
            raise ValueError(
                f"{where} has {hf_key}={theirs} in config.json but model.{name} is "
                f"{mine}: set model.{name}={theirs} or leave it unset"
            )
    if not cfg.tie_embeddings and is_tied(config):
        raise ValueError(
            f"{where} has tie_word_embeddings=true in config.json but "
            "model.tie_embeddings is false: set model.tie_embeddings=true or leave "
            "it unset"
        )
    if model_type == "gpt2" and cfg.max_seq_len != default["max_seq_len"] and cfg.max_seq_len > config.n_positions:
        raise ValueError(
            f"{where} has n_positions={config.n_positions} in config.json (GPT-2's "
            f"longest sequence) but model.max_seq_len is {cfg.max_seq_len}: set "
            f"model.max_seq_len (and data.seq_len) to at most {config.n_positions}"
        )


def pretrained_config(cfg: ModelConfig) -> Any:
    """The Hugging Face config in `cfg.pretrained_path`, checked against `cfg`, with
    `use_cache=False` and `_attn_implementation = cfg.attn_implementation`."""
    from transformers import AutoConfig

    path = pretrained_dir(cfg.pretrained_path or "")
    check_attn_implementation(cfg.attn_implementation)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    if config.model_type not in HF_FAMILIES:
        raise ValueError(
            f"model.pretrained_path '{path}' holds a {config.model_type} model; flat "
            f"layers exist for {', '.join(HF_FAMILIES)} (use model.family=custom for "
            "others)"
        )
    _check_agreement(cfg, config, path)
    config.use_cache = False
    config._attn_implementation = cfg.attn_implementation
    return config


def _safe_device(device: torch.device) -> str:
    """The device string safe_open reads onto ('cpu' for kinds it does not know)."""
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return str(device) if device.type in ("cpu", "mps") else "cpu"


class WeightReader:
    """Reads named tensors of a safetensors Hugging Face directory, one at a time.

    `read(keys)` opens each needed file once (only its header and the requested tensors are
    read) and returns the tensors converted to `dtype` on `device`. Errors name the file and key.
    """

    def __init__(
        self, path: Path, *, family: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = torch.float32
    ) -> None:
        self.path, self.dtype = path, dtype
        self.device = torch.device(device)
        self.base = _BASE_PREFIX.get(family, "model.")
        self._where = f"model.pretrained_path '{path}'"
        index = path / INDEX_FILE
        if index.is_file():
            try:
                data = json.loads(index.read_text())
                self.weight_map: dict[str, str] = dict(data["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise ValueError(
                    f"{self._where}: {INDEX_FILE} is not a safetensors index "
                    f"({type(err).__name__}: {err}): rewrite the directory with "
                    "save_pretrained"
                ) from None
            self.listing = INDEX_FILE
        elif (path / WEIGHTS_FILE).is_file():
            with safe_open(str(path / WEIGHTS_FILE), framework="pt", device="cpu") as fh:
                self.weight_map = {key: WEIGHTS_FILE for key in fh.keys()}
            self.listing = WEIGHTS_FILE
        else:
            raise FileNotFoundError(
                f"{self._where} has neither {WEIGHTS_FILE} nor {INDEX_FILE}: "
                "save the model with save_pretrained (safetensors; "
                "pytorch_model.bin is not read)"
            )

    def locate(self, key: str) -> tuple[str, str]:
        """(file, stored name) of a Hugging Face tensor name; tries it without the base prefix."""
        candidates = [key] + ([key[len(self.base) :]] if key.startswith(self.base) else [])
        for name in candidates:
            if name in self.weight_map:
                return self.weight_map[name], name
        raise ValueError(
            f"{self._where}: tensor '{key}' is not in {self.listing}: the directory "
            "does not hold this model's weights; rewrite it with save_pretrained"
        )

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors of `keys` (Hugging Face names), converted to dtype on device."""
        by_file: dict[str, list[tuple[str, str]]] = {}
        for key in dict.fromkeys(keys):
            file, stored = self.locate(key)
            by_file.setdefault(file, []).append((key, stored))
        out: dict[str, torch.Tensor] = {}
        for file, wanted in by_file.items():
            fpath = self.path / file
            if not fpath.is_file():
                raise FileNotFoundError(
                    f"{self._where}: shard {file} does not exist ({INDEX_FILE} "
                    f"lists '{wanted[0][0]}' in it): copy the complete directory"
                )
            with safe_open(str(fpath), framework="pt", device=_safe_device(self.device)) as fh:
                present = set(fh.keys())
                for key, stored in wanted:
                    if stored not in present:
                        raise ValueError(
                            f"{self._where}: tensor '{stored}' is not in {file} "
                            f"although {INDEX_FILE} lists it there: rewrite the "
                            "directory with save_pretrained"
                        )
                    t = fh.get_tensor(stored)
                    out[key] = t.to(device=self.device, dtype=self.dtype or t.dtype)
        return out


def _set_tensor(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put `value` in place of the (meta) parameter or buffer `name` of `layer`."""
    mod_name, _, leaf = name.rpartition(".")
    module = layer.get_submodule(mod_name)
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(value, requires_grad=old is None or old.requires_grad)
    else:
        module._buffers[leaf] = value


def _persistent_buffers(layer: nn.Module, prefixes: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """(local -> HF name of persistent buffers, names of non-persistent buffers)."""
    persistent, computed = {}, []
    for mod_name, module in layer.named_modules():
        for leaf in module._buffers:
            name = f"{mod_name}.{leaf}" if mod_name else leaf
            if leaf in module._non_persistent_buffers_set:
                computed.append(name)
            else:
                head, _, rest = name.partition(".")
                persistent[name] = f"{prefixes[head]}.{rest}"
    return persistent, computed


def _check_shapes(
    layer: nn.Module, tensors: dict[str, torch.Tensor], names: dict[str, str], reader: WeightReader, vocab: int
) -> None:
    """Every tensor has the shape config.json implies (`vocab` rows for the embedding and head:
    the layer's own rows may be padded beyond it, `models.vocab`)."""
    from .vocab import is_vocab_param

    expected = dict(layer.named_parameters()) | dict(layer.named_buffers())
    for local, key in names.items():
        want, got = tuple(expected[local].shape), tuple(tensors[key].shape)
        if is_vocab_param(local):
            want = (vocab, *want[1:])
        if want != got:
            file, stored = reader.locate(key)
            raise ValueError(
                f"model.pretrained_path '{reader.path}': tensor '{stored}' in {file} "
                f"has shape {list(got)} but config.json implies {list(want)}: the "
                "weights do not belong to this config.json"
            )


def build_pretrained(
    cfg: ModelConfig,
    *,
    owned: Iterable[int] | None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    empty: Iterable[int] = (),
) -> LayerModel:
    """The layers of `owned` (None = all) read from `cfg.pretrained_path`; the others are None.

    Only the owned layers' tensors are read (docs/training.md), in `dtype` on `device`;
    owned layers also in `empty` are only allocated (their values come from a peer or a checkpoint).
    """
    from .vocab import is_vocab_param, pad_rows, padded_vocab_size

    config = pretrained_config(cfg)
    path = pretrained_dir(cfg.pretrained_path or "")
    family, n = config.model_type, config.num_hidden_layers + 2
    tied = is_tied(config)
    emb_name = EMBED_NAME.get(family, "embed_tokens.weight")
    reader = WeightReader(path, family=family, device=device, dtype=dtype)
    keep = check_owned(owned, n)
    blank = set(empty)
    rows = padded_vocab_size(config.vocab_size, cfg.pad_vocab_to)

    def read(i: int, layer: nn.Module, prefixes: dict[str, str], hf_names: list[dict[str, str]]) -> None:
        if i in blank:
            layer.to_empty(device=device)
            return
        names = dict(hf_names[i])
        if tied and i == n - 1:
            if 0 in keep:
                del names["lm_head.weight"]  # becomes layer 0's Parameter (assemble reties)
            else:
                names["lm_head.weight"] = hf_names[0][emb_name]
        buffers, computed = _persistent_buffers(layer, prefixes)
        names.update(buffers)
        tensors = reader.read(names.values())
        _check_shapes(layer, tensors, names, reader, config.vocab_size)
        for local, key in names.items():  # zero rows up to the padded vocabulary (models/vocab.py)
            if is_vocab_param(local):
                tensors[key] = pad_rows(tensors[key], rows)
        for local, key in names.items():
            _set_tensor(layer, local, tensors[key])
        if computed and not isinstance(layer, RopeDecoderLayer):
            raise RuntimeError(
                f"layer {i} of the {family} model has non-persistent buffers "
                f"{computed} that per-layer loading cannot compute; this "
                "transformers version is not supported for model.pretrained_path"
            )

    model = assemble(family, config, keep=keep, tied=tied, device=device, fill=read, vocab_rows=rows)
    layers = model.layers
    for i, layer in enumerate(layers):
        if layer is None:
            continue
        left = [
            name
            for name, t in [
                *layer.named_parameters(remove_duplicate=False),
                *layer.named_buffers(remove_duplicate=False),
            ]
            if t.is_meta
        ]
        if left:
            raise RuntimeError(f"layer {i} still has meta tensors {left} after loading model.pretrained_path '{path}'")
    return model
