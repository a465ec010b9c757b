"""Export a checkpoint as a Hugging Face model directory, one layer at a time (`oobleck export`).

The config is checked against the stored tensors before anything is written; at most one shard
plus one layer are in memory; shards are renamed into place at the end. The story:
docs/training.md.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors.torch import save_file

from .. import checkpoint as ckpt
from ..config import ConfigError, JobConfig, ModelConfig, from_dict
from .export_checks import checkpoint_values, override_conflict, shape_mismatch, stored_shapes
from .export_tokenizer import (
    SpecialTokens,
    choose_tokenizer,
    has_tokenizer_files,
    load_tokenizer,
    special_tokens,
)
from .hf import meta_layer
from .pretrained import INDEX_FILE, WEIGHTS_FILE, is_tied, pretrained_config

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "DTYPES",
    "parse_size",
    "resolve_checkpoint",
    "export_config",
    "export_checkpoint",
]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
_CAUSAL_LM = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
GENERATION_FILE = "generation_config.json"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
_PARTIAL = ".export-shard-"


def parse_size(text: str | int) -> int:
    """Bytes from `123`, `20KB`, `500MB`, `5GB` (powers of 10) or `KiB`/`MiB`/`GiB` (of 2)."""
    if isinstance(text, int):
        value = text
    else:
        s = text.strip().upper()
        unit = next((u for u in _UNITS if s.endswith(u)), "")
        number = s[: len(s) - len(unit)].strip()
        if not number.isdigit():
            raise ValueError(
                f"shard size '{text}' is not a size: give bytes or a number with "
                "KB, MB, GB (or KiB, MiB, GiB), e.g. 5GB"
            )
        value = int(number) * _UNITS.get(unit, 1)
    if value < 1:
        raise ValueError(f"shard size {text!r} must be at least 1 byte")
    return value


def _human(n: int) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def resolve_checkpoint(path: str | Path) -> tuple[Path, str | None]:
    """(step directory, a note saying which one was chosen, or None when `path` is one); with no
    intact checkpoint, an error naming each partial or damaged one (`checkpoint.find_checkpoint`)."""
    return ckpt.find_checkpoint(path)


def _job_config(manifest: dict[str, Any], sdir: Path, overrides: Sequence[str]) -> JobConfig:
    from omegaconf import OmegaConf

    data = manifest["config"]
    if not isinstance(data.get("model"), dict):
        raise ckpt.CheckpointError(
            f"checkpoint {sdir}: {ckpt.MANIFEST} records no model config "
            "(key config.model): it was not written by an oobleck job"
        )
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override '{bad[0]}' is not of the form key=value (e.g. model.pretrained_path=/data/llama)")
    if overrides:
        merged = OmegaConf.merge(OmegaConf.create(data), OmegaConf.from_dotlist(list(overrides)))
        data = OmegaConf.to_container(merged)
    return from_dict(data)


def export_config(model: ModelConfig, sdir: Path) -> Any:
    """The Hugging Face config of the model a checkpoint was trained as."""
    from .hf import hf_config

    if model.family == "custom":
        raise ValueError(
            f"checkpoint {sdir} is of a model.family=custom model, which has no "
            "Hugging Face form; read its layers with checkpoint.load_layer"
        )
    if not model.pretrained_path:
        return hf_config(model)
    try:
        return pretrained_config(model)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"{err}; the checkpoint was trained from it and its config.json is needed: pass model.pretrained_path=DIR"
        ) from None


def _write_generation_config(config: Any, pretrained: str | None, special: SpecialTokens | None, out: Path) -> None:
    """The pretrained directory's generation_config.json when its eos agrees with the tokenizer's
    (or no tokenizer is known), else one derived from config.json."""
    from transformers import GenerationConfig

    src = Path(pretrained).expanduser() / GENERATION_FILE if pretrained else None
    if src is not None and src.is_file():
        eos = json.loads(src.read_text()).get("eos_token_id")
        if special is None or special.eos == eos or (isinstance(eos, list) and special.eos in eos):
            shutil.copy2(src, out / GENERATION_FILE)
            return
    GenerationConfig.from_model_config(config).save_pretrained(str(out))


def _tokenizer_line(source: Any, special: SpecialTokens | None) -> str:
    if source.kind == "none":
        return f"tokenizer: none ({source.origin}); AutoTokenizer cannot load this directory"
    ids = "" if special is None else f", bos={special.bos} eos={special.eos} pad={special.pad}"
    return f"tokenizer: {source.kind} from {source.origin}{ids}"


def _digest(t: torch.Tensor) -> str:
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output '{out}' exists and is not a directory: choose a new directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise FileExistsError(
                f"output directory '{out}' exists and is not empty: choose a new "
                "directory or pass --force to replace its model files"
            )
        for f in out.iterdir():
            if f.is_file() and (
                f.name in (WEIGHTS_FILE, INDEX_FILE, "config.json", GENERATION_FILE, *_TOKENIZER_FILES)
                or f.name.startswith(_PARTIAL)
                or (f.name.startswith("model-") and f.name.endswith(".safetensors"))
            ):
                f.unlink()
    out.mkdir(parents=True, exist_ok=True)


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    force: bool = False,
    overrides: Sequence[str] = (),
    tokenizer: str | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Write the checkpoint at `checkpoint` as a Hugging Face directory `out_dir`; returns it.

    `dtype` None keeps the stored dtype (fp32). `tokenizer`: a tokenizers JSON file or a
    save_pretrained directory to export instead of the job's, or "none". See the module
    docstring for the mechanism.
    """
    sdir, note = resolve_checkpoint(checkpoint)
    if note:
        log(f"exporting {note}")
    manifest = ckpt.read_manifest(sdir)
    job = _job_config(manifest, sdir, overrides)
    model = job.model
    shapes = stored_shapes(sdir, manifest)
    values = checkpoint_values(
        shapes, manifest["hf_names"], num_heads=None if model.pretrained_path else model.num_heads
    )
    conflict = override_conflict(overrides, model, manifest["config"].get("model", {}), values, str(sdir))
    if conflict:
        raise ConfigError(conflict)
    config = export_config(model, sdir)
    family, n = config.model_type, len(manifest["layers"])
    if n != config.num_hidden_layers + 2:
        raise ckpt.CheckpointError(
            f"checkpoint {sdir} has {n} layers but its config has {config.num_hidden_layers} "
            f"blocks ({config.num_hidden_layers + 2} layers): set model.num_layers="
            f"{n - 2} or export the checkpoint of this model"
        )
    expected = [
        {k: tuple(p.shape) for k, p in meta_layer(family, config, i, n)[0].named_parameters()} for i in range(n)
    ]
    mismatch = shape_mismatch(shapes, expected, manifest["layer_names"], str(sdir))
    if mismatch:
        raise ckpt.CheckpointError(mismatch)
    source = choose_tokenizer(
        tokenizer,
        manifest.get("extra", {}).get("tokenizer"),
        data_source=job.data.source,
        data_tokenizer=job.data.tokenizer,
        tokenizer_path=job.data.tokenizer_path,
        pretrained_path=model.pretrained_path,
        pretrained_has_tokenizer=has_tokenizer_files(model.pretrained_path),
        step_dir=sdir,
    )
    tok = load_tokenizer(source, config.vocab_size)
    special = special_tokens(tok) if source.kind in ("bpe", "hf") else None
    if source.kind == "bytes":
        special = SpecialTokens(bos=None, eos=None, pad=None)
    out = Path(out_dir).expanduser()
    _prepare_out(out, force)
    tied = is_tied(config)
    names, hf_names = manifest["layer_names"], manifest["hf_names"]
    emb_key = next((k for k in hf_names[0].values() if k.endswith(("wte.weight", "embed_tokens.weight"))), None)
    shards: list[tuple[Path, list[str], int]] = []
    current: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {"bytes": 0, "total": 0, "params": 0, "dtype": None}
    seen: set[str] = set()
    emb_digest = None

    def flush() -> None:
        if not current:
            return
        tmp = out / f"{_PARTIAL}{len(shards) + 1:05d}.safetensors"
        save_file(current, str(tmp), metadata={"format": "pt"})
        shards.append((tmp, list(current), state["bytes"]))
        current.clear()
        state["bytes"] = 0

    try:
        for i in range(n):
            params, _ = ckpt.load_layer(sdir, i, manifest=manifest)
            count = size = 0
            for local in sorted(params):
                key = hf_names[i].get(local)
                if key is None:
                    raise ckpt.CheckpointError(
                        f"checkpoint {sdir}: parameter '{local}' of layer "
                        f"{i} ({names[i]}) has no Hugging Face name in "
                        f"{ckpt.MANIFEST}"
                    )
                t = params[local]
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                if t.is_floating_point() and state["dtype"] is None:
                    state["dtype"] = t.dtype
                if tied and key == emb_key:
                    emb_digest = _digest(t)
                if tied and key == "lm_head.weight" and emb_key is not None:
                    if emb_digest is not None and _digest(t) != emb_digest:
                        raise ckpt.CheckpointError(
                            f"checkpoint {sdir}: lm_head.weight of layer {i} differs from the "
                            f"tied embedding {emb_key}: the checkpoint is inconsistent"
                        )
                    continue  # tied: written once, as the embedding
                if key in seen:
                    raise ckpt.CheckpointError(
                        f"checkpoint {sdir}: Hugging Face name '{key}' appears twice in {ckpt.MANIFEST}"
                    )
                seen.add(key)
                nbytes = t.numel() * t.element_size()
                if current and state["bytes"] + nbytes > max_shard_bytes:
                    flush()
                current[key] = t.contiguous()
                state["bytes"] += nbytes
                state["total"] += nbytes
                state["params"] += t.numel()
                count, size = count + 1, size + nbytes
            del params
            log(f"layer {i + 1}/{n} {names[i]}: {count} tensor(s), {_human(size)}")
        flush()
        weight_map: dict[str, str] = {}
        if len(shards) == 1:
            shards[0][0].replace(out / WEIGHTS_FILE)
        else:
            for k, (tmp, keys, _) in enumerate(shards, 1):
                final = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                tmp.replace(out / final)
                weight_map.update({key: final for key in keys})
            index = {
                "metadata": {"total_size": state["total"], "total_parameters": state["params"]},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    except BaseException:
        for tmp, _, _ in shards:
            tmp.unlink(missing_ok=True)
        raise
    config.use_cache = True
    config.architectures = [_CAUSAL_LM[family]]
    config.tie_word_embeddings = tied
    config.dtype = state["dtype"] or torch.float32
    if special is not None:
        config.bos_token_id, config.eos_token_id, config.pad_token_id = special.bos, special.eos, special.pad
    config.save_pretrained(str(out))
    _write_generation_config(config, model.pretrained_path, special, out)
    if tok is not None:
        tok.save_pretrained(str(out))
    log(_tokenizer_line(source, special))
    log(
        f"exported step {manifest['step']} to {out}: {len(shards)} shard(s), "
        f"{_human(state['total'])}; load it with "
        f"transformers.AutoModelForCausalLM.from_pretrained('{out}')"
    )
    return out
