"""The flat layer list: small nn.Module wrappers around Hugging Face submodules, and `LayerModel`.

Invariant: every layer maps one tensor to one tensor, so any contiguous run of layers is a
pipeline stage. The story: docs/training.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .ties import TiedGroup

__all__ = [
    "causal_mask",
    "GPT2Embedding",
    "GPT2BlockLayer",
    "TokenEmbedding",
    "RopeDecoderLayer",
    "LMHead",
    "LayerModel",
    "causal_lm_loss",
]

_EXPLICIT_MASK = {None, "eager"}


def _mask_free(impl: str | None) -> bool:
    return impl == "sdpa" or (isinstance(impl, str) and impl.startswith("flash_attention"))


def check_attn_implementation(impl: str | None) -> None:
    """Raise if the wrappers cannot make attention causal under `impl`."""
    if impl in _EXPLICIT_MASK or _mask_free(impl):
        return
    raise ValueError(
        f"attention implementation {impl!r} is not supported by the flat layers; "
        "set model.attn_implementation to 'sdpa' or 'eager'"
    )


def causal_mask(h: torch.Tensor, *, window: int | None = None) -> torch.Tensor:
    """Additive (1, 1, L, L) mask of h's dtype: 0 where query i may see key j (j <= i, and
    i - j < window when a sliding window is given), finfo.min elsewhere."""
    length = h.shape[1]
    i = torch.arange(length, device=h.device)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= (i[:, None] - i[None, :]) < window
    mask = torch.zeros((length, length), dtype=h.dtype, device=h.device)
    return mask.masked_fill(~allowed, torch.finfo(h.dtype).min)[None, None]


def _attention_mask(config: Any, h: torch.Tensor, window: int | None) -> torch.Tensor | None:
    impl = getattr(config, "_attn_implementation", None)
    check_attn_implementation(impl)
    windowed = window is not None and window < h.shape[1]
    if _mask_free(impl) and not (windowed and impl == "sdpa"):
        return None
    return causal_mask(h, window=window if windowed else None)


class GPT2Embedding(nn.Module):
    """GPT-2 layer 0: `drop(wte(input_ids) + wpe(arange(L)))`."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return self.drop(self.wte(input_ids) + self.wpe(pos))


class GPT2BlockLayer(nn.Module):
    """One `GPT2Block`, causal under sdpa (no mask, is_causal) and eager (explicit mask)."""

    block: Any  # a transformers GPT2Block: its children are dynamic attributes

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        check_attn_implementation(self.block.attn.config._attn_implementation)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mask = _attention_mask(self.block.attn.config, h, None)
        return self.block(h, attention_mask=mask, use_cache=False)


class TokenEmbedding(nn.Module):
    """Llama-family layer 0: `embed_tokens(input_ids)`."""

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class RopeDecoderLayer(nn.Module):
    """One Llama/Mistral/Qwen2 decoder layer with its own (parameter-free) rotary embedding."""

    layer: Any  # a transformers decoder layer: its children are dynamic attributes

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.layer, self.rotary_emb = layer, rotary_emb
        check_attn_implementation(self.layer.self_attn.config._attn_implementation)

    def _window(self) -> int | None:
        attn = self.layer.self_attn
        if hasattr(attn, "sliding_window"):  # Qwen2: set per layer type
            return attn.sliding_window
        return getattr(attn.config, "sliding_window", None)  # Mistral

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[1], device=h.device)[None]
        mask = _attention_mask(self.layer.self_attn.config, h, self._window())
        return self.layer(
            h, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary_emb(h, pos), use_cache=False
        )


class LMHead(nn.Module):
    """Last layer: final norm then the vocabulary projection; returns logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits (B, L, V) against labels (B, L), mean over tokens.

    Labels are already aligned with the logits (label t is the token after input t); entries
    equal to -100 are ignored.
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


@dataclass
class LayerModel:
    """A flat layer list; entries this process does not own are None."""

    layers: list[nn.Module | None]
    """The layers, in order."""
    names: list[str]
    """One name per layer (`embedding`, `block.0`, ..., `head`)."""
    hf_names: list[dict[str, str]]
    """Per layer: local parameter name -> Hugging Face parameter name."""
    tied: list[TiedGroup] = field(default_factory=list)
    """Groups of (layer index, local name) that are one tensor."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = causal_lm_loss
    """loss_fn(logits, labels) -> scalar."""
    hf_config: Any = None
    """The Hugging Face config the layers were built from (None for custom layers)."""
    vocab_size: int | None = None
    """The real vocabulary when the embedding and head have padded rows beyond it (`models.vocab`);
    None: no padding."""

    def __post_init__(self) -> None:
        n = len(self.layers)
        if len(self.names) != n or len(self.hf_names) != n:
            raise ValueError(
                f"LayerModel: {n} layers but {len(self.names)} names and "
                f"{len(self.hf_names)} hf_names entries; give one per layer"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def built(self) -> list[int]:
        """Indices of the layers held by this process."""
        return [i for i, layer in enumerate(self.layers) if layer is not None]

    def held(self, i: int) -> nn.Module:
        """Layer `i`, which this process must hold."""
        return self._require(i, i + 1)[0]

    def _require(self, start: int, end: int) -> list[nn.Module]:
        if not 0 <= start < end <= self.num_layers:
            raise IndexError(f"layer range [{start}, {end}) is outside 0..{self.num_layers}")
        missing = [self.names[i] for i in range(start, end) if self.layers[i] is None]
        if missing:
            raise RuntimeError(
                f"layers {missing} are not built in this process; build them with owned covering [{start}, {end})"
            )
        return [layer for layer in self.layers[start:end] if layer is not None]

    def retie(self) -> None:
        """Make every tied group one Parameter again among the layers held here (after layers
        built, kept and received separately were put together): the first held member's."""
        for group in self.tied:
            held = [(i, name) for i, name in group.members if self.layers[i] is not None]
            if len(held) < 2:
                continue
            first_layer = self.layers[held[0][0]]
            assert first_layer is not None
            first = first_layer.get_parameter(held[0][1])
            for i, name in held[1:]:
                layer = self.layers[i]
                assert layer is not None
                owner_path, _, attr = name.rpartition(".")
                setattr(layer.get_submodule(owner_path) if owner_path else layer, attr, first)

    def stage(self, start: int, end: int) -> nn.Sequential:
        """layers[start:end] as an nn.Sequential (the modules are shared, not copied)."""
        return nn.Sequential(*self._require(start, end))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Run every layer in order (all must be built); returns the last layer's output."""
        x = input_ids
        for layer in self._require(0, self.num_layers):
            x = layer(x)
        return x

    __call__ = forward
