"""Stage input and output shapes known in advance (`stage_io`), so pipeline stages never exchange
pickled metadata.

Without `input_args`/`output_args`, a torch `PipelineStage` learns its shapes at the first step by
sending pickled objects between stages, and unpickling what a peer sent runs code it chose. Given
both, the stage runs in "static" mode and trusts them (nothing is checked unless
`TORCH_DISTRIBUTED_DEBUG=DETAIL`). Invariant: both ends of every link derive the same metadata,
locally and deterministically, without weights or communication. docs/schedules.md.
"""

from __future__ import annotations

import torch
from torch import nn

from ...config import ModelConfig
from ...models.build import build_meta_layers, num_layers

__all__ = ["stage_io"]


def _boundary(x: torch.Tensor, autocast: torch.dtype | None, *, last: bool = False) -> torch.Tensor:
    """What `Autocast` hands on at a stage boundary (`last`: the model's output), as a fresh meta
    leaf (no autograd history)."""
    if autocast is not None and x.is_floating_point():
        x = x.to(autocast) if last else x.float()
    leaf = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return leaf.requires_grad_(x.requires_grad) if x.is_floating_point() else leaf


def _run(layer: nn.Module, index: int, x: torch.Tensor) -> torch.Tensor:
    try:
        out = layer(x)
    except Exception as err:
        raise RuntimeError(
            f"layer {index} ({type(layer).__name__}) cannot run on the meta device: {err}. Stage shapes "
            "are computed by running meta copies of the layers before the stage; make its forward "
            "device-agnostic (no .item(), .tolist() or data-dependent shapes, no tensors created on a "
            "fixed device)"
        ) from err
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"layer {index} ({type(layer).__name__}) returned {type(out).__name__}; a pipeline "
            "layer must map one tensor to one tensor"
        )
    return out


def stage_io(
    model_cfg: ModelConfig,
    *,
    seed: int,
    start: int,
    end: int,
    microbatch_size: int,
    seq_len: int,
    autocast: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta tensors (input of layer `start`, output of layer `end - 1`) of the stage holding layers
    [start, end), for one microbatch of `microbatch_size` sequences of `seq_len` tokens.

    `autocast` is the stage's `Autocast` dtype (None for fp32, torch.bfloat16 for bf16). `seed` only
    matters for custom factories, which are built as `build_layer_model` builds them. Layers
    0..end-1 are built on the meta device and a meta tensor runs through them, so every stage
    derives its input from the chain its predecessor derives its output from: layer 0 takes int64
    token ids (no gradient); a boundary carries what `Autocast` returns (float32 activations);
    the last layer returns the logits, bf16 under bf16 autocast; requires_grad follows the chain
    (or a stage would wait for a gradient its successor never sends).
    """
    if not 0 <= start < end:
        raise ValueError(f"stage layer range [{start}, {end}) is empty or negative: give 0 <= start < end")
    if microbatch_size < 1 or seq_len < 1:
        raise ValueError(f"microbatch_size ({microbatch_size}) and seq_len ({seq_len}) must be positive")
    layers = build_meta_layers(model_cfg, end, seed=seed)
    x = torch.empty((microbatch_size, seq_len), dtype=torch.int64, device="meta")
    inputs = x
    with torch.enable_grad():  # so that requires_grad propagates as it does in training
        for i, layer in enumerate(layers):
            if i == start and i > 0:
                x = inputs = _boundary(x, autocast)
            x = _run(layer, i, x)
    return inputs, _boundary(x, autocast, last=end == num_layers(model_cfg))
