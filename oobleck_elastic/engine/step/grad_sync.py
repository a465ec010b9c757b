"""The exact cross-replica gradient sum, started while the pipeline still runs (`GradSync`), and
`synchronise`: the sums, then one SUM all-reduce of the squared global norm and the loss.

Invariant: every layer's gradient is SUM-reduced among exactly its holders (one stage of every
pipeline; groups by holder set: engine/entry/groups.py), tied parameters over the union of their
holders, each rank's copy once; nothing is applied before the commit (engine/step/commit.py).
The norm and loss all-reduce is the step's one host read; the gradients for shadow copies
arrive before it returns (shadows.py). docs/training.md tells the overlap.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...models import LayerModel
from ...models.tensor_parallel import is_sharded, local, wrap_like
from ..resilience.progress import STEP_PROGRESS, Progress

if TYPE_CHECKING:
    from ..entry.groups import GenerationGroups
    from .shadows import ShadowLink, ShadowStore

__all__ = ["GradSync", "Synchronised", "synchronise"]


def _params_of(module: nn.Module, exclude: set[int]) -> list[torch.Tensor]:
    return [p for p in module.parameters() if id(p) not in exclude and p.requires_grad]


class GradSync:
    """Buckets this rank's gradients by holder set and all-reduces them (SUM), each layer's as
    soon as it is final: a post-accumulate hook counts each parameter's accumulations, and a layer
    accumulated `microbatches` times is flattened and its all-reduce posted (`async_op=True`);
    a split backward (zero-bubble) reports its W passes instead (`weight_pass`). Each holder set
    posts its layers highest first, so every member posts them in the same order (a final layer
    waits for the higher ones). The hooks are armed by `begin_step` and disarmed by `all_reduce`
    or `close`, so an abandoned step's thread never posts a collective. `all_reduce` posts what
    is left (tied parameters, parameters without a gradient) and waits: each posted layer's
    gradients are views of the buffer its all-reduce sums in place."""

    def __init__(self, groups: GenerationGroups, layer_model: LayerModel, owned: Iterable[int]) -> None:
        self.groups = groups
        self.owned = sorted(owned)
        holders = groups.holders
        tied_ids: set[int] = set()
        self.tied: list[tuple[list[torch.Tensor], tuple[int, ...]]] = []
        for members, ranks in holders.tied:
            params = {}
            for li, name in members:
                layer = layer_model.layers[li]
                if li in self.owned and layer is not None:
                    p = layer.get_parameter(name)
                    params[id(p)] = p
            tied_ids |= set(params)
            if params:
                self.tied.append((list(params.values()), ranks))
        self.tied_ids = tied_ids
        self.layer_params: dict[int, list[torch.Tensor]] = {}
        buckets: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for li in self.owned:
            layer = layer_model.layers[li]
            assert layer is not None, f"layer {li} is not built on rank {groups.rank}"
            self.layer_params[li] = _params_of(layer, tied_ids)
            buckets.setdefault(holders.layer[li], []).extend(self.layer_params[li])
        order = {s: i for i, s in enumerate(holders.group_sets())}
        self.buckets = sorted(buckets.items(), key=lambda kv: order.get(kv[0], -1))
        # per holder set shared with another rank: its layers in posting order, highest first
        self.sequence: dict[tuple[int, ...], list[int]] = {}
        for li in sorted(self.owned, reverse=True):
            ranks = holders.layer[li]
            if len(ranks) > 1 and self.layer_params[li]:
                self.sequence.setdefault(ranks, []).append(li)
        self._set_of = {li: ranks for ranks, layers in self.sequence.items() for li in layers}
        self._layer_of = {id(p): li for li in self._set_of for p in self.layer_params[li]}
        self._lock = threading.Lock()
        self._armed = False
        self._expected = 0
        self._counts: dict[int, int] = {}
        self._missing: dict[int, int] = {}
        self._next: dict[tuple[int, ...], int] = {}
        self._final: set[int] = set()
        self._w_counts: dict[tuple[int, int], int] = {}  # a virtual stage's W passes in the step
        self._posted: list[tuple[list[torch.Tensor], Any]] = []
        self.posted_early = 0
        """Layers whose reduction the last step posted during its schedule (the overlap's measure)."""
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._accumulated)
            for li in self._set_of
            for p in self.layer_params[li]
        ]

    # ------------------------------------------------------------------ overlap
    def begin_step(self, microbatches: int) -> None:
        """Arm the hooks for a step of `microbatches` microbatches on this stage."""
        with self._lock:
            self._expected = microbatches
            self._counts = {id(p): 0 for li in self._set_of for p in self.layer_params[li]}
            self._missing = {li: len(self.layer_params[li]) for li in self._set_of}
            self._next = {ranks: 0 for ranks in self.sequence}
            self._final = set()
            self._w_counts = {}
            self._posted = []
            self._armed = microbatches > 0

    def close(self) -> None:
        """Disarm and remove the hooks (the generation ends, or its step was abandoned)."""
        with self._lock:
            self._armed = False
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def weight_pass(self, layers: range) -> None:
        """A split backward's W pass over `layers` (one virtual stage) ran for one microbatch; after
        the step's last one their gradients are final, although no hook saw them (the W pass
        assigns them): they are posted then."""
        with self._lock:
            if not self._armed:
                return
            key = (layers.start, layers.stop)
            self._w_counts[key] = self._w_counts.get(key, 0) + 1
            if self._w_counts[key] != self._expected:
                return
            touched = set()
            for li in layers:
                if li in self._set_of and li not in self._final:
                    self._final.add(li)
                    touched.add(self._set_of[li])
            for ranks in self.sequence:
                if ranks in touched:
                    self._post_ready(ranks)

    def _accumulated(self, p: torch.Tensor) -> None:
        with self._lock:
            if not self._armed:
                return
            key = id(p)
            self._counts[key] += 1
            if self._counts[key] != self._expected:
                return
            li = self._layer_of[key]
            self._missing[li] -= 1
            if self._missing[li]:
                return
            self._final.add(li)
            self._post_ready(self._set_of[li])

    def _post_ready(self, ranks: tuple[int, ...], *, all_left: bool = False) -> None:
        """Post this set's layers in order while the next one is final (or all that are left)."""
        layers = self.sequence[ranks]
        while self._next[ranks] < len(layers) and (all_left or layers[self._next[ranks]] in self._final):
            self._post(self.layer_params[layers[self._next[ranks]]], ranks)
            self._next[ranks] += 1

    def _post(self, params: list[torch.Tensor], ranks: tuple[int, ...]) -> None:
        """Flatten the final gradients of `params` into one buffer, make each parameter's gradient
        a view of it, and post its all-reduce: the sums land in the views in place, and the
        gradients as accumulated are freed now, so the step holds one copy of each gradient (as
        the memory model counts it), not a flat copy beside it until the write-back."""
        grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        offset = 0
        for p, g in zip(params, grads):
            p.grad = wrap_like(p, flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        self._posted.append((params, dist.all_reduce(flat, group=self.groups.sets[ranks], async_op=True)))

    # ------------------------------------------------------------------ after the schedule
    def all_reduce(self, on_final: Optional[Callable[[list[torch.Tensor]], None]] = None) -> None:
        """Post what is left (in each set's order, then the tied parameters) and wait for every
        reduction (the parameters' gradients are views of the summed buffers); `on_final(params)`
        after each reduction completes (the shadows' copies start then: shadow_host.py)."""
        with self._lock:
            if not self._armed:  # no begin_step: nothing was posted early
                self._next = {ranks: 0 for ranks in self.sequence}
                self._posted = []
            self._armed = False
            self.posted_early = len(self._posted)
            for ranks in self.sequence:
                self._post_ready(ranks, all_left=True)
            for params, ranks in self.tied:
                if len(ranks) > 1:
                    self._post(params, ranks)
            posted, self._posted = self._posted, []
        for params, handle in posted:
            with STEP_PROGRESS.waiting(handle):  # engine/resilience/progress.py
                handle.wait()  # the sums are in the parameters' gradients now (views of the buffer)
            if on_final is not None:
                on_final(params)

    def norm_squared(self) -> torch.Tensor:
        """Sum of squared gradients of the parameters this rank is the primary holder of, so that
        an all-reduce over the world counts every parameter of the model exactly once: a sharded
        parameter's shard on every lane, a replicated one on lane 0 only."""
        me, lane = self.groups.rank, self.groups.lane

        def counted(p: torch.Tensor) -> list[torch.Tensor]:  # [its local gradient] or []
            return [local(p.grad)] if p.grad is not None and (lane == 0 or is_sharded(p)) else []

        grads = [g for ranks, params in self.buckets if ranks[0] == me for p in params for g in counted(p)]
        grads += [g for params, ranks in self.tied if ranks[0] == me for p in params for g in counted(p)]
        if not grads:
            return torch.zeros((), dtype=torch.float64)
        total = torch.stack(torch._foreach_norm(grads, dtype=torch.float64)).pow(2).sum()
        return total


@dataclass(frozen=True)
class Synchronised:
    """What `synchronise` returns."""

    norm2: float
    """The squared global gradient norm."""
    loss: float
    """The global loss."""
    shadow_grads: Optional[dict[int, torch.Tensor]]
    """The summed gradients of the layers whose shadow copies this worker keeps (None: no link)."""
    shadow_s: float
    """Seconds spent on the shadow exchange (`StepResult.shadow_s`)."""


def synchronise(
    grad_sync: GradSync,
    local_loss: torch.Tensor,
    *,
    layer_model: LayerModel,
    lane: int,
    step_group: Optional[dist.ProcessGroup],
    progress: Progress,
    shadow_link: Optional[ShadowLink] = None,
    shadows: Optional[ShadowStore] = None,
    timeout: Optional[timedelta] = None,
) -> Synchronised:
    """The gradients summed among each layer's holders, then one SUM all-reduce of the squared
    norm and the loss over `step_group` (global values); the summed gradients of layers with
    shadow copies go to their keepers (`shadow_link`) meanwhile, and the keepers' arrive, before
    this returns (module docstring); the shadow exchange waits under `timeout` (gloo's
    point-to-point waits keep their connect timeout otherwise)."""
    # the shadows' copies of a layer's gradients start as soon as its sum is written
    on_final = shadow_link.begin(layer_model) if shadow_link is not None else None
    grad_sync.all_reduce(on_final)
    # control collectives: CPU tensors, so they go over gloo whatever the data backend; this
    # is the step's one read of a device value (the loss and the norm stay on the device until
    # here). Every lane of a last stage computes the same loss: lane 0 reports it.
    if lane != 0:
        local_loss = torch.zeros_like(local_loss)
    stacked = torch.stack([grad_sync.norm_squared().to(local_loss.device, torch.float64), local_loss.to(torch.float64)])
    # the shadows' own time in the step (`StepResult.shadow_s`): the copies during the sums, then
    # posting (after the norm is queued, so a device computes it while the copies are waited for)
    shadow_s = shadow_link.staging.seconds if shadow_link is not None else 0.0
    began = time.perf_counter()
    posted = shadow_link.post(layer_model, shadows) if shadow_link is not None else None
    shadow_s += time.perf_counter() - began if posted is not None else 0.0
    with progress.waiting():  # the device sync waits for the gradient sums
        reduced = stacked.cpu()
    work = dist.all_reduce(reduced, group=step_group, async_op=True)
    with progress.waiting(work):
        work.wait()
    norm2, loss = float(reduced[0]), float(reduced[1])
    grads = None
    if posted is not None:
        began = time.perf_counter()
        with progress.waiting(*posted.works):
            grads = posted.wait(timeout)
        shadow_s += time.perf_counter() - began
    return Synchronised(norm2, loss, grads, shadow_s)
