"""Placement on a re-plan: which running node takes which slot, so that nodes keep their layers.

The rule (`keep_layers_in_place`): the nodes that will run are placed greedily on the largest
overlaps between the layers a node holds and those a slot holds (per local rank); ties go to the
earlier node in the preference order, then to the earlier slot. Slots are grouped by kind
(template size, position), so it costs O(N log N) and gives exactly the placement of the direct
all-pairs rule, `keep_layers_in_place_pairwise`, kept as the tests' reference. `bytes_received`
prices a re-plan per node. docs/planning.md; timings in bench/RESULTS.md.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Optional, Sequence

from ..templates.templates import TemplateSet
from .instantiate import Assignment
from .plan import Plan

Kind = tuple[int, int]  # (template node count, node index in the template)


def _held_by_node(previous: Plan, gpus_per_node: int) -> dict[str, list[tuple[int, int, int, int]]]:
    """node -> (first local rank, local ranks, first layer, end layer) of every stage of `previous` on it."""
    held: dict[str, list[tuple[int, int, int, int]]] = {}
    for p in previous.pipelines:
        for s in p.stages:
            width = min(previous.tensor_parallel, gpus_per_node - s.local_rank)
            if width > 0:
                held.setdefault(s.node, []).append((s.local_rank, width, s.start, s.end))
    return held


def _blocks(templates: TemplateSet, size: int) -> dict[int, tuple[list[int], list[int], list[int]]]:
    """First local rank of a stage -> (starts, ends, node index) of the template's stages that run
    on those local ranks, in layer order (sorted and disjoint)."""
    blocks: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for st in templates[size].stages:
        starts, ends, where = blocks.setdefault(st.local_rank, ([], [], []))
        starts.append(st.start)
        ends.append(st.end)
        where.append(st.node)
    return blocks


def keep_layers_in_place(templates: TemplateSet, a: Assignment, nodes: list[str], previous: Plan) -> list[str]:
    """`nodes` reordered so that the running ones sit in the node slots of assignment `a` where
    they keep the most layers of `previous` (module docstring: greedy on the largest overlaps,
    ties in preference order, then slot order; nodes without any overlap fill the remaining
    slots in preference order). Layers are counted per worker: a stage's layers once per lane."""
    slots: dict[Kind, list[int]] = {}  # kind -> its slots, in order
    cursor = 0
    for n, _ in a.pipelines:
        for i in range(n):
            slots.setdefault((n, i), []).append(cursor + i)
        cursor += n
    used = nodes[:cursor]
    tp = templates.tensor_parallel
    blocks = {n: _blocks(templates, n) for n in {n for n, _ in a.pipelines}}
    held = _held_by_node(previous, templates.gpus_per_node)
    groups: list[tuple[int, int, list[Kind]]] = []  # (-kept, node's preference index, kinds)
    scored: dict[tuple[tuple[int, int, int, int], ...], list[tuple[int, list[Kind]]]] = {}
    for ni, node in enumerate(used):
        mine = tuple(held.get(node, ()))
        if mine not in scored:  # nodes that held the same stages score alike: once per kind of holding
            scored[mine] = _score(mine, blocks, tp)
        groups.extend((-kept, ni, kinds) for kept, kinds in scored[mine])
    groups.sort()  # (-kept, ni) is unique: the lists are never compared
    taken_of: dict[Kind, int] = {kind: 0 for kind in slots}  # slots of a kind are taken in order
    placed: dict[int, str] = {}
    taken: set[int] = set()
    for _, ni, kinds in groups:
        if ni in taken:
            continue
        free = [(slots[kind][taken_of[kind]], kind) for kind in kinds if taken_of[kind] < len(slots[kind])]
        if not free:
            continue
        slot, kind = min(free)
        placed[slot] = used[ni]
        taken_of[kind] += 1
        taken.add(ni)
    rest = iter(node for ni, node in enumerate(used) if ni not in taken)
    return [placed[si] if si in placed else next(rest) for si in range(cursor)] + nodes[cursor:]


def _score(
    mine: Sequence[tuple[int, int, int, int]],
    blocks: dict[int, dict[int, tuple[list[int], list[int], list[int]]]],
    tp: int,
) -> list[tuple[int, list[Kind]]]:
    """(layers kept, slot kinds that keep that many) for a node holding the stages `mine`
    ((first local rank, local ranks, first layer, end layer) each), over the templates' `blocks`."""
    gains: dict[Kind, int] = {}
    for lr, width, first, end in mine:
        for n, per_block in blocks.items():
            for block in range(lr - lr % tp, lr + width, tp):  # stages start at multiples of tp
                if block not in per_block:
                    continue
                starts, ends, where = per_block[block]
                lanes = min(lr + width, block + tp) - max(lr, block)  # workers both stages have
                k = bisect.bisect_right(ends, first)  # first stage ending after `first`
                while k < len(starts) and starts[k] < end:
                    kind = (n, where[k])
                    gains[kind] = gains.get(kind, 0) + lanes * (min(end, ends[k]) - max(first, starts[k]))
                    k += 1
    by_kept: dict[int, list[Kind]] = {}
    for kind, kept in gains.items():
        by_kept.setdefault(kept, []).append(kind)
    return list(by_kept.items())


def keep_layers_in_place_pairwise(templates: TemplateSet, a: Assignment, nodes: list[str], previous: Plan) -> list[str]:
    """The same rule computed directly: every running node scored against every slot (O(N^2)
    overlaps of layer sets). The reference `keep_layers_in_place` must equal."""
    g = templates.gpus_per_node
    held = previous.layers_by_worker()
    slots: list[dict[int, range]] = []  # per node slot: local rank -> layers
    for n, _ in a.pipelines:
        per_node: list[dict[int, range]] = [{} for _ in range(n)]
        for st in templates[n].stages:
            for j in range(templates.tensor_parallel):
                per_node[st.node][st.local_rank + j] = range(st.start, st.end)
        slots.extend(per_node)
    used = nodes[: len(slots)]
    gains = []
    for ni, node in enumerate(used):
        mine = {lr: held[(node, lr)] for lr in range(g) if (node, lr) in held}
        if not mine:
            continue
        for si, slot in enumerate(slots):
            kept = sum(len(set(mine[lr]) & set(layers)) for lr, layers in slot.items() if lr in mine)
            if kept:
                gains.append((-kept, ni, si))
    placed: dict[int, str] = {}
    taken: set[int] = set()
    for _, ni, si in sorted(gains):
        if si not in placed and ni not in taken:
            placed[si] = used[ni]
            taken.add(ni)
    rest = iter(node for ni, node in enumerate(used) if ni not in taken)
    return [placed[si] if si in placed else next(rest) for si in range(len(slots))] + nodes[len(slots) :]


def bytes_received(
    previous: Plan, plan: Plan, shard_bytes: Sequence[int], *, held: Optional[dict] = None
) -> dict[str, int]:
    """node -> bytes its workers receive entering `plan` from `previous`: for every worker
    (node, local rank) of `plan`, the `shard_bytes` of each layer it holds in `plan` and did not
    hold in `previous` (`shard_bytes[i]`: one lane's parameters and optimizer state of layer i).
    Nodes that receive nothing are left out. `held`: `previous.layers_by_worker()`, when the
    caller prices several plans against one previous plan."""
    prefix = [0, *itertools.accumulate(shard_bytes)]
    before = previous.layers_by_worker() if held is None else held
    out: dict[str, int] = {}
    for (node, lr), now in plan.layers_by_worker().items():
        had = before.get((node, lr), range(0))
        if isinstance(now, range) and isinstance(had, range):  # one contiguous stage each: prefix sums
            kept_first, kept_end = max(now.start, had.start), min(now.stop, had.stop)
            kept = prefix[kept_end] - prefix[kept_first] if kept_first < kept_end else 0
            moved = prefix[now.stop] - prefix[now.start] - kept
        else:  # chunks: several ranges
            moved = sum(shard_bytes[i] for i in set(now) - set(had))
        if moved:
            out[node] = out.get(node, 0) + moved
    return out


def shard_bytes_of(profile_layers: Sequence) -> list[int]:
    """One lane's bytes of each layer that a transfer moves: parameters and optimizer state
    (gradients are recomputed), from the layers of the profile at the plan's tensor-parallel degree."""
    return [layer.param_bytes + layer.optimizer_bytes for layer in profile_layers]
