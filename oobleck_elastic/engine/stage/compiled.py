"""Compiled layers: every kind of layer runs through its own compiled graphs, warmed before the
job counts on the worker (`warm_up`), so a reconfiguration never compiles.

A stage is `nn.Sequential(CompiledLayer(layer) ...)`; `run_layer` runs a layer's forward graph
and its backward split into input- and weight-gradient graphs (split_graphs.py, split_layer.py),
so one set of graphs serves every schedule, zero-bubble's I and W passes included. Graphs are
shared by kind of layer, not per module. `training.compile` decides (`compile_enabled`); the
on-disk caches live under `data.cache_dir` (`use_cache_dir`). docs/training.md, and
bench/RESULTS.md for what compiling buys.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ...config import JobConfig
from ...logs import JobLog
from ...models.recompute import recomputed
from .split_layer import run_split

__all__ = [
    "compile_enabled",
    "CompiledLayer",
    "compiled_stage",
    "run_layer",
    "warm_up",
    "use_cache_dir",
    "graphs_compiled",
]

log = JobLog(logging.getLogger(__name__))


def compile_enabled(cfg: JobConfig, device: torch.device) -> bool:
    """`training.compile`, or when unset: on for CUDA, off for the CPU (where compiled steps gain
    little for tens of seconds of compilation per worker: bench/RESULTS.md)."""
    if cfg.training.compile is not None:
        return bool(cfg.training.compile)
    return device.type == "cuda"


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (a recompilation adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _run_layer(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


@functools.cache
def _compiled_whole() -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    return torch.compile(_run_layer, dynamic=False)


def _sharded(layer: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in layer.parameters())


def run_layer(layer: nn.Module, x: torch.Tensor, *, recompute: bool = False) -> torch.Tensor:
    """`layer(x)` through its kind's compiled graphs, forward and split backward (split_layer.py),
    shared by every layer of the same kind (`planning.profile.profiler.layer_kind`: class, plain
    attributes, parameter shapes), input shape and autocast state, not per module object: a block
    received or rebuilt at a new generation compiles nothing. Without gradients it runs eager. A
    tensor-parallel layer (DTensor parameters) runs through one whole-layer compiled function
    (one autograd node: under zero-bubble its whole backward runs in both passes, untested).
    `recompute`: activation checkpointing (models/recompute.py; the split graphs replay their forward)."""
    if not _sharded(layer):
        return run_split(layer, x, recompute=recompute)
    # the input-gradient pass of a split backward keeps the graph, which donated buffers forbid (read
    # when the forward compiles)
    with torch._functorch.config.patch(donated_buffer=False):
        if recompute:
            return recomputed(lambda t: _compiled_whole()(layer, t), x)
        return _compiled_whole()(layer, x)


class CompiledLayer(nn.Module):
    """Runs the wrapped layer through `run_layer`; the layer is a submodule and is not changed (no
    `_orig_mod` in its names), so checkpoints, transfers and exports see plain modules."""

    def __init__(self, layer: nn.Module, *, recompute: bool = False) -> None:
        super().__init__()
        self.layer, self.recompute = layer, recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_layer(self.layer, x, recompute=self.recompute)


def compiled_stage(layers: Sequence[nn.Module], *, recompute: bool = False) -> nn.Sequential:
    """The stage's layers, each run compiled (`recompute`: activation checkpointing, models/recompute.py)."""
    return nn.Sequential(*[CompiledLayer(layer, recompute=recompute) for layer in layers])


def use_cache_dir(cfg: JobConfig) -> str:
    """Point inductor's on-disk caches at `<data.cache_dir>/inductor` unless the environment already
    chose (TORCHINDUCTOR_CACHE_DIR), so a node that joins (or any host sharing the directory)
    reuses the kernels compiled there and only traces; returns the directory in use."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    ours = str(Path(cfg.data.cache_dir).expanduser().resolve() / "inductor")
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # importing inductor writes its default into the environment: only a user's choice is kept
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = chosen = ours
    return chosen


def warm_up(
    cfg: JobConfig,
    *,
    device: torch.device,
    microbatch_size: int,
    seq_len: int,
    autocast: Optional[torch.dtype],
    node: str = "local",
) -> float:
    """Compile every kind of layer of the model, forward and backward, on `device`, before the
    worker reports ready: one layer of each kind built alone (a head's memory at most), one
    microbatch through it in the training precision, then freed; so a re-plan that gives this
    worker new kinds of layer compiles nothing on the recovery path. The seconds it took."""
    from ...models import build_layer_model, num_layers
    from ...models.build import build_meta_layers
    from ...planning.profile.profiler import layer_kind

    t0 = time.perf_counter()
    n = num_layers(cfg.model)
    meta = build_meta_layers(cfg.model, n, seed=cfg.training.seed)
    kinds: dict[Any, int] = {}
    for i, layer in enumerate(meta):
        kinds.setdefault(layer_kind(layer), i)
    del meta
    # the input of layer i: token ids for layer 0, else the previous layer's output on meta
    from .shapes import stage_io

    for i in sorted(kinds.values()):
        layer = build_layer_model(cfg.model, seed=cfg.training.seed, owned=[i], device=str(device)).held(i)
        if i == 0:
            x = torch.zeros((microbatch_size, seq_len), dtype=torch.int64, device=device)
        else:
            spec, _ = stage_io(
                cfg.model,
                seed=cfg.training.seed,
                start=i,
                end=i + 1,
                microbatch_size=microbatch_size,
                seq_len=seq_len,
                autocast=autocast,
            )
            x = torch.randn(spec.shape, dtype=spec.dtype, device=device, requires_grad=True)
        with torch.autocast(device_type=device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            out = run_layer(layer, x)
        out.float().sum().backward()
        del layer, x, out
    seconds = time.perf_counter() - t0
    log.at(node=node).info(
        "compiled %d kind(s) of layer (of %d layers), forward and backward, in %.1f s", len(kinds), n, seconds
    )
    return seconds
