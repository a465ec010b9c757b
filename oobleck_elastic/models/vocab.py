"""A padded vocabulary: the embedding and LM-head matrices get `model.pad_vocab_to`-aligned rows.

GPU matrix kernels run fastest on dimensions that are multiples of 64 (GPT-2's 50,257 tokens run
as 50,304, as nanoGPT and llm.c do). The rows past the real vocabulary are padding: built as
zeros, never looked up (token ids are below the real vocabulary), cut out of the loss (the loss
reads the first `vocab_size` logits), so their gradient is zero and AdamW leaves
them zero. A worker holds them; what leaves a worker does not: checkpoints (the trainer's
`state_dict`) and Hugging Face exports hold the real rows only, and loading pads again.
The story: docs/training.md.
"""

from __future__ import annotations

import torch

__all__ = ["padded_vocab_size", "is_vocab_param", "pad_rows", "unpad_rows"]

_VOCAB_PARAMS = ("wte.weight", "embed_tokens.weight", "lm_head.weight", "lm_head.bias")


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """`vocab_size` rounded up to a multiple of `multiple` (1 = unchanged)."""
    return -(-vocab_size // multiple) * multiple if multiple > 1 else vocab_size


def is_vocab_param(name: str) -> bool:
    """Whether a layer's parameter `name` has one row per token (embedding, LM head)."""
    return name.endswith(_VOCAB_PARAMS)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with zero rows appended up to `rows` (t itself when it has them already)."""
    if t.shape[0] >= rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def unpad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The first `rows` rows of `t`."""
    return t[:rows] if t.shape[0] > rows else t
