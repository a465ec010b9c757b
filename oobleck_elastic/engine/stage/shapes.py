"""Stage input/output shapes known in advance, so pipeline stages never exchange pickled metadata.

`torch.distributed.pipelining.PipelineStage` needs the shape, stride, dtype and requires_grad of
what a stage receives and sends. Without `input_args`/`output_args` it learns them at the first
step ("dynamic" mode): every stage runs a forward on its input and sends the result's metadata to
the next stage, and its gradient metadata back, as pickled Python objects (`send_object_list` /
`recv_object_list`). Unpickling what a peer sent runs code chosen by that peer, so we give both
and the stage runs in "static" mode: the schedule's warm-up only passes a one-element int32 vote
down the pipeline and its result back (plain tensor send/recv), then allocates receive buffers
from our metadata. Gradient metadata is derived from the activations' (same shape, stride and dtype).

`stage_io` computes that metadata locally and deterministically, without weights or
communication: it builds layers 0..end-1 on the meta device (`build_meta_layers`) and runs a meta
tensor through them. Every stage derives its input from the same chain its predecessor derives
its output from, so both ends of every link agree by construction:

- layer 0 takes token ids, int64 `(microbatch_size, seq_len)`, which need no gradient;
- a stage boundary carries what `trainer.Autocast` returns: the last layer's output as is in
  fp32, `.float()` of it under bf16 autocast (activations cross stages in float32);
- the last layer returns the logits `(microbatch_size, seq_len, vocab)`, in bf16 under bf16
  autocast (the loss upcasts them chunk by chunk);
- requires_grad follows the chain (a boundary requires grad iff it depends on a trainable
  parameter); it must, or a stage would wait for a gradient its successor never sends.

Static mode trusts this metadata: receive buffers are allocated from it and nothing is checked
unless `TORCH_DISTRIBUTED_DEBUG=DETAIL` (then every stage's real inputs and outputs are compared
with it), so a wrong guess would show up as a failed receive, a hang or wrong data.
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
    matters for custom factories, which are built as `build_layer_model` builds them.
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
