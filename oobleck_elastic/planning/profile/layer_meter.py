"""Measure one layer on one input: its times (forward, backward, the backward's zero-bubble split) and
its exact byte counts.

`LayerMeter.measure` times `warmup` untimed and `repeats` timed iterations and keeps the medians:
on the CPU with `time.perf_counter`, on CUDA with CUDA events around the kernels. The split runs
torch's `stage_backward_input` (I) then `stage_backward_weight` (W). Bytes are exact counts:
parameter storages once each, gradients, optimizer state (AdamW: two moments), the activations
autograd saves (`saved_tensors_hooks`, deduplicated by storage), those it saves with the layer
recomputed (`training.activation_checkpoint`), and the output. docs/planning.md.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from ...models.recompute import Recomputed
from ...models.tensor_parallel import local
from .profile import LayerProfile

__all__ = ["LayerMeter", "check_settings"]

_OPTIMIZER_STATES = {"adamw": 2, "sgd": 0}


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    t = local(t)  # a tensor-parallel parameter: this device's shard
    return (str(t.device), t.untyped_storage().data_ptr())


def _param_bytes(layer: nn.Module) -> int:
    seen: dict[tuple[str, int], int] = {}
    for p in layer.parameters():
        seen.setdefault(_storage_key(p), local(p).untyped_storage().nbytes())
    return sum(seen.values())


class _SavedTensorMeter:
    """Pack hook that adds up the storages autograd saves, skipping parameter storages."""

    def __init__(self, exclude: set[tuple[str, int]]) -> None:
        self.exclude = exclude
        self.seen: dict[tuple[str, int], int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            key, size = _storage_key(t), t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            key, size = ("id", id(t)), t.numel() * t.element_size()
        if key not in self.exclude:
            self.seen.setdefault(key, size)
        # Not `t` itself: a saved output would then hold its own grad_fn, a cycle through C++ that
        # gc cannot break, and the graph with every saved tensor (parameters included) would leak.
        return t.detach()

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.seen.values())


class LayerMeter:
    """Times one layer on one input and counts its bytes (see the module docstring)."""

    def __init__(
        self,
        labels: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        device: torch.device,
        warmup: int,
        repeats: int,
        optimizer: str,
        precision: str,
    ) -> None:
        self.labels, self.loss_fn, self.device = labels, loss_fn, device
        self.warmup, self.repeats, self.optimizer, self.precision = warmup, repeats, optimizer, precision
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def autocast(self) -> Any:
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(self, layer: nn.Module, x: torch.Tensor, last: bool) -> tuple[torch.Tensor, torch.Tensor]:
        _, out, target = self.forward_from(layer, x, last)
        return out, target

    def forward_from(
        self, layer: nn.Module, x: torch.Tensor, last: bool, *, through_view: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the input, the layer's output, what backward starts from). `through_view`: the layer
        gets a view of the input, not the leaf itself (module backward hooks, such as those of
        torch's FlopCounterMode, refuse a leaf input under torch.autograd.grad)."""
        inp = x.detach()
        if inp.is_floating_point():
            inp.requires_grad_(True)
        with self.autocast():
            out = layer(inp.view_as(inp) if through_view and inp.requires_grad else inp)
            target = self.loss_fn(out, self.labels) if last else out
        return inp, out, target

    def timed_split(self, layer: nn.Module, x: torch.Tensor, last: bool) -> tuple[float, float]:
        """(input-gradient, weight-gradient) seconds of one backward split as torch's zero-bubble
        stages run it: `stage_backward_input` (the input's gradient, keeping the gradients of the
        intermediates the weights need), then `stage_backward_weight` (the weights' gradients
        from those). A layer whose input takes no gradient (token ids) has none: its whole
        backward is weight gradient."""
        inp, out, target = self.forward_from(layer, x, last, through_view=True)
        if target._is_view():  # stage_backward_input detaches it in place, which a view refuses
            target = target.clone()
        grad = None if last else torch.randn_like(out)
        params = list(layer.parameters())
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if self.cuda else []

        def mark(k: int) -> float:
            if self.cuda:
                marks[k].record()
                return 0.0
            return time.perf_counter()

        split = target.requires_grad and inp.requires_grad
        t0 = mark(0)
        if split:
            _, groups = stage_backward_input([target], None if grad is None else [grad], [inp], iter(params))
        t1 = mark(1)
        if split:
            stage_backward_weight(iter(params), groups)
        elif target.requires_grad:
            target.backward(grad)
        t2 = mark(2)
        if self.cuda:
            marks[2].synchronize()
            t0, t1, t2 = 0.0, marks[0].elapsed_time(marks[1]) / 1e3, marks[0].elapsed_time(marks[2]) / 1e3
        del out, target, grad, inp
        for p in params:
            p.grad = None
        return (t1 - t0 if split else 0.0), t2 - t1

    def timed_iteration(self, layer: nn.Module, x: torch.Tensor, last: bool) -> tuple[float, float]:
        """(forward, backward) seconds of one iteration of `layer` on input `x`."""
        if self.cuda:
            fwd0, fwd1, bwd0, bwd1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
            fwd0.record()
            out, target = self.forward(layer, x, last)
            fwd1.record()
            grad = None if last else torch.randn_like(out)
            bwd0.record()
            if target.requires_grad:
                target.backward(grad)
            bwd1.record()
            bwd1.synchronize()
            fwd_s, bwd_s = fwd0.elapsed_time(fwd1) / 1e3, bwd0.elapsed_time(bwd1) / 1e3
        else:
            t0 = time.perf_counter()
            out, target = self.forward(layer, x, last)
            t1 = time.perf_counter()
            grad = None if last else torch.randn_like(out)
            t2 = time.perf_counter()
            if target.requires_grad:
                target.backward(grad)
            t3 = time.perf_counter()
            fwd_s, bwd_s = t1 - t0, t3 - t2
        del out, target, grad
        for p in layer.parameters():
            p.grad = None
        return fwd_s, bwd_s

    def measure(
        self, layer: nn.Module, x: torch.Tensor, *, last: bool, name: str, on_run: Callable[[], None] | None = None
    ) -> tuple[LayerProfile, torch.Tensor]:
        """The layer's profile on input `x`, and its output (detached: the next layer's input);
        `on_run` is called after each of the warmup + repeats runs (progress)."""
        fwd_times, bwd_times, input_times, weight_times = [], [], [], []
        for it in range(self.warmup + self.repeats):
            fwd_s, bwd_s = self.timed_iteration(layer, x, last)
            input_s, weight_s = self.timed_split(layer, x, last)
            if on_run is not None:
                on_run()
            if it >= self.warmup:
                fwd_times.append(fwd_s)
                bwd_times.append(bwd_s)
                input_times.append(input_s)
                weight_times.append(weight_s)
        meter = _SavedTensorMeter({_storage_key(p) for p in layer.parameters()})
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            out, target = self.forward(layer, x, last)
        out = out.detach()
        del target  # frees the graph: only the output tensor is kept
        pbytes = _param_bytes(layer)
        fwd_s, bwd_s = statistics.median(fwd_times), statistics.median(bwd_times)
        prof = LayerProfile(
            name=name,
            forward_s=fwd_s,
            backward_s=bwd_s,
            input_grad_s=statistics.median(input_times),
            weight_grad_s=statistics.median(weight_times),
            param_bytes=pbytes,
            grad_bytes=pbytes,
            optimizer_bytes=_OPTIMIZER_STATES[self.optimizer] * pbytes,
            activation_bytes=meter.nbytes,
            output_bytes=out.numel() * out.element_size(),
            # under recomputation the backward replays the forward once: derived, not timed
            recomputed_backward_s=bwd_s + fwd_s,
            recomputed_activation_bytes=self.recomputed_bytes(layer, x, last),
        )
        return prof, out

    def recomputed_bytes(self, layer: nn.Module, x: torch.Tensor, last: bool) -> int:
        """What `layer` keeps for the backward when recomputed (models/recompute.py), counted on one
        forward: its own saved tensors escape the meter (the recomputation's hooks are innermost),
        so the meter sees what is saved outside it (the last layer's loss), plus its input and
        random state."""
        meter = _SavedTensorMeter({_storage_key(p) for p in layer.parameters()})
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            inp, _, target = self.forward_from(Recomputed(layer), x, last)
        del target
        return meter.nbytes + Recomputed.kept_bytes(inp)


def check_settings(optimizer: str, warmup: int, repeats: int, precision: str) -> None:
    """Refuse settings a `LayerMeter` cannot measure with: a ValueError naming the one to change."""
    if optimizer not in _OPTIMIZER_STATES:
        raise ValueError(f"optimizer '{optimizer}' unknown; choose one of {', '.join(_OPTIMIZER_STATES)}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision '{precision}' unknown; choose fp32 or bf16")
