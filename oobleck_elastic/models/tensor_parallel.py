"""Tensor parallelism inside a node: a stage's layers sharded over its lanes with DTensor.

Decoder blocks are sharded Megatron-style; the embedding and the head are replicated.
Invariant: checkpoints and state dicts always hold the full Hugging Face layout, whatever the
degree. The story: docs/training.md.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from .layers import GPT2BlockLayer, RopeDecoderLayer

__all__ = [
    "Conv1DColwise",
    "Conv1DRowwise",
    "check_tensor_parallel",
    "parallelize_layer",
    "to_full",
    "from_full",
    "wrap_like",
    "local",
    "is_sharded",
]

_QKV = "_oobleck_qkv_perm"


def _register(module: nn.Module, name: str, tensor: torch.Tensor, mesh: DeviceMesh, placement: Any) -> None:
    module.register_parameter(
        name,
        nn.Parameter(
            distribute_tensor(tensor, mesh, [placement], src_data_rank=None), requires_grad=tensor.requires_grad
        ),
    )


class Conv1DColwise(ColwiseParallel):
    """`ColwiseParallel` for Hugging Face `Conv1D` (weight [in, out]): weight Shard(1), bias Shard(0)."""

    def _partition(self, name: str, module: Any, mesh: DeviceMesh) -> None:  # a transformers Conv1D
        _register(module, "weight", module.weight, mesh, Shard(1))
        _register(module, "bias", module.bias, mesh, Shard(0))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Conv1DRowwise(RowwiseParallel):
    """`RowwiseParallel` for Hugging Face `Conv1D`: weight Shard(0), bias replicated."""

    def _partition(self, name: str, module: Any, mesh: DeviceMesh) -> None:  # a transformers Conv1D
        _register(module, "weight", module.weight, mesh, Shard(0))
        _register(module, "bias", module.bias, mesh, Replicate())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


def check_tensor_parallel(config: Any, tp: int) -> None:
    """Raise ValueError when a Hugging Face config's heads or widths do not split over `tp` lanes."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    inter = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * config.hidden_size
    bad = [
        f"{what} ({n})"
        for what, n in (("model.num_heads", heads), ("model.num_kv_heads", kv), ("model.intermediate_size", inter))
        if n is not None and n % tp
    ]
    if bad:
        raise ValueError(
            f"planning.tensor_parallel={tp} must divide {', '.join(bad)}: each lane takes an equal share "
            "of the heads and of the MLP width; choose a degree that divides them"
        )


def _qkv_permutation(hidden: int, tp: int) -> torch.Tensor:
    """Column order putting lane r's query, key and value columns together, lane after lane."""
    width = hidden // tp
    return torch.cat(
        [
            torch.arange(part * hidden + r * width, part * hidden + (r + 1) * width)
            for r in range(tp)
            for part in range(3)
        ]
    )


def parallelize_layer(layer: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard one flat layer over the lanes of `mesh` in place (blocks only; embedding and head
    stay replicated). The layer must hold its full weights, the same on every lane."""
    tp = mesh.size()
    if tp == 1:
        return layer
    if isinstance(layer, GPT2BlockLayer):
        block = layer.block
        attn = block.attn
        check_tensor_parallel(attn.config, tp)
        perm = _qkv_permutation(attn.embed_dim, tp)
        with torch.no_grad():
            attn.c_attn.weight.copy_(attn.c_attn.weight[:, perm])
            attn.c_attn.bias.copy_(attn.c_attn.bias[perm])
        setattr(attn.c_attn, _QKV, perm)
        parallelize_module(
            block,
            mesh,
            {
                "attn.c_attn": Conv1DColwise(),
                "attn.c_proj": Conv1DRowwise(),
                "mlp.c_fc": Conv1DColwise(),
                "mlp.c_proj": Conv1DRowwise(),
            },
            src_data_rank=None,
        )
        attn.split_size = attn.embed_dim // tp
        attn.num_heads = attn.num_heads // tp
    elif isinstance(layer, RopeDecoderLayer):
        inner = layer.layer
        check_tensor_parallel(inner.self_attn.config, tp)
        parallelize_module(
            inner,
            mesh,
            {
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            },
            src_data_rank=None,
        )
    return layer


def local(t: torch.Tensor) -> torch.Tensor:
    """This lane's part of a tensor (itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def is_sharded(p: torch.Tensor) -> bool:
    """Whether each lane holds only a part of `p` (a DTensor with a Shard placement)."""
    return isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)


def _owner(layer: nn.Module, name: str) -> nn.Module:
    path, _, _ = name.rpartition(".")
    return layer.get_submodule(path) if path else layer


def to_full(layer: nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """The full tensor, in the Hugging Face layout, of parameter `name` of `layer` or of an
    optimizer state laid out like it (all lanes of the stage call this together)."""
    if not isinstance(t, DTensor):
        return t
    full = t.full_tensor()
    perm = getattr(_owner(layer, name), _QKV, None)
    if perm is not None:
        full = full[..., torch.argsort(perm).to(full.device)]
    return full


def from_full(layer: nn.Module, name: str, value: torch.Tensor) -> torch.Tensor:
    """This lane's shard of a full (Hugging Face layout) value of parameter `name` of `layer`."""
    p = layer.get_parameter(name)
    if not isinstance(p, DTensor):
        return value
    perm = getattr(_owner(layer, name), _QKV, None)
    if perm is not None:
        value = value[..., perm.to(value.device)]
    mesh = p.device_mesh
    for placement in p.placements:
        if isinstance(placement, Shard):
            value = value.chunk(mesh.size(), dim=placement.dim)[mesh.get_local_rank()]
    return value.contiguous()


def wrap_like(p: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """`shard` (this lane's part) as a tensor laid out like parameter `p` (a DTensor if p is one)."""
    if not isinstance(p, DTensor):
        return shard
    return DTensor.from_local(shard, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
