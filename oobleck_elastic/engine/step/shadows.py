"""Shadow copies in host memory, kept current every step with the step's summed gradients.

A keeper holds its layers' shadows in a `ShadowStore` (CPU layers and their AdamW state); each
step one holder per shadow sends the layer's summed gradient (`routes`, `ShadowLink`) and the
keeper has it before it votes in the commit. Invariant: a shadow gets exactly the updates its
holders apply (same norm, same learning rate, same AdamW), so it is bit-identical to them; a
rejected or abandoned step's gradients are dropped. Host buffers and the update's threads:
shadow_host.py. Seeding at entry: engine/entry/shadow_seeding.py. The story, why gradients rather
than snapshots, the lag and its drill (`SLOW_KEEPER_ENV`): docs/shadows.md.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...config import JobConfig
from ...logs import JobLog
from ...models import LayerModel
from ...planning import Plan
from .optim import apply_update
from .shadow_host import GradStaging, default_update_threads, flat_numel, intra_op_threads

__all__ = [
    "PostedShadows",
    "ShadowStore",
    "ShadowLink",
    "keepers",
    "routes",
]

log = JobLog(logging.getLogger(__name__))

SLOW_KEEPER_ENV = "OOBLECK_SLOW_KEEPER"
"""A drill: SECONDS every background update of this process's shadow copies sleeps before it runs."""


def _slow_keeper_s() -> float:
    """`SLOW_KEEPER_ENV`'s seconds in this process's environment (0: not slowed)."""
    text = os.environ.get(SLOW_KEEPER_ENV, "").strip()
    try:
        seconds = float(text) if text else 0.0
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"{SLOW_KEEPER_ENV}={text!r}: must be SECONDS >= 0, e.g. 2.5")
    return seconds


def keepers(plan: Plan) -> dict[int, tuple[int, ...]]:
    """Layer -> the ranks (of `plan`'s generation) keeping its shadow copies, in the placement's
    order: on each shadow node, the worker of local rank layer mod gpus_per_node."""
    if plan.shadows is None:
        return {}
    ranks = plan.entry_ranks()
    out: dict[int, tuple[int, ...]] = {}
    for layer, nodes in enumerate(plan.shadows.layers):
        if nodes:
            out[layer] = tuple(ranks[(node, layer % plan.gpus_per_node)] for node in nodes)
    return out


def routes(plan: Plan) -> list[tuple[int, int, int]]:
    """Every step's gradient traffic to the shadows: (layer, sending holder, keeper), ranks of
    `plan`'s generation. A layer's holders take turns over its keepers."""
    out = []
    for layer, ranks in sorted(keepers(plan).items()):
        holders = sorted(plan.holders(layer))
        for k, keeper in enumerate(ranks):
            out.append((layer, holders[(layer + k) % len(holders)], keeper))
    return out


@dataclass
class ShadowStore:
    """The shadow copies one worker keeps (module docstring): layers on the CPU, their AdamW
    state, the step they are at and the gradients of a step not yet applied."""

    generation: int
    """The generation whose plan placed these shadows."""
    layer_model: LayerModel
    """The kept layers (CPU); the others None."""
    optimizer: Optional[torch.optim.Optimizer]
    """AdamW over the kept layers' parameters (None when none is kept)."""
    step: int
    """The last step applied to them (its update may still run in the background)."""
    pending: Optional[tuple[int, dict[int, torch.Tensor]]] = None
    """(step, layer -> flat gradients) received and not yet applied."""
    layers: list[int] = field(default_factory=list)
    """The kept layers' indices."""
    host_bytes: int = 0
    """`nbytes` as of the last update (or the store's creation): read without waiting for the
    update running in the background (TensorBoard, engine/telemetry/metrics.py)."""
    settled_step: Optional[int] = None
    """The last step whose update has finished (`step` at creation): behind `step` while one runs."""
    lag_steps: int = 0
    """Steps `settled_step` was behind `step` when the keeper last needed its shadows for the next
    step's gradients (`catch_up`): 0 when the update had finished, 1 when the keeper waited."""
    slow_s: float = field(default_factory=_slow_keeper_s)
    """Seconds each background update sleeps first (`SLOW_KEEPER_ENV`, a drill; 0 otherwise)."""
    threads: int = field(default_factory=default_update_threads)
    """Threads the AdamW update runs on (shadow_host.py: `update_threads`, `THREADS_ENV`)."""
    _running: Optional[threading.Thread] = field(default=None, repr=False)
    _failed: Optional[BaseException] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.settled_step is None:
            self.settled_step = self.step

    def catch_up(self) -> None:
        """Before the next step's gradients arrive: measure `lag_steps`, then `settle`."""
        assert self.settled_step is not None
        self.lag_steps = self.step - self.settled_step
        self.settle()

    def settle(self) -> None:
        """Wait for the update running in the background (`apply`); re-raise its error."""
        if self._running is not None:
            self._running.join()
            self._running = None
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise RuntimeError(f"updating the shadow copies failed: {failed}") from failed

    @property
    def params(self) -> list[nn.Parameter]:
        return list(dict.fromkeys(p for i in self.layers for p in self.layer_model.held(i).parameters()))

    def nbytes(self) -> int:
        """Host bytes of the kept parameters and optimizer state."""
        self.settle()
        return self.count_bytes()

    def count_bytes(self) -> int:
        total = 0
        for p in self.params:
            total += p.numel() * p.element_size()
            if self.optimizer is not None:
                for value in self.optimizer.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor):
                        total += value.numel() * value.element_size()
        return total

    def received(self, step: int, grads: dict[int, torch.Tensor]) -> None:
        """Step `step`'s flat gradients (layer -> `fill_flat`'s layout) arrived. The store owns
        the buffers until they are applied or dropped: the update scales them in place."""
        self.settle()
        self.pending = (step, grads)

    def discard(self) -> None:
        """Drop the pending gradients (a rejected, abandoned or replayed step)."""
        self.settle()
        self.pending = None

    def skip(self, step: int) -> None:
        """`step` counts as done with no update (the step guard skipped it)."""
        self.settle()
        self.pending = None
        self.step = self.settled_step = step

    def apply(self, step: int, norm2: float, cfg: JobConfig, *, background: bool = False) -> None:
        """Apply step `step`'s gradients as the holders do (clip with the global norm, the step's
        learning rate, AdamW); with `background`, in a thread of its own, off the step's critical
        path (`settle` waits for it: every other use of the store does). Raises when they were not
        received: the commit rule guarantees they were, so a missing one is a bug, never a silent
        divergence."""
        self.settle()
        if not self.layers:
            self.step = self.settled_step = step
            return
        if self.pending is None or self.pending[0] != step:
            have = None if self.pending is None else self.pending[0]
            raise RuntimeError(f"shadow copies have no gradients of step {step} to apply (pending: {have})")
        self.step = step  # what the store will hold once settled
        if not background:
            self._update(step, norm2, cfg)
            return

        def run() -> None:
            try:
                if self.slow_s:
                    time.sleep(self.slow_s)
                self._update(step, norm2, cfg)
            except BaseException as err:  # noqa: BLE001 - re-raised by settle()
                self._failed = err

        self._running = threading.Thread(target=run, name=f"shadow-update-{step}", daemon=True)
        self._running.start()

    def _update(self, step: int, norm2: float, cfg: JobConfig) -> None:
        assert self.pending is not None
        _, grads = self.pending
        for i in self.layers:
            flat, params = grads[i], list(self.layer_model.held(i).parameters())
            starts = list(itertools.accumulate((1 + p.numel() for p in params[:-1]), initial=0))
            flags = flat[starts].tolist() if params else []
            for p, start, flag in zip(params, starts, flags):
                # a view of the received buffer (no copy): `received` hands it over
                p.grad = flat[start + 1 : start + 1 + p.numel()].view_as(p).to(p.dtype) if flag > 0 else None
        assert self.optimizer is not None
        with intra_op_threads(self.threads):  # the fused CPU AdamW's result is the same on any count
            apply_update(self.optimizer, self.params, step, norm2, cfg.training)
        self.pending = None
        self.host_bytes = self.count_bytes()
        self.settled_step = step


class ShadowLink:
    """One generation's step traffic to the shadows, on this worker: the gradients it sends as a
    holder and receives as a keeper (`routes`), over the generation's shadow group. Its host
    buffers live as long as it does (one generation): the sent ones in `staging`, the received
    ones here; each is written again only after the step that used it completed its traffic."""

    def __init__(self, plan: Plan, rank: int, group: Optional[dist.ProcessGroup]) -> None:
        self.group = group
        traffic = routes(plan)
        self.sends = [(layer, keeper) for layer, src, keeper in traffic if src == rank]
        self.receives = [(layer, src) for layer, src, keeper in traffic if keeper == rank]
        self.bytes_per_step = 0
        """Bytes this worker sent plus received for the shadows in its last step."""
        self.staging = GradStaging([layer for layer, _ in self.sends])
        """The sent layers' host buffers, filled as their gradients become final."""
        self.received: dict[int, torch.Tensor] = {}
        """Layer -> the buffer its gradients arrive in (allocated at the first step, then reused)."""
        self.received_allocated = 0
        """Receive buffers allocated in this generation (one per kept layer, unless reused ones
        were still taken: a step's traffic left in flight, or gradients not yet applied)."""
        self._last: Optional[PostedShadows] = None

    @property
    def active(self) -> bool:
        return bool(self.sends or self.receives)

    def begin(self, layer_model: LayerModel) -> Callable[[list[torch.Tensor]], None]:
        """Start a step's staging (before the gradient sums); returns what GradSync.all_reduce
        calls with each group of parameters whose sums it has written (`GradStaging.final`)."""
        return self.staging.begin(layer_model, in_flight=self._last is not None and not self._last.done)

    def post(self, layer_model: LayerModel, store: Optional[ShadowStore]) -> "PostedShadows":
        """Post every send of this holder's summed gradients to its keepers and every receive of
        the kept layers' at once (`PostedShadows.wait` completes them). The layers `begin`'s
        callback did not copy yet are copied now (`begin` first if it was not called)."""
        in_flight = self._last is not None and not self._last.done
        if not self.staging.begun(layer_model):
            self.begin(layer_model)
        self.staging.rest()
        flats = self.staging.ready()
        ops, got = [], {}
        moved = 0
        for layer, keeper in self.sends:
            ops.append(dist.P2POp(dist.isend, flats[layer], keeper, self.group))
            moved += flats[layer].numel() * 4
        if store is not None:
            store.catch_up()  # the previous step's update is done before new gradients arrive
            if in_flight or store.pending is not None:  # the buffers may still be read: new ones
                self.received = {}
        for layer, src in self.receives:
            assert store is not None, "a keeper without its shadow store"
            if layer not in self.received:
                self.received[layer] = torch.empty(flat_numel(store.layer_model.held(layer)))
                self.received_allocated += 1
            buf = self.received[layer]
            ops.append(dist.P2POp(dist.irecv, buf, src, self.group))
            got[layer] = buf
            moved += buf.numel() * 4
        self.bytes_per_step = moved
        self.staging.end()
        # in flight (not `done`) from before the ops are posted: a post that raises leaves it so
        self._last = PostedShadows(works=[], grads=got, keep=flats)
        self._last.works = dist.batch_isend_irecv(ops) if ops else []
        return self._last


@dataclass
class PostedShadows:
    """A step's shadow traffic in flight."""

    works: list
    """The posted sends and receives."""
    grads: dict[int, torch.Tensor]
    """Layer -> the buffer its gradients arrive in."""
    keep: dict[int, torch.Tensor]
    """The sent buffers (alive until the sends complete)."""
    done: bool = False
    """Every send and receive completed (`wait` returned): the buffers may be written again."""

    def wait(self, timeout: Optional[timedelta] = None) -> dict[int, torch.Tensor]:
        """Wait for every send and receive, each under `timeout` (None: the group's connect
        timeout, which gloo's point-to-point waits keep); layer -> flat gradients received."""
        for work in self.works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        self.done = True
        return self.grads
