"""Moving layers between generations: who sends which layer to whom (`plan_transfers`), and the
transfer itself (`exchange`).

A worker is identified across generations by (node, local rank). Every worker computes the same
transfer list from what each holds and the new plan; sources take turns over the surviving
holders (lane j from lane j with tensor parallelism). Invariant: a layer moves with its weights
AND optimizer state (one flat fp32 tensor, all posted at once with `batch_isend_irecv`, so no
ordering deadlocks); a layer with no surviving holder is lost, never re-initialised: the caller
restores the checkpoint (docs/design.md, invariant 3). docs/recovery.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...models import LayerModel
from ...models.tensor_parallel import local, wrap_like
from ...planning import Plan
from ..step.optim import adamw_step

Identity = tuple[str, int]  # (node id, local rank)
OPTIM_KEYS = ("exp_avg", "exp_avg_sq", "step")


@dataclass(frozen=True)
class Transfer:
    layer: int
    """Layer index."""
    src: int
    """Sender's rank in the new generation."""
    dst: int
    """Receiver's rank in the new generation."""
    from_shadow: bool = False
    """The sender gives its host-memory shadow copy (engine/step/shadows.py), not a layer of its stage."""


def plan_transfers(
    held: dict[Identity, Sequence[int]], new: Plan, shadows: Optional[dict[Identity, Sequence[int]]] = None
) -> tuple[list[Transfer], list[int]]:
    """The transfers into `new` and the layers no worker of `new` holds (lost). `held`: the layers
    each worker really holds now (`Plan.layers_by_worker` of the generation it last entered); a
    new or restarted worker holds nothing, and workers may hold the layout of different
    generations when an entry failed half-way. `shadows`: the layers whose host-memory shadow
    copies each worker keeps current (engine/step/shadows.py); a layer no surviving worker holds on its
    devices comes from a surviving keeper of its shadow, and is lost only when none is left."""
    tp = new.tensor_parallel
    new_rank = new.entry_ranks()  # donors (drained nodes) are sources too, never receivers
    survivors_of: dict[tuple[int, int], list[int]] = {}  # (layer, lane) -> ranks holding that shard
    for ident, layers in held.items():
        if ident in new_rank:
            for layer in layers:
                survivors_of.setdefault((layer, ident[1] % tp), []).append(new_rank[ident])
    shadow_of: dict[int, list[int]] = {}  # layer -> ranks keeping its shadow (lane 0: no tensor parallelism)
    for ident, layers in (shadows or {}).items():
        if ident in new_rank:
            for layer in layers:
                shadow_of.setdefault(layer, []).append(new_rank[ident])
    transfers, lost = [], set()
    for p in new.pipelines:
        for s in p.stages:
            for lane in range(tp):  # lane j of a stage is local rank local_rank + j, a multiple of tp + j
                had = held.get((s.node, s.local_rank + lane), range(0))
                dst = s.rank + lane
                for layer in s.layers():
                    if layer in had:
                        continue
                    sources = sorted(survivors_of.get((layer, lane), []))
                    if sources:
                        transfers.append(Transfer(layer=layer, src=sources[(layer + s.rank) % len(sources)], dst=dst))
                        continue
                    keepers = sorted(shadow_of.get(layer, [])) if tp == 1 else []
                    if not keepers:
                        lost.add(layer)
                        continue
                    src = dst if dst in keepers else keepers[(layer + s.rank) % len(keepers)]
                    transfers.append(Transfer(layer=layer, src=src, dst=dst, from_shadow=True))
    return transfers, sorted(lost)


@dataclass(frozen=True)
class Move:
    """Layers one node sent another while entering a generation (all their lanes' shards)."""

    src: str
    """Sending node."""
    dst: str
    """Receiving node."""
    layers: tuple[int, ...]
    """Layer indices, ascending."""
    bytes: int
    """Bytes sent: the layers' parameters and optimizer state (fp32)."""
    from_shadow: bool = False
    """The sender gave its host-memory shadow copies (engine/step/shadows.py)."""

    def describe(self) -> str:
        """`layers 3-5 node1 -> node2 (2.4 MB)`."""
        runs: list[str] = []
        start = prev = self.layers[0]
        for cur in [*self.layers[1:], -1]:  # -1 closes the last run
            if cur != prev + 1:
                runs.append(f"{start}" if start == prev else f"{start}-{prev}")
                start = cur
            prev = cur
        what = "layer" if len(self.layers) == 1 else "layers"
        shadow = " from its shadow" if self.from_shadow else ""
        return f"{what} {','.join(runs)} {self.src}{shadow} -> {self.dst} ({self.bytes / 1e6:.1f} MB)"


SOURCES = ("replica", "returned", "shadow", "disk")
"""Where a layer of a generation came from on entering it (`LayerSources`)."""


@dataclass(frozen=True)
class LayerSources:
    """Where each layer of a generation came from when the job entered it, as counts and bytes:
    `replica`, a surviving device holder (kept in place, or moved from one); `returned`, a node
    declared lost while alive that came back and handed it over as a donor (no other holder was
    left, docs/recovery.md); `shadow`, the keeper of its host-memory shadow copy (no surviving
    worker held it on its devices); `disk`, a checkpoint (after a loss every layer is restored
    from it: the job goes back to its step). The same on every worker of the entry: it is computed
    from the entry's moves and plan, which every worker computes alike, or from the plan and the
    checkpoint's manifest."""

    replica: tuple[int, ...] = ()
    """Layers whose copies all came from surviving device holders."""
    shadow: tuple[int, ...] = ()
    """Layers sent by a keeper of their shadow copy."""
    disk: tuple[int, ...] = ()
    """Layers read from a checkpoint."""
    replica_bytes: int = 0
    """Bytes moved from device holders to workers that did not hold the layer (every worker's)."""
    shadow_bytes: int = 0
    """Bytes the shadows' keepers sent (every keeper's)."""
    disk_bytes: int = 0
    """Bytes of checkpoint layer files read (every worker reads its stage's layers)."""
    returned: tuple[int, ...] = ()
    """Layers sent by a returned node (`Plan.returned`)."""
    returned_bytes: int = 0
    """Bytes the returned nodes sent."""

    @classmethod
    def of_moves(cls, num_layers: int, moves: Sequence[Move], returned: Collection[str] = ()) -> "LayerSources":
        """An entry that lost no layer: a layer some keeper sent is `shadow`, one a `returned`
        node sent (`Plan.returned`) is `returned`, every other one `replica`."""
        shadow = sorted({i for m in moves if m.from_shadow for i in m.layers})
        back = [m for m in moves if not m.from_shadow and m.src in returned]
        came_back = sorted({i for m in back for i in m.layers} - set(shadow))
        return cls(
            replica=tuple(i for i in range(num_layers) if i not in shadow and i not in came_back),
            shadow=tuple(shadow),
            returned=tuple(came_back),
            replica_bytes=sum(m.bytes for m in moves if not m.from_shadow and m.src not in returned),
            shadow_bytes=sum(m.bytes for m in moves if m.from_shadow),
            returned_bytes=sum(m.bytes for m in back),
        )

    @classmethod
    def of_restore(cls, plan: Plan, file_bytes: Sequence[int]) -> "LayerSources":
        """A checkpoint restore into `plan`: every layer from disk; `file_bytes[i]`, the size of
        layer i's file (its manifest), read once by every worker holding the layer."""
        read = sum(file_bytes[i] for layers in plan.layers_by_worker().values() for i in layers)
        return cls(disk=tuple(range(plan.num_layers)), disk_bytes=read)

    def fields(self) -> dict[str, dict[str, int]]:
        """{source: {"layers": count, "bytes": bytes}} for the JSON events."""
        return {k: {"layers": len(getattr(self, k)), "bytes": getattr(self, f"{k}_bytes")} for k in SOURCES}

    def describe(self) -> str:
        """`layers by source: 4 from replicas (2.4 MB moved), 2 from shadows (1.2 MB), 0 from disk`
        (with `, 3 from returned nodes (1.8 MB)` after the replicas when some came back)."""
        mb = {k: getattr(self, f"{k}_bytes") / 1e6 for k in SOURCES}
        back = f", {len(self.returned)} from returned nodes ({mb['returned']:.1f} MB)" if self.returned else ""
        return (
            f"layers by source: {len(self.replica)} from replicas ({mb['replica']:.1f} MB moved){back}, "
            f"{len(self.shadow)} from shadows ({mb['shadow']:.1f} MB), "
            f"{len(self.disk)} from disk ({mb['disk']:.1f} MB read)"
        )


def transfer_bytes(layer: nn.Module, tensor_parallel: int = 1) -> int:
    """Bytes one lane's transfer of `layer` sends (parameters, two moments and `step`, fp32); the
    layer may live on the meta device."""
    return 4 * sum(3 * p.numel() // tensor_parallel + 1 for p in layer.parameters())


def moves_of(transfers: list[Transfer], plan: Plan, layer_bytes: list[int]) -> tuple[Move, ...]:
    """The transfers of an entry into `plan` as moves between nodes (a pure function of what every
    worker of the entry computes alike); `layer_bytes[i]`: one lane's transfer of layer i."""
    node_of = {rank: node for (node, _), rank in plan.entry_ranks().items()}
    grouped: dict[tuple[str, str, bool], dict[int, int]] = {}
    for t in transfers:
        per_layer = grouped.setdefault((node_of[t.src], node_of[t.dst], t.from_shadow), {})
        per_layer[t.layer] = per_layer.get(t.layer, 0) + layer_bytes[t.layer]
    return tuple(
        Move(src=src, dst=dst, layers=tuple(sorted(layers)), bytes=sum(layers.values()), from_shadow=shadow)
        for (src, dst, shadow), layers in sorted(grouped.items())
    )


def _flat(layer: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    parts = []
    for p in layer.parameters():  # this lane's shards (the whole tensors without tensor parallelism)
        shard = local(p)
        parts.append(shard.detach().reshape(-1).float())
        state = optimizer.state.get(p, {})
        for key in OPTIM_KEYS:
            value = state.get(key)
            if value is None:
                value = torch.zeros_like(shard) if key != "step" else torch.zeros(())
            parts.append(torch.as_tensor(local(value)).detach().reshape(-1).to(shard.device, torch.float32))
    return torch.cat(parts)


def _numel(layer: nn.Module) -> int:
    return sum(3 * local(p).numel() + 1 for p in layer.parameters())  # param, two moments, step


def _unflat(flat: torch.Tensor, layer: nn.Module) -> dict[int, tuple[nn.Parameter, dict[str, torch.Tensor]]]:
    out, offset = {}, 0
    for p in layer.parameters():
        shard = local(p)
        n = shard.numel()
        with torch.no_grad():
            shard.copy_(flat[offset : offset + n].view_as(shard))
        offset += n
        state = {}
        for key in OPTIM_KEYS:
            size = 1 if key == "step" else n
            chunk = flat[offset : offset + size]
            # fused AdamW keeps `step` as a scalar on the parameter's device; moments live with p
            if key == "step":
                state[key] = adamw_step(chunk, shard)
            else:
                state[key] = wrap_like(p, chunk.view_as(shard).to(shard.device, copy=True))
            offset += size
        out[id(p)] = (p, state)
    return out


def exchange(
    transfers: list[Transfer],
    *,
    rank: int,
    source: LayerModel,
    optimizer: Optional[torch.optim.Optimizer],
    target: LayerModel,
    group: Optional[dist.ProcessGroup] = None,
    shadow: Optional[tuple[LayerModel, Optional[torch.optim.Optimizer]]] = None,
    device: Optional[torch.device] = None,
) -> tuple[dict[int, tuple[nn.Parameter, dict[str, torch.Tensor]]], int]:
    """Post every send and receive of this rank at once and fill received layers in place.

    Senders read layers from `source` and their state from `optimizer` (the previous generation's),
    or from `shadow` (its layers and optimizer) for a transfer `from_shadow`; receivers write into
    `target` and get back the optimizer state to install, keyed by id(parameter). Buffers travel
    on `device` (default: the layer's), so a host-memory shadow and a device layer meet on one
    backend. A transfer to itself (a keeper that is the layer's new holder) is a local copy.
    Returns (received states, bytes sent plus received by this rank)."""
    ops, received = [], []
    moved = 0
    for t in transfers:
        if t.src == rank:
            model, state = shadow if t.from_shadow and shadow is not None else (source, optimizer)
            layer = model.layers[t.layer]
            assert layer is not None and state is not None, f"rank {rank} does not hold layer {t.layer}"
            buf = _flat(layer, state)
            if device is not None:
                buf = buf.to(device)
            if t.dst == rank:
                received.append((t.layer, buf))
                continue
            ops.append(dist.P2POp(dist.isend, buf, t.dst, group))
            moved += buf.numel() * 4
        if t.dst == rank:
            layer = target.layers[t.layer]
            assert layer is not None, f"layer {t.layer} must be built before it is received"
            buf = torch.empty(_numel(layer), device=device or next(layer.parameters()).device)
            ops.append(dist.P2POp(dist.irecv, buf, t.src, group))
            received.append((t.layer, buf))
            moved += buf.numel() * 4
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    states: dict[int, tuple[nn.Parameter, dict[str, torch.Tensor]]] = {}
    for index, buf in received:
        states.update(_unflat(buf, target.held(index)))
    return states, moved
