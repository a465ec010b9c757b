"""The layers a worker keeps in place across a generation's entry (enter.py).

A layer the new plan gives a worker again stays: the module itself, or a deep copy when the
previous step was abandoned (its thread may still run and must not see the new generation's
tensors: `keep_layers`). With tensor parallelism the stage's layers are built again, sharded over
the new lanes, and this lane's shards of the kept layers, with their AdamW state, are copied in
(`copy_kept_shards`, `shard_of`). docs/recovery.md.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ...models import LayerModel
from ...models.tensor_parallel import from_full, local, wrap_like


def shard_of(layer: nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """This lane's part of `t` (a kept shard as it is; a whole tensor, e.g. of a layer built
    whole before the first generation, cut like parameter `name` of `layer`)."""
    return local(t) if isinstance(t, DTensor) else from_full(layer, name, t)


def copy_kept_shards(
    old: LayerModel, kept: list[int], target: LayerModel, old_state: dict[Any, dict[str, Any]]
) -> Iterator[tuple[nn.Parameter, dict[str, torch.Tensor]]]:
    """Copy this lane's shards of the kept layers into `target`'s (built and sharded for the new
    generation) and give their optimizer state, re-laid on the new lanes' mesh."""
    for i in kept:
        old_layer, new_layer = old.layers[i], target.layers[i]
        assert old_layer is not None and new_layer is not None
        for (_, p_old), (name, p_new) in zip(old_layer.named_parameters(), new_layer.named_parameters()):
            with torch.no_grad():
                local(p_new).copy_(shard_of(new_layer, name, p_old))
            if p_old in old_state:
                yield (
                    p_new,
                    {
                        k: v.clone() if k == "step" else wrap_like(p_new, shard_of(new_layer, name, v).clone())
                        for k, v in old_state[p_old].items()
                    },
                )


def keep_layers(
    old: LayerModel, kept: list[int], *, detach: bool
) -> tuple[dict[int, nn.Module], list[tuple[nn.Parameter, nn.Parameter]]]:
    """The kept layers for the next generation and (old, new) pairs of their parameters: the
    layers themselves, or copies after an abandoned step (`detach`: its thread may still run)."""
    layers: dict[int, nn.Module] = {}
    pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
    for i in kept:
        layer = old.layers[i]
        assert layer is not None
        new = copy.deepcopy(layer) if detach else layer
        layers[i] = new
        pairs += list(zip(layer.parameters(), new.parameters()))
    return layers, pairs
