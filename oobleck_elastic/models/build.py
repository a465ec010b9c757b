"""Build the flat layer list of a model, per layer, deterministically.

Three sources of layers:

- `flatten_hf_model(model)`: wrap the submodules of an existing Hugging Face causal LM (GPT-2,
  Llama, Mistral, Qwen2) in the wrappers of `layers.py`. Modules are reused, not copied, so tied
  weights stay one Parameter and the layers reproduce `model(input_ids).logits` exactly.
- `build_layer_model(cfg, seed=..., owned=...)`: build only the layers a worker owns. Every layer
  is first constructed on the meta device (cheap, consumes no RNG), then the owned ones are
  materialised and every parameter is drawn from its own `torch.Generator` seeded with
  `stable_seed(seed, layer_index, parameter_name)` (sha256 -> 63 bits). Layer i therefore depends
  only on (seed, i): two workers with different stage splits hold bit-identical copies. Owned
  layers are materialised directly on the training device (`to_empty`), each parameter's numbers
  drawn on the CPU (in place on a CPU device; on a GPU through one host tensor at a time), so no
  layer is ever whole on the host and the numbers do not depend on the device. The
  scheme follows Hugging Face: matrices and embeddings N(0, initializer_range), residual output
  projections (GPT-2 `c_proj`, Llama `o_proj`/`down_proj`) N(0, initializer_range/sqrt(2N)),
  biases 0, norm weights 1. A tied `lm_head.weight` is seeded with the embedding's key, so a
  head built alone equals the embedding built elsewhere; built together they share one
  Parameter. With `cfg.pretrained_path` only the owned layers' tensors are read from the local
  Hugging Face directory, one tensor at a time (pretrained.py);
  with family `custom` a user factory supplies the layers.
- `layers_from_modules(modules)`: a user's own list of layers.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import math
from pathlib import Path
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
    check_attn_implementation,
)
from .ties import TiedGroup, find_tied_parameters
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

HF_FAMILIES = ("gpt2", "llama", "mistral", "qwen2")
_ROPE_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
_RESIDUAL_OUT = ("c_proj.weight", "o_proj.weight", "down_proj.weight")
_EMBED_NAME = {"gpt2": "wte.weight"}  # others: embed_tokens.weight


def stable_seed(seed: int, *parts: Any) -> int:
    """A 63-bit seed derived from (seed, *parts) with sha256; stable across processes and runs."""
    blob = "/".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "big") & (2**63 - 1)


def _modeling(family: str) -> Any:
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def hf_config(cfg: ModelConfig) -> Any:
    """The transformers config (GPT2Config, LlamaConfig, MistralConfig, Qwen2Config) for cfg."""
    import transformers

    if cfg.family not in HF_FAMILIES:
        raise ValueError(
            f"model.family '{cfg.family}' has no Hugging Face config; choose one of "
            f"{', '.join(HF_FAMILIES)} (or build custom layers with custom_factory)"
        )
    check_attn_implementation(cfg.attn_implementation)
    vocab, inter = cfg.vocab_size, cfg.intermediate_size or 4 * cfg.hidden_size
    if cfg.family == "gpt2":
        if cfg.num_kv_heads not in (None, cfg.num_heads):
            raise ValueError("GPT-2 has no grouped-query attention: unset model.num_kv_heads or use model.family=llama")
        conf = transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=cfg.max_seq_len,
            n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            n_inner=inter,
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout,
            bos_token_id=vocab - 1,
            eos_token_id=vocab - 1,
            tie_word_embeddings=True,
            use_cache=False,
        )
    else:
        cls = getattr(transformers, f"{_ROPE_PREFIX[cfg.family]}Config")
        extra = {"sliding_window": None} if cfg.family == "mistral" else {}
        conf = cls(
            vocab_size=vocab,
            hidden_size=cfg.hidden_size,
            intermediate_size=inter,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
            max_position_embeddings=cfg.max_seq_len,
            attention_dropout=cfg.dropout,
            tie_word_embeddings=cfg.tie_embeddings,
            use_cache=False,
            bos_token_id=min(1, vocab - 1),
            eos_token_id=min(2, vocab - 1),
            **extra,
        )
    conf._attn_implementation = cfg.attn_implementation
    return conf


# ----------------------------------------------------------------------------- flatten


def _hf_names(layer: nn.Module, prefixes: dict[str, str]) -> dict[str, str]:
    out = {}
    for name, _ in layer.named_parameters(remove_duplicate=False):
        head, _, rest = name.partition(".")
        out[name] = f"{prefixes[head]}.{rest}"
    return out


_CAUSAL_LM = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def _family_of(model: nn.Module) -> str:
    for family, cls_name in _CAUSAL_LM.items():
        if isinstance(model, getattr(_modeling(family), cls_name)):
            return family
    raise TypeError(
        f"flatten_hf_model supports {', '.join(_CAUSAL_LM.values())}, not "
        f"{type(model).__name__}; wrap other models' layers yourself and use "
        "layers_from_modules(...) (or model.family=custom)"
    )


def _head_index_names(n_blocks: int) -> list[str]:
    return ["embedding", *(f"block.{i}" for i in range(n_blocks)), "head"]


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
        names=_head_index_names(len(layers) - 2),
        hf_names=[_hf_names(m, p) for m, p in zip(layers, prefixes)],
        tied=find_tied_parameters(layers),
        hf_config=model.config,
    )


# ----------------------------------------------------------------------------- build


def _meta_layer(
    family: str, config: Any, index: int, n_layers: int, vocab_rows: int | None = None
) -> tuple[nn.Module, dict]:
    """Construct layer `index` on the meta device; returns (layer, local -> HF prefix map).
    `vocab_rows`: rows of the embedding and head (the padded vocabulary, models/vocab.py)."""
    h, vocab = config.hidden_size, vocab_rows or config.vocab_size
    last = index == n_layers - 1
    with torch.device("meta"):
        if family == "gpt2":
            if index == 0:
                return (
                    GPT2Embedding(
                        nn.Embedding(vocab, h), nn.Embedding(config.n_positions, h), nn.Dropout(config.embd_pdrop)
                    ),
                    {"wte": "transformer.wte", "wpe": "transformer.wpe"},
                )
            if last:
                return (
                    LMHead(nn.LayerNorm(h, eps=config.layer_norm_epsilon), nn.Linear(h, vocab, bias=False)),
                    {"norm": "transformer.ln_f", "lm_head": "lm_head"},
                )
            block = _modeling("gpt2").GPT2Block(config, layer_idx=index - 1)
            return GPT2BlockLayer(block), {"block": f"transformer.h.{index - 1}"}
        mod, prefix = _modeling(family), _ROPE_PREFIX[family]
        if index == 0:
            return (TokenEmbedding(nn.Embedding(vocab, h)), {"embed_tokens": "model.embed_tokens"})
        if last:
            norm = getattr(mod, f"{prefix}RMSNorm")(h, eps=config.rms_norm_eps)
            return (LMHead(norm, nn.Linear(h, vocab, bias=False)), {"norm": "model.norm", "lm_head": "lm_head"})
        layer = getattr(mod, f"{prefix}DecoderLayer")(config, index - 1)
        return RopeDecoderLayer(layer, nn.Identity()), {"layer": f"model.layers.{index - 1}"}


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
) -> None:
    """Draw every parameter of `layer` (but those in `skip`) from its own generator (see module
    docstring)."""
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
                # drawn on the CPU (the same numbers whatever the device): in place there, else
                # through one host tensor at a time
                if p.device.type == "cpu":
                    p.normal_(0.0, scale, generator=gen)
                else:
                    p.copy_(torch.empty(p.shape, dtype=p.dtype).normal_(0.0, scale, generator=gen))


def _check_owned(owned: Iterable[int] | None, n: int) -> set[int]:
    if owned is None:
        return set(range(n))
    result = {int(i) for i in owned}
    bad = sorted(i for i in result if not 0 <= i < n)
    if bad:
        raise ValueError(f"owned layers {bad} are out of range: the model has {n} layers (0..{n - 1})")
    return result


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

    Layer i's weights depend only on (seed, i); see the module docstring. Layers of `owned` also in
    `empty` are only allocated on `device` (`to_empty`: their values are about to arrive from a
    peer or a checkpoint), so they are neither drawn from the seed nor read from disk first.
    """
    if cfg.family == "custom":  # a user's factory builds its own way: no empty layers
        return _build_custom(cfg, seed=seed, owned=owned, device=device)
    if cfg.pretrained_path:
        return _build_pretrained(cfg, owned=owned, device=device, empty=empty)
    config = hf_config(cfg)
    family, n = cfg.family, cfg.num_layers + 2
    rows = padded_vocab_size(cfg.vocab_size, cfg.pad_vocab_to)
    tied = cfg.tie_embeddings or family == "gpt2"
    emb_name = _EMBED_NAME.get(family, "embed_tokens.weight")
    keep = _check_owned(owned, n)
    blank = set(empty)

    def draw(i: int, layer: nn.Module, prefixes: dict[str, str], hf_names: list[dict[str, str]]) -> None:
        layer.to_empty(device=device)  # materialised where it trains, never whole on the CPU first
        if i in blank:
            return
        keys = {"lm_head.weight": (0, emb_name)} if tied and i == n - 1 else {}
        # a tied head built with the embedding becomes the embedding's Parameter: nothing to draw
        skip = frozenset(keys) if 0 in keep else frozenset()
        _init_parameters(
            layer, seed=seed, index=i, std=config.initializer_range, n_blocks=cfg.num_layers, seed_keys=keys, skip=skip
        )
        with torch.no_grad():  # padded rows are zero (models/vocab.py)
            for name, p in layer.named_parameters():
                if is_vocab_param(name) and p.shape[0] > cfg.vocab_size:
                    p[cfg.vocab_size :].zero_()

    return assemble(family, config, keep=keep, tied=tied, device=device, fill=draw, vocab_rows=rows)


def num_layers(cfg: ModelConfig) -> int:
    """How many flat layers the model of `cfg` has (embedding, blocks, head), without building
    any: from the config, a pretrained directory's config.json, or a custom factory's list."""
    if cfg.family == "custom":
        return len(_build_custom(cfg, seed=0, owned=[], device="cpu").layers)
    if cfg.pretrained_path:
        return _pretrained_config(cfg).num_hidden_layers + 2
    return cfg.num_layers + 2


def assemble(
    family: str,
    config: Any,
    *,
    keep: set[int],
    tied: bool,
    device: str | torch.device,
    fill: Callable[[int, nn.Module, dict[str, str], list[dict[str, str]]], None],
    vocab_rows: int | None = None,
) -> LayerModel:
    """The flat layers of a Hugging Face `config`: every layer constructed on the meta device (for
    its names: no memory, no RNG), the layers of `keep` materialised on `device` by
    `fill(index, layer, local -> HF prefixes, HF names of the layers so far)`, which must leave no
    meta parameter; a Rope layer then gets its rotary embedding (non-persistent `inv_freq`,
    computed on the CPU), and tied ends built here share one Parameter. `vocab_rows`: the padded
    vocabulary (models/vocab.py; None = config.vocab_size)."""
    n = config.num_hidden_layers + 2
    emb_name = _EMBED_NAME.get(family, "embed_tokens.weight")
    rotary_cls = None if family == "gpt2" else getattr(_modeling(family), f"{_ROPE_PREFIX[family]}RotaryEmbedding")
    layers: list[nn.Module | None] = []
    hf_names: list[dict[str, str]] = []
    for i in range(n):
        layer, prefixes = _meta_layer(family, config, i, n, vocab_rows)
        hf_names.append(_hf_names(layer, prefixes))
        if i not in keep:
            layers.append(None)
            continue
        fill(i, layer, prefixes, hf_names)
        if isinstance(layer, RopeDecoderLayer):
            assert rotary_cls is not None
            layer.rotary_emb = rotary_cls(config).to(device)
        layers.append(layer)
    groups = [TiedGroup([(0, emb_name), (n - 1, "lm_head.weight")])] if tied else []
    padded = vocab_rows is not None and vocab_rows > config.vocab_size
    model = LayerModel(
        layers=layers,
        names=_head_index_names(n - 2),
        hf_names=hf_names,
        tied=groups,
        hf_config=config,
        vocab_size=config.vocab_size if padded else None,
    )
    model.retie()
    return model


def build_meta_layers(cfg: ModelConfig, end: int, *, seed: int) -> list[nn.Module]:
    """Layers 0..end-1 on the meta device, for shape inference: no weights are materialised.

    Hugging Face layers come from `_meta_layer` (a pretrained model's from its config.json alone),
    Rope layers with a rotary embedding built on meta. Custom layers are built as
    `build_layer_model` builds them, under `torch.device("meta")` (on CPU when the factory cannot
    build there), and copied to meta; the factory's own modules are left untouched.
    """
    if cfg.family == "custom":
        return _meta_custom(cfg, end, seed=seed)
    if cfg.pretrained_path:
        config = _pretrained_config(cfg)
        family, n = config.model_type, config.num_hidden_layers + 2
    else:
        config, family, n = hf_config(cfg), cfg.family, cfg.num_layers + 2
    if not 0 < end <= n:
        raise ValueError(f"layer range end {end} is outside 1..{n}: the model has {n} layers")
    layers = []
    rows = padded_vocab_size(config.vocab_size, cfg.pad_vocab_to)
    for i in range(end):
        layer, _ = _meta_layer(family, config, i, n, rows)
        if isinstance(layer, RopeDecoderLayer):
            with torch.device("meta"):
                layer.rotary_emb = getattr(_modeling(family), f"{_ROPE_PREFIX[family]}RotaryEmbedding")(config)
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


def _pretrained_dir(cfg: ModelConfig) -> Path:
    from .pretrained import pretrained_dir

    return pretrained_dir(cfg.pretrained_path or "")


def _pretrained_config(cfg: ModelConfig) -> Any:
    """The Hugging Face config of a local pretrained model, set up as `_build_pretrained` loads it."""
    from .pretrained import pretrained_config

    return pretrained_config(cfg)


def _build_pretrained(
    cfg: ModelConfig, *, owned: Iterable[int] | None, device: str | torch.device, empty: Iterable[int] = ()
) -> LayerModel:
    """Only the owned layers' tensors are read, straight onto `device` (see pretrained.py)."""
    from .pretrained import build_pretrained

    return build_pretrained(cfg, owned=owned, device=device, empty=empty)


# ----------------------------------------------------------------------------- custom


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
    keep = _check_owned(owned, len(items))
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
