"""Compiled layers: every kind of layer runs through its own compiled graphs, warmed before the
job counts on the worker, so reconfiguration never compiles.

Mechanism. A stage is `nn.Sequential(CompiledLayer(layer) for each layer)`, and
`CompiledLayer.forward` calls `run_layer(layer, x)`: the layer's forward graph, and backward graphs
split into the input gradient and the weight gradients (engine/step/split_graphs.py: AOTAutograd
traces the layer as a function of its parameters, buffers and input; engine/step/split_layer.py:
three autograd nodes per call, so that torch's split backward of a zero-bubble schedule runs the
input-gradient graph in its I pass and the weight-gradient graph in its W pass, and a whole
backward runs both once). Graphs are kept per kind of layer (`planning.profile.profiler.layer_kind`:
class, plain attributes, parameter shapes), input shape and autocast state, not per module object:
every decoder block of a model (the same class and shapes) runs the same compiled graphs, as with
torchtitan's per-block compilation, and so does a block received from another worker or rebuilt at
a new generation: a worker compiles each kind of layer (embedding, block, head) once, forward and
backward. The layers themselves are not changed (no `_orig_mod` in their names): checkpoints,
transfers and exports see plain modules. Without gradients (`torch.no_grad`) a layer runs eager.

Tensor-parallel layers (DTensor parameters, models/tensor_parallel.py) are not traced apart: they
run through one `torch.compile`d function that takes the layer as an input (the same sharing by
kind through dynamo's guards), one autograd node per layer, compiled without donated buffers so
that a split backward can keep its graph. Under zero-bubble such a layer runs its whole compiled
backward in both passes (the input-gradient pass drops the weight gradients, the weight-gradient
pass computes the input gradient again): no faster than 1F1B's backward twice, and untested (as
zero-bubble under tensor parallelism is, README's known limits).

Why split, for every schedule. A layer compiled whole (one `torch.compile`d call) is one autograd
node whose backward computes every gradient at once: torch's split backward then runs it twice
(the I pass drops the weight gradients it computed, the W pass computes the input gradient again),
and a compiled backward with donated buffers refuses the I pass's kept graph outright. The split
graphs run a whole backward at 0.91-0.96x the whole layer's speed on the CPU, and zero-bubble's
passes at 1.3-1.6x (bench/compile_split.py, bench/RESULTS.md); and one set of graphs serves
every schedule, so a re-plan that changes a pipeline's schedule compiles nothing either.

Warm-up (`warm_up`). Before a worker reports ready (engine/run.py), it builds one layer of every
kind of the model on its device, alone (a head's memory at most), and runs a forward and a backward
of one microbatch through `run_layer`, in the training precision; then it frees it. Graphs of
the kinds it does not hold yet are then ready when a re-plan gives it such layers: compilation
never happens on the recovery path. Kinds are `planning.profile.profiler.layer_kind` (class, plain
attributes, parameter shapes), the profiler's notion of identical layers.

Caches. Compiled code is cached per process; across processes inductor's FX-graph and autograd
caches (on by default) are kept in `TORCHINDUCTOR_CACHE_DIR`, which a worker sets, when it is not
set already, to `<data.cache_dir>/inductor`: a node that joins (or a worker restarted on the same
host, or any host sharing that directory) reuses the kernels compiled there and only traces.

`training.compile` decides: true, false, or unset = on for CUDA devices, off for the CPU (on the
CPU, compiled steps of a GPT-2 stage measured only ~5 % faster here, for 20-30 s of compilation
per worker on two cores; bench/gpu_mfu.py compares both).
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
    """`training.compile`, or when unset: on for CUDA, off for the CPU."""
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


def run_layer(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` through its kind's compiled graphs (module docstring); a tensor-parallel layer
    (DTensor parameters) through one whole-layer compiled function."""
    if not _sharded(layer):
        return run_split(layer, x)
    # the input-gradient pass of a split backward keeps the graph, which donated buffers forbid (read
    # when the forward compiles)
    with torch._functorch.config.patch(donated_buffer=False):
        return _compiled_whole()(layer, x)


class CompiledLayer(nn.Module):
    """Runs the wrapped layer through `run_layer`; the layer is a submodule, so the stage's
    parameters are the layer's own."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_layer(self.layer, x)


def compiled_stage(layers: Sequence[nn.Module]) -> nn.Sequential:
    """The stage's layers, each run compiled."""
    return nn.Sequential(*[CompiledLayer(layer) for layer in layers])


def use_cache_dir(cfg: JobConfig) -> str:
    """Point inductor's on-disk caches at `<data.cache_dir>/inductor` unless the environment already
    chose (TORCHINDUCTOR_CACHE_DIR); returns the directory in use."""
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
    """Compile every kind of layer of the model, forward and backward, on `device` (module
    docstring); returns the seconds it took."""
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
