"""The host side of the shadows' step traffic (shadows.py): a layer's gradients flattened into a
host buffer that lives for the generation (pinned and filled asynchronously on a side stream when
the layer is on CUDA), and the threads a keeper's AdamW runs on. Invariant: the flat layout is
the one the keeper reads (per parameter a presence flag, then its gradient as fp32), and a buffer
is written again only after the traffic that last read it has completed. docs/shadows.md tells
the data path ("The data path").
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from ...models import LayerModel

__all__ = [
    "THREADS_ENV",
    "FlatBuffer",
    "GradStaging",
    "fill_flat",
    "flat_numel",
    "host_buffer",
    "update_threads",
    "intra_op_threads",
]

THREADS_ENV = "OOBLECK_SHADOW_THREADS"
"""Threads a keeper's background AdamW update runs on (default: `update_threads`' choice)."""

MAX_UPDATE_THREADS = 4
"""The most threads `update_threads` picks: the worker's own host work keeps the rest."""


def flat_numel(layer: nn.Module) -> int:
    """Elements of `layer`'s flat gradients: per parameter one presence flag and its elements."""
    return sum(1 + p.numel() for p in layer.parameters())


def layer_device(layer: nn.Module) -> torch.device:
    """Where `layer`'s parameters live (the CPU for a layer without any)."""
    return next((p.device for p in layer.parameters()), torch.device("cpu"))


def host_buffer(numel: int, device: torch.device) -> torch.Tensor:
    """A flat fp32 host buffer for gradients that live on `device`: pinned (page-locked, so a
    device-to-host copy into it can run asynchronously) when `device` is CUDA, plain otherwise."""
    return torch.empty(numel, dtype=torch.float32, pin_memory=device.type == "cuda")


class FlatBuffer:
    """A layer's flat host buffer (`host_buffer`) and its views, made once: each parameter's
    slice (shaped like it) and the positions of the presence flags."""

    def __init__(self, layer: nn.Module, data: torch.Tensor) -> None:
        if data.numel() != flat_numel(layer) or data.dtype != torch.float32:
            raise ValueError(
                f"a buffer of {data.numel()} {data.dtype} for a layer of {flat_numel(layer)} fp32 elements"
            )
        self.data = data
        self.values: list[torch.Tensor] = []
        flags, offset = [], 0
        for p in layer.parameters():
            flags.append(offset)
            self.values.append(data[offset + 1 : offset + 1 + p.numel()].view(p.shape))
            offset += 1 + p.numel()
        self.flags = torch.tensor(flags, dtype=torch.long)

    def fill(self, layer: nn.Module, *, non_blocking: bool = False) -> torch.Tensor:
        """Write `layer`'s gradients (module docstring's layout): one multi-tensor copy of those
        present, zeros and flag 0 for a parameter without one (AdamW skips it, on the keeper too).
        `non_blocking` (a CUDA layer, a pinned buffer): the copies are queued on the current stream."""
        grads = [p.grad for p in layer.parameters()]
        present = [(view, g.detach()) for view, g in zip(self.values, grads) if g is not None]
        if present:
            torch._foreach_copy_([v for v, _ in present], [g for _, g in present], non_blocking=non_blocking)
        self.data.index_fill_(0, self.flags, 1.0)
        for i, g in enumerate(grads):
            if g is None:
                self.values[i].zero_()
                self.data[int(self.flags[i])] = 0.0
        return self.data


def fill_flat(layer: nn.Module, out: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
    """Write `layer`'s gradients into `out` (`flat_numel` fp32 elements): per parameter a presence
    flag (0: no gradient, then zeros), then the gradient (`FlatBuffer.fill`, views made anew)."""
    return FlatBuffer(layer, out).fill(layer, non_blocking=non_blocking)


class GradStaging:
    """A holder's host buffers of one generation (one per layer it sends, `host_buffer`), filled
    each step as the layers' gradients become final (`final`, from the gradient sums; `rest` for
    the others). On CUDA the copies run on a side stream that first waits for the stream the sums
    were written on, and `ready` waits for each layer's event before a send may read its buffer;
    on the CPU the copy is a plain one and `ready` has nothing to wait for. Only this class's
    `_copy` tells the devices apart."""

    def __init__(self, layers: list[int]) -> None:
        self.layers = sorted(set(layers))
        self.buffers: dict[int, FlatBuffer] = {}
        """Layer -> its host buffer (allocated at its first step, then reused)."""
        self.allocated = 0
        """Buffers allocated in this generation (one per layer unless a send was left in flight)."""
        self.seconds = 0.0
        """Seconds the last step spent filling the buffers (the shadows' share of the step)."""
        self._layer_model: Optional[LayerModel] = None
        self._copied: set[int] = set()
        self._final: set[int] = set()  # ids of the parameters whose sums are written this step
        self._events: dict[int, "torch.cuda.Event"] = {}
        self._streams: dict[torch.device, "torch.cuda.Stream"] = {}

    def begin(self, layer_model: LayerModel, *, in_flight: bool) -> Callable[[list[torch.Tensor]], None]:
        """Start a step; `in_flight`: the previous step's sends may still read the buffers, which
        are then replaced (the old ones stay with those sends). Returns `final`."""
        if in_flight:
            self.buffers = {}
        self._layer_model = layer_model
        self._copied, self._final, self._events = set(), set(), {}
        self.seconds = 0.0
        return self.final

    @property
    def copied(self) -> set[int]:
        """The layers whose copies this step has started."""
        return set(self._copied)

    def begun(self, layer_model: LayerModel) -> bool:
        """A step over `layer_model` has begun and not ended."""
        return self._layer_model is layer_model

    def end(self) -> None:
        """The step's buffers are handed to its sends: the next step begins anew."""
        self._layer_model = None

    def final(self, params: list[torch.Tensor]) -> None:
        """`params`' summed gradients are written (GradSync.all_reduce): copy every layer whose
        parameters are all final now."""
        assert self._layer_model is not None, "begin the step first"
        self._final.update(id(p) for p in params)
        done = [
            layer
            for layer in self.layers
            if layer not in self._copied
            and all(id(p) in self._final for p in self._layer_model.held(layer).parameters())
        ]
        if done:
            self._copy(done)

    def rest(self) -> None:
        """Copy the layers not copied yet (their gradients are final once the sums returned)."""
        self._copy([layer for layer in self.layers if layer not in self._copied])

    def ready(self) -> dict[int, torch.Tensor]:
        """Wait until every copy has landed (CUDA events; nothing on the CPU); layer -> buffer."""
        began = time.perf_counter()
        for event in self._events.values():
            event.synchronize()
        self.seconds += time.perf_counter() - began
        return {layer: self.buffers[layer].data for layer in self.layers}

    def _copy(self, layers: list[int]) -> None:
        assert self._layer_model is not None, "begin the step first"
        began = time.perf_counter()
        for layer in layers:
            module = self._layer_model.held(layer)
            device = layer_device(module)
            if layer not in self.buffers:
                self.buffers[layer] = FlatBuffer(module, host_buffer(flat_numel(module), device))
                self.allocated += 1
            if device.type == "cuda":  # the device-specific part: an async copy on a side stream
                # (it has not run on a GPU yet: the tests run on the CPU, docs/shadows.md)
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))  # after the sums were written
                with torch.cuda.stream(stream):
                    self.buffers[layer].fill(module, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                self._events[layer] = event
            else:
                self.buffers[layer].fill(module)
            self._copied.add(layer)
        self.seconds += time.perf_counter() - began


def update_threads(cpus: int, local_workers: int, override: Optional[str] = None) -> int:
    """Threads a keeper's AdamW update runs on: `override` (`THREADS_ENV`) when set, else half
    this worker's share of the node's `cpus` among its `local_workers` (the other half for its own
    host work), at most `MAX_UPDATE_THREADS` and at least 1. Its result does not depend on the
    count (the fused CPU AdamW is elementwise); its speed does, badly when cores are shared."""
    if override is not None and override.strip():
        text = override.strip()
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{THREADS_ENV}={override!r}: must be a whole number of threads >= 1, e.g. 2")
        return int(text)
    return max(1, min(MAX_UPDATE_THREADS, cpus // max(1, local_workers) // 2))


def default_update_threads() -> int:
    """`update_threads` for this process: its CPUs, torchrun's LOCAL_WORLD_SIZE, `THREADS_ENV`."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return update_threads(cpus, int(local) if local.isdigit() else 1, os.environ.get(THREADS_ENV))


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Run torch's CPU kernels of the calling thread on `n` threads, then restore the count. With
    OpenMP the count is the calling thread's own; torch also keeps it as the default of threads
    started meanwhile, which the restore ends."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
