"""Shadow copies in host memory, kept current every step: more losses than a layer has device copies.

The plan places each layer's shadow copies (planning/tolerance/shadows.py, `fault_tolerance.shadow_copies`)
on nodes that do not hold the layer on their devices. On a node, the shadow of layer l is kept by
its worker of local rank l mod gpus_per_node (`keepers`), in a `ShadowStore`: the layer built on
the CPU with its own AdamW state.

**Kept current with the step's gradients (Checkmate's design).** After a step's gradient sums
among the holders (GradSync) every holder has layer l's summed gradient. One holder per shadow
(`routes`: the holders take turns by layer and keeper) sends that gradient, as one flat fp32 CPU
tensor, to the keeper over the generation's shadow group; the keeper waits for its gradients
before it votes in the step's commit. So the commit rule of the step (docs/design.md, invariant
2) covers the shadows too: a committed step's gradients are on every keeper, and the keeper
applies them exactly when the holders apply theirs (`apply`, the same clipping coefficient from
the same global norm, the same learning rate, the same fused AdamW), or rolls them forward with
the worker's own layers when the step was interrupted after someone committed it. A rejected or
abandoned step's gradients are dropped (`discard`). The shadow's parameters and moments are then
bit-identical to the holders' whenever holders and keepers run AdamW on the same kind of device
(on GPUs the holders' CUDA kernel and the keeper's CPU kernel round alike to within fp32 rounding).

Chosen by measurement over snapshots every N steps (GEMINI's design, `bench/shadow_designs.py`
in bench/RESULTS.md): about 1 % a step either way at N = 1, less for snapshots at N >= 4, but a
recovery from snapshots loses up to N steps and rolls every survivor back; from gradients none.

**Recovery.** Entering a generation, every worker says which generation's shadows it keeps
current (one all-reduce with the held layouts, entry.py); a layer that no surviving worker holds
on its devices comes from a surviving keeper of its shadow (reconfigure.py, `plan_transfers`),
parameters and moments, at the agreed step: no step is lost. Then the new plan's shadows are
seeded (`seed_transfers`): a keeper keeps the shadows it has that the new plan gives it again, and
receives the others from a holder of the layer in the new generation. After a checkpoint
restore every shadow is seeded again (its values would be older than the restored layers).

Limits: tensor parallelism is refused with shadows (a keeper would need each lane's shards);
shadows live on nodes running stages (a spare has no worker in the generation).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...config import JobConfig
from ...logs import JobLog
from ...models import LayerModel, build_layer_model
from ...planning import Plan
from ..step.optim import apply_update, build_optimizer
from .reconfigure import Identity, Transfer, exchange

__all__ = [
    "PostedShadows",
    "ShadowStore",
    "ShadowLink",
    "keepers",
    "keepers_by_identity",
    "routes",
    "seed_store",
    "seed_transfers",
]

log = JobLog(logging.getLogger(__name__))


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


def keepers_by_identity(plan: Plan) -> dict[Identity, list[int]]:
    """(node, local rank) -> the layers whose shadows that worker keeps in `plan`."""
    if plan.shadows is None:
        return {}
    out: dict[Identity, list[int]] = {}
    for layer, nodes in enumerate(plan.shadows.layers):
        for node in nodes:
            out.setdefault((node, layer % plan.gpus_per_node), []).append(layer)
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


def seed_transfers(plan: Plan, kept: dict[Identity, Sequence[int]]) -> list[Transfer]:
    """The transfers that give every keeper of `plan` the shadows it does not keep already
    (`kept`: the layers each worker keeps current from before), each from a holder of the layer in
    `plan` (they take turns by layer and keeper)."""
    ranks = plan.entry_ranks()
    out = []
    for ident, layers in sorted(keepers_by_identity(plan).items()):
        have = set(kept.get(ident, ()))
        dst = ranks[ident]
        for layer in layers:
            if layer in have:
                continue
            holders = sorted(plan.holders(layer))
            out.append(Transfer(layer=layer, src=holders[(layer + dst) % len(holders)], dst=dst))
    return out


def _grad_flat(layer: nn.Module) -> torch.Tensor:
    """A layer's gradients as one flat fp32 CPU tensor: per parameter a presence flag (a parameter
    with no gradient is skipped by AdamW, on the keeper too), then the gradient (zeros if none)."""
    parts = []
    for p in layer.parameters():
        parts.append(torch.tensor([0.0 if p.grad is None else 1.0]))
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        parts.append(grad.detach().reshape(-1).float().cpu())
    return torch.cat(parts)


def _grad_numel(layer: nn.Module) -> int:
    return sum(1 + p.numel() for p in layer.parameters())


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
    """The last step applied to them."""
    pending: Optional[tuple[int, dict[int, torch.Tensor]]] = None
    """(step, layer -> flat gradients) received and not yet applied."""
    layers: list[int] = field(default_factory=list)
    """The kept layers' indices."""
    host_bytes: int = 0
    """`nbytes` as of the last update (or the store's creation): read without waiting for the
    update running in the background (TensorBoard, engine/telemetry/metrics.py)."""
    _running: Optional[threading.Thread] = field(default=None, repr=False)
    _failed: Optional[BaseException] = field(default=None, repr=False)

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
        return self._count_bytes()

    def _count_bytes(self) -> int:
        total = 0
        for p in self.params:
            total += p.numel() * p.element_size()
            if self.optimizer is not None:
                for value in self.optimizer.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor):
                        total += value.numel() * value.element_size()
        return total

    def received(self, step: int, grads: dict[int, torch.Tensor]) -> None:
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
        self.step = step

    def apply(self, step: int, norm2: float, cfg: JobConfig, *, background: bool = False) -> None:
        """Apply step `step`'s gradients as the holders do (clip with the global norm, the step's
        learning rate, AdamW); with `background`, in a thread of its own, off the step's critical
        path (`settle` waits for it: every other use of the store does). Raises when they were not
        received: the commit rule guarantees they were, so a missing one is a bug, never a silent
        divergence."""
        self.settle()
        if not self.layers:
            self.step = step
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
                self._update(step, norm2, cfg)
            except BaseException as err:  # noqa: BLE001 - re-raised by settle()
                self._failed = err

        self._running = threading.Thread(target=run, name=f"shadow-update-{step}", daemon=True)
        self._running.start()

    def _update(self, step: int, norm2: float, cfg: JobConfig) -> None:
        assert self.pending is not None
        _, grads = self.pending
        for i in self.layers:
            flat, offset = grads[i], 0
            for p in self.layer_model.held(i).parameters():
                present = bool(flat[offset] > 0)
                n = p.numel()
                p.grad = flat[offset + 1 : offset + 1 + n].view_as(p).to(p.dtype).clone() if present else None
                offset += 1 + n
        assert self.optimizer is not None
        apply_update(self.optimizer, self.params, step, norm2, cfg.training)
        self.pending = None
        self.host_bytes = self._count_bytes()


def new_store(
    cfg: JobConfig,
    *,
    generation: int,
    step: int,
    layers: Sequence[int],
    kept: Optional[ShadowStore],
    incoming: Sequence[int],
) -> ShadowStore:
    """The store of `layers` for `generation`: the ones `kept` has are taken over (modules and
    optimizer state), `incoming` ones only allocated (a seed transfer fills them)."""
    layers = sorted(layers)
    if kept is not None:
        kept.settle()
    keep = [i for i in layers if kept is not None and i in kept.layers]
    target = build_layer_model(
        cfg.model, seed=cfg.training.seed, owned=[i for i in layers if i not in keep], device="cpu", empty=incoming
    )
    moved_state = {}
    if kept is not None:
        for i in keep:
            module = kept.layer_model.held(i)
            target.layers[i] = module
            if kept.optimizer is not None:
                for p in module.parameters():
                    if p in kept.optimizer.state:
                        moved_state[id(p)] = kept.optimizer.state[p]
        target.retie()
    store = ShadowStore(generation=generation, layer_model=target, optimizer=None, step=step, layers=layers)
    if layers:
        params = store.params
        store.optimizer = build_optimizer(params, cfg.training)
        for p in params:
            if id(p) in moved_state:
                store.optimizer.state[p] = moved_state[id(p)]
    store.host_bytes = store._count_bytes()
    return store


def seed_store(
    cfg: JobConfig,
    *,
    identity: Identity,
    device: torch.device,
    layer_model: LayerModel,
    optimizer: Optional[torch.optim.Optimizer],
    step: int,
    plan: Plan,
    rank: int,
    keep: Optional[ShadowStore],
    kept: dict[Identity, Sequence[int]],
    exchange_layers: bool = True,
) -> tuple[Optional[ShadowStore], int]:
    """The store of `plan`'s shadow copies for worker `identity` (rank `rank`), whose stage in
    `plan` is `layer_model` with `optimizer`, at `step`: the shadows `keep` has that the plan
    gives it again stay, the others come from a holder (`seed_transfers`; `kept`: what every
    worker keeps current). Collective over the generation's stages (point-to-point). Without
    `exchange_layers` (layers were lost: a checkpoint restore follows, then this again with
    nothing kept) nothing moves. Returns (the store, None without shadows; bytes this worker sent
    plus received)."""
    if plan.shadows is None or plan.shadows.copies == 0:
        return None, 0
    placed = keepers_by_identity(plan)
    again: dict[Identity, Sequence[int]] = {
        ident: [i for i in layers if i in placed.get(ident, [])] for ident, layers in kept.items()
    }
    transfers = seed_transfers(plan, again)
    incoming = [t.layer for t in transfers if t.dst == rank]
    store = new_store(
        cfg,
        generation=plan.generation,
        step=step,
        layers=placed.get(identity, []),
        kept=keep if identity in again else None,
        incoming=incoming if exchange_layers else (),
    )
    if not exchange_layers:
        return store, 0
    states, moved = exchange(
        transfers, rank=rank, source=layer_model, optimizer=optimizer, target=store.layer_model, device=device
    )
    if store.optimizer is not None:
        mine = {id(p) for p in store.params}
        for p, st in states.values():
            if id(p) in mine:
                store.optimizer.state[p] = st
    return store, moved


class ShadowLink:
    """One generation's step traffic to the shadows, on this worker: the gradients it sends as a
    holder and receives as a keeper (`routes`), over the generation's shadow group."""

    def __init__(self, plan: Plan, rank: int, group: Optional[dist.ProcessGroup]) -> None:
        self.group = group
        traffic = routes(plan)
        self.sends = [(layer, keeper) for layer, src, keeper in traffic if src == rank]
        self.receives = [(layer, src) for layer, src, keeper in traffic if keeper == rank]
        self.bytes_per_step = 0
        """Bytes this worker sent plus received for the shadows in its last step."""

    @property
    def active(self) -> bool:
        return bool(self.sends or self.receives)

    def post(self, layer_model: LayerModel, store: Optional[ShadowStore]) -> "PostedShadows":
        """Post every send of this holder's summed gradients to its keepers and every receive of
        the kept layers' at once (`PostedShadows.wait` completes them)."""
        ops, got = [], {}
        moved = 0
        flats: dict[int, torch.Tensor] = {}
        for layer, keeper in self.sends:
            if layer not in flats:
                flats[layer] = _grad_flat(layer_model.held(layer))
            ops.append(dist.P2POp(dist.isend, flats[layer], keeper, self.group))
            moved += flats[layer].numel() * 4
        if store is not None:
            store.settle()  # the previous step's update is done before new gradients arrive
        for layer, src in self.receives:
            assert store is not None, "a keeper without its shadow store"
            buf = torch.empty(_grad_numel(store.layer_model.held(layer)))
            ops.append(dist.P2POp(dist.irecv, buf, src, self.group))
            got[layer] = buf
            moved += buf.numel() * 4
        self.bytes_per_step = moved
        return PostedShadows(works=dist.batch_isend_irecv(ops) if ops else [], grads=got, keep=flats)


@dataclass
class PostedShadows:
    """A step's shadow traffic in flight."""

    works: list
    """The posted sends and receives."""
    grads: dict[int, torch.Tensor]
    """Layer -> the buffer its gradients arrive in."""
    keep: dict[int, torch.Tensor]
    """The sent buffers (alive until the sends complete)."""

    def wait(self) -> dict[int, torch.Tensor]:
        """Wait for every send and receive; layer -> flat gradients received."""
        for work in self.works:
            work.wait()
        return self.grads
