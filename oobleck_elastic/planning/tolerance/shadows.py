"""Shadow copies: each layer's weights and optimizer state also kept in the host memory of s nodes
running stages that do not hold it on their devices, and where the planner puts them.

A loss takes a layer only when it takes every holder, device and shadow, so a plan with f+1 device
copies and s shadows tolerates any f + s losses (`tolerated_losses`, `survives`). `place_shadows`:
layers largest first, each to the s nodes with the most host memory left, within every node's
budget (`planning.host_memory_gb`, else measured), with one repair; one plan and one set of
budgets give one placement. The placement is part of the plan (`Plan.shadows`). docs/shadows.md.
"""

from __future__ import annotations

import heapq
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from ..errors import PlanningError
from ..plan.plan import Plan, ShadowPlacement, device_holders, fmt_gib

__all__ = [
    "place_shadows",
    "shadow_bytes",
    "survives",
    "tolerated_losses",
]

CONFIG_SOURCE = "planning.host_memory_gb"
SHADOWS_WITH_TP = (
    "fault_tolerance.shadow_copies={copies} with tensor parallelism: training keeps shadow copies only with "
    "planning.tensor_parallel=1 (a keeper would need every lane's shards); set planning.tensor_parallel=1 or "
    "fault_tolerance.shadow_copies=0"
)


def shadow_bytes(profile_layers: Sequence[Any], tensor_parallel: int = 1) -> list[int]:
    """Bytes of each layer's shadow copy: parameters and optimizer state of every
    tensor-parallel lane, from the profile's per-device bytes at `tensor_parallel`."""
    return [tensor_parallel * (layer.param_bytes + layer.optimizer_bytes) for layer in profile_layers]


def place_shadows(
    plan: "Plan",
    copies: int,
    layer_bytes: Sequence[int],
    budgets: Union[int, Mapping[str, int]],
    *,
    budget_source: str = CONFIG_SOURCE,
) -> ShadowPlacement:
    """`copies` shadow nodes for every layer of `plan`, none holding the layer on its devices,
    within `budgets` (bytes of host memory per node: one figure for every node, or by node);
    `layer_bytes` from `shadow_bytes`. `budget_source` says where the budgets come from (for the
    error's advice). Raises PlanningError naming what to change when no placement is found."""
    if copies < 0:
        raise PlanningError(f"fault_tolerance.shadow_copies must be >= 0 (got {copies})")
    if len(layer_bytes) != plan.num_layers:
        raise PlanningError(f"{len(layer_bytes)} layer sizes for a plan of {plan.num_layers} layers")
    budget = {n: int(budgets) for n in plan.nodes} if isinstance(budgets, (int, float)) else dict(budgets)
    missing = [n for n in plan.nodes if n not in budget]
    if missing:
        raise PlanningError(f"no host-memory budget for node(s) {', '.join(missing)}")
    spares = frozenset(plan.spares)  # no worker of theirs is in the generation to keep a shadow
    held = device_holders(plan)
    barred = [h | spares for h in held]
    empty = ShadowPlacement(
        copies=copies,
        layers=tuple(() for _ in held),
        layer_bytes=tuple(int(b) for b in layer_bytes),
        budgets=tuple((n, budget[n]) for n in plan.nodes),
    )
    if copies == 0:
        return empty
    total = len(plan.nodes) - len(spares)
    tight = min(range(plan.num_layers), key=lambda i: (total - len(held[i]), i))
    if total - len(held[tight]) < copies:
        room = total - len(held[tight])
        raise PlanningError(
            f"fault_tolerance.shadow_copies={copies} needs {copies} nodes that do not hold layer {tight} on "
            f"their devices, but {len(held[tight])} of the plan's {total} nodes running stages hold it, leaving "
            f"{room}: lower fault_tolerance.shadow_copies to {room} or add nodes"
        )
    order = {n: i for i, n in enumerate(plan.nodes)}
    free = dict(budget)
    version = dict.fromkeys(plan.nodes, 0)
    heap = [(-free[n], order[n], 0, n) for n in plan.nodes]  # most free first, then plan order
    heapq.heapify(heap)
    chosen: list[tuple[str, ...]] = [() for _ in held]
    kept: dict[str, list[int]] = {n: [] for n in plan.nodes}  # node -> layers it shadows

    def take(node: str, layer: int, delta: int) -> None:
        """Reserve (delta > 0) or release `layer`'s bytes on `node`; its heap entry is renewed."""
        free[node] -= delta
        version[node] += 1
        heapq.heappush(heap, (-free[node], order[node], version[node], node))
        if delta > 0:
            kept[node].append(layer)
        else:
            kept[node].remove(layer)

    def make_room(layer: int, need: int, picked: list[str]) -> Optional[str]:
        """A node not holding `layer` that gets room for it by handing one of its shadows to a node
        with room for that one (greedy placement's one-step repair), or None."""
        by_room = sorted(plan.nodes, key=lambda n: (-free[n], order[n]))
        for x in by_room:
            if x in barred[layer] or x in picked:
                continue
            for m in sorted(kept[x], key=lambda i: (layer_bytes[i], i)):
                size = int(layer_bytes[m])
                if free[x] + size < need:
                    continue
                for y in by_room:
                    if free[y] < size:
                        break
                    if y != x and y not in barred[m] and y not in chosen[m]:
                        chosen[m] = tuple(y if n == x else n for n in chosen[m])
                        take(x, m, -size)
                        take(y, m, size)
                        return x
        return None

    for layer in sorted(range(plan.num_layers), key=lambda i: (-layer_bytes[i], i)):
        need = int(layer_bytes[layer])
        picked: list[str] = []
        popped: list[str] = []
        while len(picked) < copies:
            _, _, ver, node = heapq.heappop(heap)  # never empty: enough nodes do not hold the layer
            if ver != version[node]:
                continue  # an outdated entry: the node's free memory changed since
            popped.append(node)
            if node in barred[layer] or node in picked:
                continue
            if free[node] < need:  # the node not holding the layer with the most room left has too little
                freed = make_room(layer, need, picked)
                if freed is None:
                    raise PlanningError(
                        _no_room(layer, len(picked) + 1, copies, need, node, free, budget, budget_source)
                    )
                node = freed
            picked.append(node)
            take(node, layer, need)
        for node in dict.fromkeys(popped + picked):  # back in the heap, once each
            version[node] += 1
            heapq.heappush(heap, (-free[node], order[node], version[node], node))
        chosen[layer] = tuple(picked)
    placement = ShadowPlacement(
        copies=copies, layers=tuple(chosen), layer_bytes=empty.layer_bytes, budgets=empty.budgets
    )
    placement.check(plan)
    return placement


def _no_room(
    layer: int, copy: int, copies: int, need: int, node: str, free: dict[str, int], budget: dict[str, int], source: str
) -> str:
    if source == CONFIG_SOURCE:
        where = f"of its {fmt_gib(budget[node])} budget ({CONFIG_SOURCE})"
        fix = f"raise {CONFIG_SOURCE}, add nodes or lower fault_tolerance.shadow_copies"
    else:
        where = f"of the {fmt_gib(budget[node])} of {source}"
        fix = f"set {CONFIG_SOURCE}, use nodes with more host memory, add nodes or lower fault_tolerance.shadow_copies"
    return (
        f"no node has host memory for shadow copy {copy} of {copies} of layer {layer} ({fmt_gib(need)} of weights "
        f"and optimizer state): of the nodes that do not hold it on their devices, {node} has the most left, "
        f"{fmt_gib(free[node])} {where}: {fix}"
    )


def _holders(plan: "Plan", shadows: "ShadowPlacement | None") -> list[frozenset[str]]:
    held = device_holders(plan)
    if shadows is None:
        return held
    if len(shadows.layers) != plan.num_layers:
        raise PlanningError(f"shadows of {len(shadows.layers)} layers for a plan of {plan.num_layers}")
    return [h | frozenset(s) for h, s in zip(held, shadows.layers)]


def survives(plan: "Plan", shadows: "ShadowPlacement | None", lost_nodes: Iterable[str]) -> bool:
    """Whether every layer keeps a copy, on a device or in host memory, when `lost_nodes` fail."""
    lost = set(lost_nodes)
    return all(h - lost for h in _holders(plan, shadows))


def tolerated_losses(plan: "Plan", shadows: "ShadowPlacement | None" = None) -> int:
    """The largest k such that every loss of k nodes leaves a copy of every layer: a loss takes a
    layer only when it holds all the layer's holders, so the fewest holders of any layer - 1."""
    return min(len(h) for h in _holders(plan, shadows)) - 1


def describe(plan: "Plan", budget_source: str = CONFIG_SOURCE, *, list_nodes_up_to: int = 8) -> list[str]:
    """`oobleck plan`'s lines about the plan's shadow copies: how many, which losses the plan then
    survives, host memory per node against its budget, and (up to `list_nodes_up_to` nodes) each
    node's shadows. Nothing when the plan has none."""
    shadows = plan.shadows
    if shadows is None or shadows.copies == 0:
        return []
    s = shadows.copies
    out = [
        f"shadow copies (fault_tolerance.shadow_copies={s}): every layer also in the host memory of {s} "
        f"node(s) that do not hold it on their devices; any {tolerated_losses(plan, shadows)} simultaneous "
        f"node losses leave a copy of every layer ({tolerated_losses(plan)} without them)"
    ]
    load, budget = shadows.load(), shadows.budget()
    low, high = min(budget.values()), max(budget.values())
    each = f"{fmt_gib(low)} each" if low == high else f"{fmt_gib(low)} to {fmt_gib(high)}"
    out.append(
        f"  host memory for shadows per node: most {fmt_gib(max(load.values()))}, least {fmt_gib(min(load.values()))}, "
        f"of {each} ({budget_source})"
    )
    if len(plan.nodes) <= list_nodes_up_to:
        layers = shadows.by_node()
        for node in plan.nodes:
            out.append(
                f"  {node}: layers {_spans(layers.get(node, []))} ({fmt_gib(load[node])} of {fmt_gib(budget[node])})"
            )
    return out


def _spans(layers: Sequence[int]) -> str:
    """`0-2, 5` for [0, 1, 2, 5]; `none` for []."""
    if not layers:
        return "none"
    runs: list[list[int]] = []
    for x in sorted(layers):
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
