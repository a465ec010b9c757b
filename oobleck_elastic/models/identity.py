"""A model's identity: what fixes the shapes of its layers' tensors, without building any.

Every checkpoint records it, and a job refuses to resume from a checkpoint whose identity differs
(checkpoint/identity.py). The values come from the Hugging Face config the layers are built from:
the model config's, a pretrained directory's config.json; a custom factory is named by its path.
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from .hf import hf_config
from .pretrained import pretrained_config

__all__ = ["model_identity"]


def model_identity(cfg: ModelConfig) -> dict[str, Any]:
    """{family, num_layers (blocks), hidden_size, num_heads, num_kv_heads, intermediate_size,
    vocab_size (unpadded), positions (GPT-2's position embedding rows)} of the model `cfg` builds;
    {family, factory} for a custom one. Raises what building it would (a missing config.json)."""
    if cfg.family == "custom":
        return {"family": "custom", "factory": cfg.custom_factory}
    config = pretrained_config(cfg) if cfg.pretrained_path else hf_config(cfg)
    gpt2 = config.model_type == "gpt2"
    heads = config.num_attention_heads
    identity = {
        "family": config.model_type,
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_heads": heads,
        "num_kv_heads": heads if gpt2 else getattr(config, "num_key_value_heads", None) or heads,
        "intermediate_size": (config.n_inner or 4 * config.hidden_size) if gpt2 else config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    if gpt2:
        identity["positions"] = config.n_positions
    return identity
