"""Seeding the shadow copies at a generation's entry: who keeps which shadow, and the transfers
that fill a keeper's new `ShadowStore` (engine/step/shadows.py). Invariant: after the entry every
shadow is at the agreed step, so the step after it updates holders and keepers alike. The story:
docs/shadows.md.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...config import JobConfig
from ...models import LayerModel, build_layer_model
from ...planning import Plan
from ..step.optim import build_optimizer
from ..step.shadows import ShadowStore
from .reconfigure import Identity, Transfer, exchange

__all__ = ["keepers_by_identity", "new_store", "seed_store", "seed_transfers"]


def keepers_by_identity(plan: Plan) -> dict[Identity, list[int]]:
    """(node, local rank) -> the layers whose shadows that worker keeps in `plan`."""
    if plan.shadows is None:
        return {}
    out: dict[Identity, list[int]] = {}
    for layer, nodes in enumerate(plan.shadows.layers):
        for node in nodes:
            out.setdefault((node, layer % plan.gpus_per_node), []).append(layer)
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
    store.host_bytes = store.count_bytes()
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
