"""The training loss: token cross-entropy summed over a microbatch and divided by the tokens of
the global batch, over the real vocabulary only (padded rows get no gradient).

Invariant: the sum of every microbatch's, stage's and replica's gradients is the gradient of the
mean loss over the global batch, whatever the plan (docs/design.md, invariant 1). Under bf16 the
logits stay bf16 and `ChunkedCrossEntropy` upcasts them a chunk of `CHUNK_TOKENS` at a time,
writing their gradient in the forward (no fp32 copy of a microbatch's logits). docs/training.md.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["CHUNK_TOKENS", "ChunkedCrossEntropy", "token_sum_loss"]

CHUNK_TOKENS = 2048
"""Tokens per fp32 chunk of the bf16 loss (a 50k vocabulary: 0.4 GB of fp32 per chunk)."""


class ChunkedCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross-entropy(logits[t, :vocab], labels[t]) × scale, labels -100 ignored,
    with the gradient computed chunk by chunk in the forward: each chunk of `CHUNK_TOKENS` is upcast
    to fp32, its loss summed and its gradient (softmax - one-hot, times the scale) written in bf16
    straight into the logits' gradient; the backward only scales it. Beyond the bf16 logits it
    holds their bf16 gradient and one fp32 chunk, not fp32 copies of the whole microbatch's."""

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, labels: torch.Tensor, vocab: int, scale: float, chunk: int = CHUNK_TOKENS
    ) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        targets = labels.reshape(-1)
        grad = torch.zeros_like(flat)
        total = torch.zeros((), dtype=torch.float32, device=flat.device)
        for i in range(0, flat.shape[0], chunk):
            z = flat[i : i + chunk, :vocab].float()
            t = targets[i : i + chunk]
            valid = t != -100
            safe = t.clamp(min=0)
            lse = torch.logsumexp(z, dim=-1)
            total += ((lse - z.gather(1, safe[:, None])[:, 0]) * valid).sum()
            z.sub_(lse[:, None]).exp_()  # softmax, in place
            z.scatter_add_(1, safe[:, None], -valid[:, None].to(z.dtype))
            z.mul_((valid.to(z.dtype) * scale)[:, None])
            grad[i : i + chunk, :vocab] = z
        ctx.save_for_backward(grad)
        ctx.shape = logits.shape
        return total * scale

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return (grad * grad_output.to(grad.dtype)).view(ctx.shape), None, None, None, None


def token_sum_loss(
    global_tokens: int, *, vocab_size: int | None = None, lean_bf16: bool = False
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """loss_fn(logits, labels) = sum of token cross-entropies over the first `vocab_size` logits
    (all when None) / global_tokens; `lean_bf16`: bf16 logits go through ChunkedCrossEntropy."""

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        vocab = vocab_size or logits.shape[-1]
        if lean_bf16 and logits.dtype == torch.bfloat16:
            return ChunkedCrossEntropy.apply(logits, labels, vocab, 1.0 / global_tokens)
        if vocab < logits.shape[-1]:
            logits = logits[..., :vocab]
        return (
            F.cross_entropy(logits.reshape(-1, vocab).float(), labels.reshape(-1), ignore_index=-100, reduction="sum")
            / global_tokens
        )

    return loss_fn
