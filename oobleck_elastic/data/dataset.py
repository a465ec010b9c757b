"""Training data: from `data.*` in the job config to the samples of every step.

`build_dataset(cfg)` drives the data pipeline in the order the data flows: source, tokens,
samples. The story: docs/training.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..config import JobConfig
from .cache import Log
from .corpus import corpus_tokens
from .errors import DataError
from .text import TEXT_SOURCES, text_source_tokens
from .tokens import open_token_files
from .tokens import TokenFiles
from .tokenizer import TokenizerFiles, check_tokenizer_path

__all__ = ["TokenWindows", "build_dataset", "check_data"]


# ----------------------------------------------------------------------------- corpus


# ----------------------------------------------------------------------------- tokenizers


# ----------------------------------------------------------------------------- dataset


class TokenWindows(torch.utils.data.Dataset):
    """Fixed windows over a flat token array: item i = (input_ids, labels), labels = next tokens."""

    def __init__(
        self,
        tokens: np.ndarray | TokenFiles,
        seq_len: int,
        *,
        vocab_size: int | None = None,
        source: str | None = None,
        tokenizer: TokenizerFiles | None = None,
    ) -> None:
        if seq_len < 1:
            raise DataError(f"data.seq_len must be >= 1 (got {seq_len})")
        self.tokens, self.seq_len = tokens, int(seq_len)
        self.vocab_size, self.source = vocab_size, source
        self.tokenizer = tokenizer
        """Where the tokenizer of these tokens is (None: source=tokens, ids as they are); a
        checkpoint copies it (`save_tokenizer_files`)."""
        self._n = max(0, (len(tokens) - 1) // self.seq_len)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"sample {i} is out of range: the dataset has {self._n} windows")
        start = i * self.seq_len
        window = torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        return window[:-1], window[1:]

    def __repr__(self) -> str:
        return (
            f"TokenWindows({self._n} windows of {self.seq_len} tokens, {len(self.tokens)} tokens, source={self.source})"
        )


def check_data(cfg: JobConfig) -> None:
    """The checks that touch no file's content (the launcher makes them before it starts a node):
    every `data.paths` entry exists, and a pretrained tokenizer's directory does. Raises DataError."""
    d = cfg.data
    if d.source != "stdlib":
        for entry in d.paths:
            if not Path(entry).expanduser().exists():
                raise DataError(f"data.paths entry '{entry}' does not exist: fix the path or remove it from data.paths")
    if d.tokenizer == "hf" and d.source != "tokens":
        check_tokenizer_path(d.tokenizer_path)


def build_dataset(cfg: JobConfig, *, log: Log = print, max_bytes: int | None = None) -> TokenWindows:
    """The training windows of a job, building (or reusing) the tokenizer and token caches.

    `max_bytes` caps the corpus of source=stdlib/files; None = `STDLIB_MAX_BYTES` for
    source=stdlib and no cap for source=files; 0 = no cap. Other sources are read whole.
    source=tokens uses the ids of its files as they are: data.tokenizer is not used.
    """
    d, vocab = cfg.data, cfg.model.vocab_size
    tokenizer: TokenizerFiles | None = None
    if d.source == "tokens":
        if d.tokenizer != "bytes":
            log(f"data: data.source=tokens uses the token ids as they are (data.tokenizer={d.tokenizer} is unused)")
        tokens = open_token_files(d.paths, d.token_dtype, vocab)
        log(f"data: {len(tokens)} tokens memory-mapped from {len(getattr(tokens, 'files', [0]))} token file(s)")
    else:
        if d.tokenizer not in ("bytes", "bpe", "hf"):
            raise DataError(f"data.tokenizer is '{d.tokenizer}'; choose bytes, bpe or hf")
        if d.tokenizer == "bytes" and vocab < 256:
            raise DataError(
                f"model.vocab_size ({vocab}) is below 256 but data.tokenizer=bytes "
                "needs one token per byte value: set model.vocab_size=256 (or more)"
            )
        if d.source in TEXT_SOURCES:
            tokens, tokenizer = text_source_tokens(cfg, log)
        else:
            tokens, tokenizer = corpus_tokens(cfg, log, max_bytes)
    ds = TokenWindows(tokens, d.seq_len, vocab_size=vocab, source=d.source, tokenizer=tokenizer)
    if len(ds) == 0:
        raise DataError(
            f"the corpus has {len(tokens)} tokens, fewer than one window of "
            f"data.seq_len+1 = {d.seq_len + 1}: add data or lower data.seq_len"
        )
    return ds


# ----------------------------------------------------------------------------- batches
