"""The Hugging Face families' flat layers: their configs, layers built on meta, and assembly.

Every source of Hugging Face layers (drawn from a seed in `models.build`, read from a pretrained
directory in `models.pretrained`, flattened from a model in memory) shares these pieces: `hf_config`
(the transformers config of a job's model), `meta_layer` (layer i constructed on the meta device,
with the map from its local names to the Hugging Face checkpoint's), and `assemble` (the flat
`LayerModel` with the owned layers materialised by a caller's `fill`, rotary embeddings attached
and tied ends sharing one Parameter). The story: docs/training.md.
"""

from __future__ import annotations

import importlib
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
from .ties import TiedGroup

__all__ = [
    "HF_FAMILIES",
    "EMBED_NAME",
    "ROPE_PREFIX",
    "assemble",
    "check_owned",
    "hf_config",
    "layer_hf_names",
    "layer_names",
    "meta_layer",
    "modeling",
]


HF_FAMILIES = ("gpt2", "llama", "mistral", "qwen2")


ROPE_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


EMBED_NAME = {"gpt2": "wte.weight"}
"""The embedding's parameter name by family (others: embed_tokens.weight)."""


def modeling(family: str) -> Any:
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def hf_config(cfg: ModelConfig) -> Any:
    """The transformers config (GPT2Config, LlamaConfig, MistralConfig, Qwen2Config) for cfg.

    It names no special tokens (bos/eos/pad None): a model config knows no tokenizer, and training
    reads none of them (a pad_token_id would even become a Llama embedding's padding_idx, whose
    row gets no gradient). `oobleck export` sets them from the job's tokenizer
    (`models.export_tokenizer`)."""
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
            bos_token_id=None,
            eos_token_id=None,
            tie_word_embeddings=True,
            use_cache=False,
        )
    else:
        cls = getattr(transformers, f"{ROPE_PREFIX[cfg.family]}Config")
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
            bos_token_id=None,
            eos_token_id=None,
            **extra,
        )
    conf._attn_implementation = cfg.attn_implementation
    return conf


def layer_hf_names(layer: nn.Module, prefixes: dict[str, str]) -> dict[str, str]:
    out = {}
    for name, _ in layer.named_parameters(remove_duplicate=False):
        head, _, rest = name.partition(".")
        out[name] = f"{prefixes[head]}.{rest}"
    return out


def layer_names(n_blocks: int) -> list[str]:
    return ["embedding", *(f"block.{i}" for i in range(n_blocks)), "head"]


def meta_layer(
    family: str, config: Any, index: int, n_layers: int, vocab_rows: int | None = None
) -> tuple[nn.Module, dict]:
    """Construct layer `index` on the meta device; returns (layer, local -> HF prefix map).
    `vocab_rows`: rows of the embedding and head (the padded vocabulary, `models.vocab`)."""
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
            block = modeling("gpt2").GPT2Block(config, layer_idx=index - 1)
            return GPT2BlockLayer(block), {"block": f"transformer.h.{index - 1}"}
        mod, prefix = modeling(family), ROPE_PREFIX[family]
        if index == 0:
            return (TokenEmbedding(nn.Embedding(vocab, h)), {"embed_tokens": "model.embed_tokens"})
        if last:
            norm = getattr(mod, f"{prefix}RMSNorm")(h, eps=config.rms_norm_eps)
            return (LMHead(norm, nn.Linear(h, vocab, bias=False)), {"norm": "model.norm", "lm_head": "lm_head"})
        layer = getattr(mod, f"{prefix}DecoderLayer")(config, index - 1)
        return RopeDecoderLayer(layer, nn.Identity()), {"layer": f"model.layers.{index - 1}"}


def check_owned(owned: Iterable[int] | None, n: int) -> set[int]:
    if owned is None:
        return set(range(n))
    result = {int(i) for i in owned}
    bad = sorted(i for i in result if not 0 <= i < n)
    if bad:
        raise ValueError(f"owned layers {bad} are out of range: the model has {n} layers (0..{n - 1})")
    return result


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
    vocabulary (`models.vocab`; None = config.vocab_size)."""
    n = config.num_hidden_layers + 2
    emb_name = EMBED_NAME.get(family, "embed_tokens.weight")
    rotary_cls = None if family == "gpt2" else getattr(modeling(family), f"{ROPE_PREFIX[family]}RotaryEmbedding")
    layers: list[nn.Module | None] = []
    hf_names: list[dict[str, str]] = []
    for i in range(n):
        layer, prefixes = meta_layer(family, config, i, n, vocab_rows)
        hf_names.append(layer_hf_names(layer, prefixes))
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
        names=layer_names(n - 2),
        hf_names=hf_names,
        tied=groups,
        hf_config=config,
        vocab_size=config.vocab_size if padded else None,
    )
    model.retie()
    return model
