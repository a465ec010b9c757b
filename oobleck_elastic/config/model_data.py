"""The `model` and `data` sections of the job config: what is trained, and on what.

`ModelConfig` builds the model (a family of Hugging Face classes with random weights, a
pretrained directory, or a custom factory); `DataConfig` names the corpus, its tokenizer and the
sample length. Each section's `validate()` returns the rules its types cannot express. The fields:
docs/config.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from .schema import Section, at_least

# The choices of this section's choice fields (schema.py: omegaconf refuses any other value).
ModelFamily = Literal["gpt2", "llama", "mistral", "qwen2", "custom"]
AttnImplementation = Literal["sdpa", "eager"]
DataSource = Literal["stdlib", "files", "jsonl", "parquet", "hf_disk", "tokens"]
TokenizerKind = Literal["bytes", "bpe", "hf"]
TokenDtype = Literal["uint16", "uint32"]


@dataclass
class ModelConfig(Section):
    family: ModelFamily = "gpt2"
    """Model family: `gpt2`, `llama`, `mistral` or `qwen2` (Hugging Face classes, built from this
    config with random weights), or `custom` (see `custom_factory`)."""
    vocab_size: int = 256
    """Vocabulary size (256 = raw bytes, the fastest tokenizer)."""
    pad_vocab_to: int = 64
    """The embedding and LM head get vocab_size rounded up to a multiple of this many rows (GPT-2's
    50257 -> 50304: matrix shapes the GPU kernels like). Padded rows stay zero, are left out of the
    loss, and are dropped from checkpoints and exports (models/vocab.py); 1 = no padding."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 4
    """Number of decoder blocks. The flat layer list has num_layers + 2 layers
    (embedding, blocks, final norm + LM head)."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention (Llama family); None = num_heads."""
    intermediate_size: Optional[int] = None
    """MLP width; None = 4 x hidden_size."""
    max_seq_len: int = 64
    """Longest sequence the position embedding supports."""
    tie_embeddings: bool = True
    """Share the token embedding with the LM head (GPT-2 always does)."""
    dropout: float = 0.0
    """Dropout probability (0 keeps runs bit-comparable with the single-process reference)."""
    attn_implementation: AttnImplementation = "sdpa"
    """`sdpa` or `eager`; both are causal."""
    pretrained_path: Optional[str] = None
    """Local directory with Hugging Face weights (config.json + safetensors); no hub downloads.
    A relative path: see Paths."""
    custom_factory: Optional[str] = None
    """For family=custom: `module:function` returning a list[nn.Module] of layers."""

    def validate(self) -> list[str]:
        problems = at_least(
            "model", self, ("vocab_size", "pad_vocab_to", "hidden_size", "num_layers", "num_heads", "max_seq_len"), 1
        )
        if self.hidden_size >= 1 and self.num_heads >= 1 and self.hidden_size % self.num_heads:
            problems.append(
                f"'model.hidden_size' ({self.hidden_size}) must be a multiple of 'model.num_heads' ({self.num_heads})"
            )
        if self.num_kv_heads is not None and (self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads):
            problems.append(
                f"'model.num_heads' ({self.num_heads}) must be a multiple of 'model.num_kv_heads' ({self.num_kv_heads})"
            )
        if self.family == "custom" and not self.custom_factory:
            problems.append(
                "'model.family' is custom but 'model.custom_factory' is not set "
                "(give module:function returning a list[nn.Module])"
            )
        return problems


@dataclass
class DataConfig(Section):
    source: DataSource = "stdlib"
    """`stdlib` (the Python standard library's source files, present on every machine), `files`
    (the text files in `paths`), `jsonl` / `parquet` (JSON-lines / Parquet files, or directories
    of *.jsonl, *.json / *.parquet, in `paths`; one document per row), `hf_disk` (the
    `datasets.Dataset.save_to_disk` directory `paths[0]`) or `tokens` (pre-tokenized flat .bin or
    1-D .npy files in `paths`, memory-mapped as they are, in order; no tokenizer, no cache)."""
    paths: list[str] = field(default_factory=list)
    """Files or directories of the source (all sources but stdlib). Relative paths: see Paths."""
    tokenizer: TokenizerKind = "bytes"
    """`bytes` (vocab 256), `bpe` (byte-level BPE trained on the corpus and cached) or `hf` (the
    pretrained tokenizer in `tokenizer_path`). Not used by source=tokens."""
    tokenizer_path: Optional[str] = None
    """For tokenizer=hf: a local directory saved with `save_pretrained` (`transformers`), or a
    `tokenizers` JSON file (`Tokenizer.save("tok.json")`, holding GPT-2's end-of-text special token);
    its vocabulary must fit model.vocab_size. Nothing is downloaded. A relative path: see Paths."""
    text_field: str = "text"
    """The column holding each document's text (source=jsonl, parquet, hf_disk)."""
    token_dtype: TokenDtype = "uint16"
    """dtype of the .bin files of source=tokens: `uint16` (nanoGPT; ids < 65536) or `uint32`.
    .npy files carry their own dtype."""
    num_proc: int = 1
    """Processes that tokenise a text dataset (1 = in the worker itself, which a fast tokenizer
    already spreads over threads); raise it for large corpora. Tokenising happens once per host."""
    seq_len: int = 64
    """Tokens per sample (the microbatch shape is microbatch_size x seq_len)."""
    cache_dir: str = ".oobleck-cache"
    """Where tokenizers, token files, Arrow copies of JSONL/Parquet datasets and profiles are cached.
    A relative path: see Paths."""

    def validate(self) -> list[str]:
        problems = at_least("data", self, ("seq_len", "num_proc"), 1)
        if self.source in ("files", "jsonl", "parquet", "hf_disk", "tokens") and not self.paths:
            problems.append(f"'data.source' is {self.source} but 'data.paths' is empty")
        if self.source == "hf_disk" and len(self.paths) > 1:
            problems.append(
                f"'data.source' is hf_disk but 'data.paths' has {len(self.paths)} entries: give the one "
                "directory written by Dataset.save_to_disk"
            )
        if self.tokenizer == "hf" and self.source != "tokens" and not self.tokenizer_path:
            problems.append(
                "'data.tokenizer' is hf but 'data.tokenizer_path' is not set: give the directory of a "
                "tokenizer saved with save_pretrained"
            )
        if self.tokenizer_path and self.tokenizer != "hf":
            problems.append(
                f"'data.tokenizer_path' is set but 'data.tokenizer' is {self.tokenizer}: "
                "set data.tokenizer=hf to use it"
            )
        return problems
