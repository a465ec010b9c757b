"""Replica fingerprints: silent corruption of a layer copy is found by its holders and repaired in place.

After every applied step a layer's copies (one per pipeline) are bit-identical, so a bit flipped
in one device's memory breaks only that. Every `fault_tolerance.fingerprint_interval_steps`
steps, after the commit and before that step's checkpoint, `check_replicas` fingerprints every
held layer (`fingerprints`: exact integer sums of its parameters' and optimizer state's words),
shares a [rank, layer] table in one all-gather, runs the same `compare` on every worker, and
replaces copies outside a strict majority from a majority holder (`repair`); without a majority
the job stops (`Unrepairable`). docs/recovery.md; the cost: bench/fingerprint.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from ...planning import Plan
from .progress import Progress

__all__ = [
    "Corrupt",
    "Unrepairable",
    "check_replicas",
    "compare",
    "fingerprints",
    "is_check_step",
    "layer_tensors",
]

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 4096  # words summed into one run; runs are weighted by their position


def _words(t: torch.Tensor) -> torch.Tensor:
    """The bits of `t` as a flat tensor of integer words of its element size."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(_WORDS[flat.element_size()]) if flat.is_floating_point() or flat.dtype.is_complex else flat


def _sums(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """[plain sum, chunk-weighted sum] of the words of `tensors` (int64, on their device): one pass
    that sums each run of `_CHUNK` words, then weights the runs by their position."""
    total: Optional[torch.Tensor] = None
    for t in tensors:
        words = _words(t)
        n = words.numel()
        if n == 0:
            continue
        full = n // _CHUNK * _CHUNK
        runs = words[:full].view(-1, _CHUNK).sum(1, dtype=torch.int64)
        tail = words[full:].sum(dtype=torch.int64)
        weights = torch.arange(1, runs.numel() + 1, dtype=torch.int64, device=words.device)
        pair = torch.stack([runs.sum() + tail, (runs * weights).sum() + tail * (runs.numel() + 1)])
        total = pair if total is None else total + pair
    return total if total is not None else torch.zeros(2, dtype=torch.int64)


def fingerprints(layers: dict[int, list[torch.Tensor]]) -> dict[int, tuple[int, int]]:
    """Each layer's (plain sum, position-weighted sum) of the words of its tensors, as int64
    (wrapping modulo 2^64), in the order given; one device-to-host copy for all of them. Exact:
    equal tensors give equal fingerprints. The tensors' 16-, 32- or 64-bit words are summed as
    integers, plainly and by runs of 4,096 words weighted by the run's position: a single flipped
    bit always changes the plain sum, words moved between runs the weighted one."""
    if not layers:
        return {}
    order = sorted(layers)
    pairs = [_sums(layers[i]) for i in order]
    table = torch.stack([p.to(pairs[0].device) for p in pairs]).cpu()
    return {i: (int(table[k, 0]), int(table[k, 1])) for k, i in enumerate(order)}


def layer_tensors(layer: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """What a layer's copies must agree on: its parameters (this lane's shards) and their optimizer
    state, in a fixed order."""
    from ...models.tensor_parallel import local

    out = []
    for _, p in sorted(layer.named_parameters(), key=lambda kv: kv[0]):
        out.append(local(p))
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        out += [local(state[k]) for k in sorted(state) if torch.is_tensor(state[k])]
    return out


def is_check_step(step: int, interval: int) -> bool:
    """Whether the copies are compared after step `step` (0-based): every `interval` steps, 0 = never."""
    return interval > 0 and (step + 1) % interval == 0


@dataclass(frozen=True)
class Corrupt:
    """Copies of one layer (one tensor-parallel lane of it) that differ from its holders' majority."""

    layer: int
    lane: int
    holders: tuple[int, ...]
    """Ranks holding the layer, sorted (one per pipeline)."""
    bad: tuple[int, ...]
    """Ranks whose copy differs from the majority."""
    source: int
    """The first majority holder: every holder's copy is replaced by its copy."""


class Unrepairable(RuntimeError):
    """A layer's copies differ and no strict majority agrees: the intact copy cannot be told."""


def compare(plan: Plan, table: dict[int, dict[int, tuple[int, int]]]) -> list[Corrupt]:
    """The corrupt copies of every layer, by layer and lane; `table[rank][layer]` is the fingerprint
    of that rank's copy. Copies outside a strict majority of a layer's holders are corrupt. Raises
    Unrepairable naming the first layer without a majority (two holders that differ, three that
    all differ: which copy is intact cannot be told), with its holders' ranks and nodes."""
    node_of = {s.rank + j: s.node for p in plan.pipelines for s in p.stages for j in range(plan.tensor_parallel)}
    out = []
    for layer in range(plan.num_layers):
        for lane in range(plan.tensor_parallel):
            holders = tuple(sorted(plan.holders(layer, lane)))
            if len(holders) < 2:
                continue
            prints = [table[r][layer] for r in holders]
            if len(set(prints)) == 1:
                continue
            best = max(set(prints), key=prints.count)
            if prints.count(best) * 2 <= len(holders):
                where = ", ".join(f"rank {r} on {node_of[r]}" for r in holders)
                lane_text = f" (tensor-parallel lane {lane})" if plan.tensor_parallel > 1 else ""
                raise Unrepairable(
                    f"the copies of layer {layer}{lane_text} differ between its {len(holders)} holders ({where}) "
                    "and no majority agrees, so the intact copy cannot be told (silent data corruption): "
                    "restart the job from the newest checkpoint, and check those nodes' devices"
                )
            bad = tuple(r for r, fp in zip(holders, prints) if fp != best)
            out.append(
                Corrupt(
                    layer=layer,
                    lane=lane,
                    holders=holders,
                    bad=bad,
                    source=next(r for r, fp in zip(holders, prints) if fp == best),
                )
            )
    return out


def gather(
    plan: Plan, prints: dict[int, tuple[int, int]], group: Optional[dist.ProcessGroup], progress: Progress
) -> dict[int, dict[int, tuple[int, int]]]:
    """Every rank's fingerprints by layer, from one all-gather over `group` (the generation's
    workers; CPU tensors over gloo whatever the data backend), its wait marked on `progress`."""
    mine = torch.zeros((plan.num_layers, 3), dtype=torch.int64)
    for layer, (a, b) in prints.items():
        mine[layer] = torch.tensor([1, a, b], dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(plan.world_size)]
    work = dist.all_gather(rows, mine, group=group, async_op=True)
    with progress.waiting(work):
        work.wait()
    return {
        r: {li: (int(rows[r][li, 1]), int(rows[r][li, 2])) for li in range(plan.num_layers) if rows[r][li, 0]}
        for r in range(plan.world_size)
    }


def repair(
    corrupt: list[Corrupt],
    *,
    rank: int,
    tensors_of: dict[int, list[torch.Tensor]],
    groups: dict[tuple[int, ...], dist.ProcessGroup],
    progress: Progress,
) -> None:
    """Replace the corrupt copies this rank takes part in: for each one, in the same order on every
    rank, the layer's holders broadcast the source's parameters and optimizer state over their
    group (`groups`: this rank's holder-set groups, engine/entry/groups.py); each wait is marked on
    `progress`."""
    for c in corrupt:
        if rank not in c.holders:
            continue
        for t in tensors_of[c.layer]:
            data = t.data if isinstance(t, torch.nn.Parameter) else t
            work = dist.broadcast(data, src=c.source, group=groups[c.holders], async_op=True)
            with progress.waiting(work):
                work.wait()


def check_replicas(
    plan: Plan,
    tensors: dict[int, list[torch.Tensor]],
    *,
    rank: int,
    group: Optional[dist.ProcessGroup],
    holder_groups: dict[tuple[int, ...], dist.ProcessGroup],
    progress: Progress,
) -> list[Corrupt]:
    """Compare every layer's copies (`tensors`: this rank's, by layer) with its other holders and
    replace the corrupt ones from the majority; the repaired copies. Collective over `group` (the
    generation's workers); raises Unrepairable when a layer's copies have no majority."""
    prints = fingerprints(tensors)
    table = gather(plan, prints, group, progress)  # waits marked: engine/resilience/progress.py
    corrupt = compare(plan, table)
    repair(corrupt, rank=rank, tensors_of=tensors, groups=holder_groups, progress=progress)
    return corrupt
