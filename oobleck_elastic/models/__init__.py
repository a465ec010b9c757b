"""Models as flat layer lists for pipeline parallelism.

`build_layer_model(cfg, seed=..., owned=...)` builds only a worker's layers, each initialised
from (seed, layer index) alone; `flatten_hf_model` wraps an existing Hugging Face causal LM;
`layers_from_modules` wraps a user's own list. All return a `LayerModel` (layers, names,
Hugging Face parameter names, tied-parameter groups, loss). The story: docs/training.md.
"""

from .hf import HF_FAMILIES, hf_config
from .build import build_layer_model, flatten_hf_model, layers_from_modules, num_layers, stable_seed
from .layers import (
    GPT2BlockLayer,
    GPT2Embedding,
    LayerModel,
    LMHead,
    RopeDecoderLayer,
    TokenEmbedding,
    causal_lm_loss,
    causal_mask,
)
from .ties import TiedGroup, describe_ties, find_tied_parameters

__all__ = [
    "HF_FAMILIES",
    "build_layer_model",
    "flatten_hf_model",
    "hf_config",
    "layers_from_modules",
    "stable_seed",
    "GPT2BlockLayer",
    "GPT2Embedding",
    "LayerModel",
    "LMHead",
    "RopeDecoderLayer",
    "TokenEmbedding",
    "causal_lm_loss",
    "causal_mask",
    "TiedGroup",
    "describe_ties",
    "find_tied_parameters",
    "num_layers",
]
