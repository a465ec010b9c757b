"""Build the flat layer list of a model, per layer, deterministically.

Invariant: layer i depends only on (seed, i), so workers with different stage splits hold
bit-identical copies and each builds only the layers it owns. The story: docs/training.md.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import math
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..config import ModelConfig
from .layers import (
    GPT2BlockLayer,
    GPT2Embedding,
    LayerModel,
    LMHead,
    RopeDecoderLayer,
    TokenEmbedding,
)
from .hf import (
    HF_FAMILIES,
    EMBED_NAME,
    ROPE_PREFIX,
    assemble,
    check_owned,
    hf_config,
    layer_hf_names,
    layer_names,
    meta_layer,
    modeling,
)
from .pretrained import build_pretrained, pretrained_config
from .ties import find_tied_parameters
from .vocab import is_vocab_param, padded_vocab_size

__all__ = [
    "HF_FAMILIES",
    "stable_seed",
    "hf_config",
    "flatten_hf_model",
    "build_layer_model",
    "build_meta_layers",
    "layers_from_modules",
    "num_layers",
    "LayerModel",
]

_RESIDUAL_OUT = ("c_proj.weight", "o_proj.weight", "down_proj.weight")


def stable_seed(seed: int, *parts: Any) -> int:
    """A 63-bit seed derived from (seed, *parts) with sha256; stable across processes and runs."""
    blob = "/".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "big") & (2**63 - 1)


# ----------------------------------------------------------------------------- flatten


_CAUSAL_LM = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def _family_of(model: nn.Module) -> str:
    for family, cls_name in _CAUSAL_LM.items():
        if isinstance(model, getattr(modeling(family), cls_name)):
            return family
    raise TypeError(
        f"flatten_hf_model supports {', '.join(_CAUSAL_LM.values())}, not "
        f"{type(model).__name__}; wrap other models' layers yourself and use "
        "layers_from_modules(...) (or model.family=custom)"
    )


def flatten_hf_model(model: nn.Module) -> LayerModel:
    """The flat layers of a Hugging Face causal LM, reusing its modules (ties stay shared)."""
    family = _family_of(model)
    hf: Any = model  # transformers models expose their children as dynamic attributes
    if family == "gpt2":
        t = hf.transformer
        layers: list[nn.Module] = [GPT2Embedding(t.wte, t.wpe, t.drop)]
        prefixes = [{"wte": "transformer.wte", "wpe": "transformer.wpe"}]
        for i, block in enumerate(t.h):
            layers.append(GPT2BlockLayer(block))
            prefixes.append({"block": f"transformer.h.{i}"})
        layers.append(LMHead(t.ln_f, hf.lm_head))
        prefixes.append({"norm": "transformer.ln_f", "lm_head": "lm_head"})
    else:
        m = hf.model
        layers = [TokenEmbedding(m.embed_tokens)]
        prefixes = [{"embed_tokens": "model.embed_tokens"}]
        for i, layer in enumerate(m.layers):
            layers.append(RopeDecoderLayer(layer, m.rotary_emb))
            prefixes.append({"layer": f"model.layers.{i}"})
        layers.append(LMHead(m.norm, hf.lm_head))
        prefixes.append({"norm": "model.norm", "lm_head": "lm_head"})
    return LayerModel(
        layers=list(layers),
        names=layer_names(len(layers) - 2),
        hf_names=[layer_hf_names(m, p) for m, p in zip(layers, prefixes)],
        tied=find_tied_parameters(layers),
        hf_config=model.config,
    )


# ----------------------------------------------------------------------------- build


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


@torch.no_grad()
def _init_parameters(
    layer: nn.Module,
    *,
    seed: int,
    index: int,
    std: float,
    n_blocks: int,
    seed_keys: dict[str, tuple[int, str]],
    skip: frozenset[str] = frozenset(),
    vocab_size: int | None = None,
) -> None:
    """Draw every parameter of `layer` (but those in `skip`) from its own generator (see module
    docstring). A vocabulary matrix padded beyond `vocab_size` rows (`models.vocab`) gets its real
    rows drawn as the unpadded matrix would be, and zeros below: the padding changes no number."""
    for mod_name, module in layer.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{pname}" if mod_name else pname
            if name in skip:
                continue
            if _is_norm(module):
                p.fill_(1.0 if pname == "weight" else 0.0)
            elif pname == "bias" or p.ndim < 2:
                p.zero_()
            else:
                key_index, key_name = seed_keys.get(name, (index, name))
                gen = torch.Generator().manual_seed(stable_seed(seed, key_index, key_name))
                scale = std / math.sqrt(2 * n_blocks) if name.endswith(_RESIDUAL_OUT) else std
                padded = vocab_size is not None and is_vocab_param(name) and p.shape[0] > vocab_size
                real = p[:vocab_size] if padded else p
                # drawn on the CPU (the same numbers whatever the device): in place there, else
                # through one host tensor at a time
                if real.device.type == "cpu":
                    real.normal_(0.0, scale, generator=gen)
                else:
                    real.copy_(torch.empty(real.shape, dtype=p.dtype).normal_(0.0, scale, generator=gen))
                if padded:
                    p[vocab_size:].zero_()


def _move(layers: list[nn.Module | None], device: str | torch.device) -> None:
    built = [layer for layer in layers if layer is not None]
    if built and torch.device(device) != torch.device("cpu"):
        nn.ModuleList(built).to(device)  # one call keeps shared Parameters shared


def build_layer_model(
    cfg: ModelConfig,
    *,
    seed: int,
    owned: Iterable[int] | None = None,
    device: str | torch.device = "cpu",
    empty: Iterable[int] = (),
) -> LayerModel:
    """Build the layers in `owned` (None = all); the others are None in `layers`.

    Layer i's weights depend only on (seed, i); docs/training.md. Layers of `owned` also in
    `empty` are only allocated on `device` (`to_empty`: their values are about to arrive from a
    peer or a checkpoint), so they are neither drawn from the seed nor read from disk first.
    """
    if cfg.family == "custom":  # a user's factory builds its own way: no empty layers
        return _build_custom(cfg, seed=seed, owned=owned, device=device)
    if cfg.pretrained_path:
        return build_pretrained(cfg, owned=owned, device=device, empty=empty)
    config = hf_config(cfg)
    family, n = cfg.family, cfg.num_layers + 2
    rows = padded_vocab_size(cfg.vocab_size, cfg.pad_vocab_to)
    tied = cfg.tie_embeddings or family == "gpt2"
    emb_name = EMBED_NAME.get(family, "embed_tokens.weight")
    keep = check_owned(owned, n)
    blank = set(empty)

    def draw(i: int, layer: nn.Module, prefixes: dict[str, str], hf_names: list[dict[str, str]]) -> None:
        layer.to_empty(device=device)  # materialised where it trains, never whole on the CPU first
        if i in blank:
            return
        keys = {"lm_head.weight": (0, emb_name)} if tied and i == n - 1 else {}
        # a tied head built with the embedding becomes the embedding's Parameter: nothing to draw
        skip = frozenset(keys) if 0 in keep else frozenset()
        _init_parameters(
            layer,
            seed=seed,
            index=i,
            std=config.initializer_range,
            n_blocks=cfg.num_layers,
            seed_keys=keys,
            skip=skip,
            vocab_size=cfg.vocab_size,
        )

    return assemble(family, config, keep=keep, tied=tied, device=device, fill=draw, vocab_rows=rows)


def num_layers(cfg: ModelConfig) -> int:
    """How many flat layers the model of `cfg` has (embedding, blocks, head), without building
    any: from the config, a pretrained directory's config.json, or a custom factory's list."""
    if cfg.family == "custom":
        return len(_build_custom(cfg, seed=0, owned=[], device="cpu").layers)
    if cfg.pretrained_path:
        return pretrained_config(cfg).num_hidden_layers + 2
    return cfg.num_layers + 2


def build_meta_layers(cfg: ModelConfig, end: int, *, seed: int) -> list[nn.Module]:
    """Layers 0..end-1 on the meta device, for shape inference: no weights are materialised.

    Hugging Face layers come from `meta_layer` (a pretrained model's from its config.json alone),
    Rope layers with a rotary embedding built on meta. Custom layers are built as
    `build_layer_model` builds them, under `torch.device("meta")` (on CPU when the factory cannot
    build there), and copied to meta; the factory's own modules are left untouched.
    """
    if cfg.family == "custom":
        return _meta_custom(cfg, end, seed=seed)
    if cfg.pretrained_path:
        config = pretrained_config(cfg)
        family, n = config.model_type, config.num_hidden_layers + 2
    else:
        config, family, n = hf_config(cfg), cfg.family, cfg.num_layers + 2
    if not 0 < end <= n:
        raise ValueError(f"layer range end {end} is outside 1..{n}: the model has {n} layers")
    layers = []
    rows = padded_vocab_size(config.vocab_size, cfg.pad_vocab_to)
    for i in range(end):
        layer, _ = meta_layer(family, config, i, n, rows)
        if isinstance(layer, RopeDecoderLayer):
            with torch.device("meta"):
                layer.rotary_emb = getattr(modeling(family), f"{ROPE_PREFIX[family]}RotaryEmbedding")(config)
        layers.append(layer)
    return layers


def _meta_custom(cfg: ModelConfig, end: int, *, seed: int) -> list[nn.Module]:
    try:
        with torch.device("meta"):
            model = _build_custom(cfg, seed=seed, owned=range(end), device="cpu")
    except Exception:  # noqa: BLE001 - e.g. a factory computing on its tensors: build on CPU (re-raises real errors)
        model = _build_custom(cfg, seed=seed, owned=range(end), device="cpu")
    modules = nn.ModuleList([model.held(i) for i in range(end)])
    # deepcopy with every parameter and buffer pre-mapped to a meta copy: shared tensors stay
    # shared, nothing is copied on CPU, and the factory's modules keep their weights
    memo: dict[int, Any] = {
        id(p): nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad) for p in modules.parameters()
    }
    memo.update({id(b): b.detach().to("meta") for b in modules.buffers()})
    return list(copy.deepcopy(modules, memo))


def _load_factory(spec: str) -> Callable[[ModelConfig], Any]:
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise ValueError(f"model.custom_factory '{spec}' must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"model.custom_factory '{spec}': cannot import '{module_name}' ({err}); "
            "make it importable (PYTHONPATH) on every node"
        ) from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"model.custom_factory '{spec}': '{module_name}' has no function '{func_name}'")
    return func


def _build_custom(
    cfg: ModelConfig, *, seed: int, owned: Iterable[int] | None, device: str | torch.device
) -> LayerModel:
    """family=custom: factory(cfg) -> list of nn.Module (or of zero-argument builders).

    The factory runs under `torch.manual_seed(stable_seed(seed, 'custom'))` (global RNG restored
    afterwards), so a list of modules is the same in every process. A builder item is called
    only for an owned layer i, under `torch.manual_seed(stable_seed(seed, i))`.
    """
    spec = str(cfg.custom_factory or "")
    factory = _load_factory(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stable_seed(seed, "custom"))
        items = factory(cfg)
    if (
        not isinstance(items, (list, tuple))
        or not items
        or not all(isinstance(x, nn.Module) or callable(x) for x in items)
    ):
        raise TypeError(
            f"model.custom_factory '{spec}' must return a non-empty list of "
            f"nn.Module layers (or zero-argument functions building them); "
            f"got {type(items).__name__}"
        )
    keep = check_owned(owned, len(items))
    modules: list[nn.Module | None] = []
    for i, item in enumerate(items):
        if not isinstance(item, nn.Module) and i in keep:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(stable_seed(seed, i))
                item = item()
            if not isinstance(item, nn.Module):
                raise TypeError(
                    f"model.custom_factory '{spec}': builder {i} returned {type(item).__name__}, not an nn.Module"
                )
        modules.append(item if isinstance(item, nn.Module) else None)
    result = layers_from_modules(modules)
    result.layers = [m if i in keep else None for i, m in enumerate(modules)]
    _move(result.layers, device)
    return result


def layers_from_modules(modules: list[nn.Module | None], *, names: list[str] | None = None) -> LayerModel:
    """Wrap a user's own layer list; ties are found by storage among the given modules."""
    names = list(names) if names is not None else [f"layer.{i}" for i in range(len(modules))]
    if len(names) != len(modules):
        raise ValueError(f"layers_from_modules: {len(modules)} modules but {len(names)} names")
    hf_names = [
        {} if m is None else {p: f"{names[i]}.{p}" for p, _ in m.named_parameters(remove_duplicate=False)}
        for i, m in enumerate(modules)
    ]
    return LayerModel(layers=list(modules), names=names, hf_names=hf_names, tied=find_tied_parameters(modules))
