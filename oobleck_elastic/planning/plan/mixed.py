"""Instantiation on a mixed fleet: which templates of which device class run, and their microbatches.

Each class has its own templates (built for its devices' speed and memory) and its own nodes; a
pipeline runs on nodes of one class. For a makespan Z a template's capacity is the microbatches
it runs within Z; the fleet runs B microbatches within Z when the classes' best covers of at most
their nodes, with min(f + 1, ...) pipelines in all, hold B. A class's best capacity per pipeline
count is one knapsack over its nodes (`cover_table`), the classes combine by a max-plus
convolution over the count, and the least Z is bisected over every template's T_t(b). Exact
within the model. Nodes that run nothing within Z stay idle: a class can be left out.
docs/planning.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import numpy as np

from ..errors import PlanningError
from ..templates.templates import TemplateSet
from .instantiate import Cover, candidate_makespans, cover_table, cover_walk, take_back, template_capacity

__all__ = ["MixedAssignment", "instantiate_mixed"]


@dataclass(frozen=True)
class MixedAssignment:
    """The pure-number result of a mixed fleet's instantiation."""

    pipelines: tuple[tuple[str, int, int], ...]
    """(class, template node count, microbatches) per pipeline: classes in the order given,
    larger templates first within a class."""
    nodes_used: dict[str, int]
    """Nodes of each class that run pipelines; the rest are spares."""
    makespan_s: float
    """Estimated time of one step: the slowest pipeline's iteration time."""
    warnings: tuple[str, ...] = ()
    """Why the plan is below the fault-tolerance target or leaves nodes idle."""


def _class_best(tset: TemplateSet, nodes: int, z: float, k: int, cap: int) -> tuple[np.ndarray, Callable[[int], Cover]]:
    """For one class at makespan `z`: best[c], the most microbatches a cover of at most `nodes`
    nodes by c pipelines (c capped at k) runs within z (-1: none), and the cover of a count c."""
    sizes = [n for n in tset.sizes() if n <= nodes]
    values = [template_capacity(tset[n], z, k, cap) for n in sizes]
    usable = [(s, v) for s, v in zip(sizes, values) if v > 0]
    best = np.full(k + 1, -1, dtype=np.int64)
    best[0] = 0
    if not usable:
        return best, lambda c: {}
    us, uv = [s for s, _ in usable], [v for _, v in usable]
    value, last, before = cover_table(us, uv, nodes, k)
    at: dict[int, int] = {}  # count -> the nodes its best cover uses
    for c in range(1, k + 1):
        j = nodes - int(value[::-1, c].argmax())  # the most nodes among the best (as instantiate uses them)
        if value[j, c] >= 0:
            best[c], at[c] = value[j, c], j
    return best, lambda c: cover_walk(us, last, before, at[c], c)


def _fleet(
    sets: Mapping[str, TemplateSet], counts: Mapping[str, int], z: float, k: int, cap: int
) -> tuple[int, dict[str, Cover]]:
    """The most microbatches the fleet runs within `z` with at least k pipelines (-1: k are not
    reachable), and the covers (class -> template size -> pipelines) that do it."""
    comb = np.full(k + 1, -1, dtype=np.int64)
    comb[0] = 0
    trail = []
    for name in sets:
        best, how = _class_best(sets[name], counts[name], z, k, cap)
        new = np.full(k + 1, -1, dtype=np.int64)
        pick = [(0, 0)] * (k + 1)
        for a in range(k + 1):
            if comb[a] < 0:
                continue
            for b in range(k + 1):
                if best[b] < 0:
                    continue
                c = min(a + b, k)
                if comb[a] + best[b] > new[c]:
                    new[c], pick[c] = comb[a] + best[b], (a, b)
        trail.append((name, how, pick))
        comb = new
    if comb[k] < 0:
        return -1, {}
    covers: dict[str, Cover] = {}
    c = k
    for name, how, pick in reversed(trail):
        a, b = pick[c]
        if b > 0:
            covers[name] = how(b)
        c = a
    return int(comb[k]), covers


def instantiate_mixed(
    sets: Mapping[str, TemplateSet],
    counts: Mapping[str, int],
    *,
    num_microbatches: int,
    f: int,
    microbatch_cap: Optional[int] = None,
) -> MixedAssignment:
    """Pipelines, each on nodes of one class, and microbatches for `counts[c]` nodes of each
    class `c` with templates `sets[c]`: the least makespan, the pipelines' count at least
    min(f + 1, pipelines the fleet can hold, B). Raises PlanningError when no class can hold a
    replica or the microbatches do not fit."""
    B = num_microbatches
    if B < 1:
        raise PlanningError("the global batch has no microbatch")
    if set(sets) != set(counts):
        raise PlanningError(f"classes with templates {sorted(sets)} but nodes of {sorted(counts)}")
    holdable = sum(counts[c] // sets[c].n0 for c in sets)
    if holdable == 0:
        need = ", ".join(f"{c}: {counts[c]} of n0={sets[c].n0}" for c in sets)
        raise PlanningError(f"no class has the nodes to hold one replica of the model ({need})")
    warnings: list[str] = []
    k = min(f + 1, holdable, B)
    if k < f + 1:
        why = f"only {holdable} replica(s) fit on the fleet" if holdable < f + 1 else f"only {B} microbatches"
        warnings.append(
            f"{k} pipeline(s) instead of f+1={f + 1} (fault_tolerance.f={f}): {why}; "
            "a failure may need a checkpoint restore"
        )
    cap = microbatch_cap if microbatch_cap is not None else B
    tpl = [sets[c][n] for c in sets for n in sets[c].sizes() if n <= counts[c]]
    cands = candidate_makespans(tpl, k, min(B, cap))
    seen: dict[float, tuple[int, dict[str, Cover]]] = {}

    def fleet(z: float) -> tuple[int, dict[str, Cover]]:
        if z not in seen:
            seen[z] = _fleet(sets, counts, z, k, cap)
        return seen[z]

    lo, hi = 0, len(cands) - 1
    if len(cands) == 0 or fleet(float(cands[hi]))[0] < B:
        raise PlanningError(
            f"{B} microbatches do not fit: each pipeline may take at most {cap} "
            "(GPipe keeps all of them in memory); use schedule 1f1b or more memory"
        )
    while lo < hi:  # the least feasible candidate (feasibility only grows with Z)
        mid = (lo + hi) // 2
        if fleet(float(cands[mid]))[0] >= B:
            hi = mid
        else:
            lo = mid + 1
    z = float(cands[lo])
    _, covers = fleet(z)
    who = [(c, n) for c in sets for n in sorted(covers.get(c, {}), reverse=True) for _ in range(covers[c][n])]
    mbs = [template_capacity(sets[c][n], z, k, cap) for c, n in who]
    if len(who) > B:  # more pipelines than microbatches: the most capable B, at least k of them
        keep = sorted(sorted(range(len(who)), key=lambda i: -mbs[i])[:B])
        who, mbs = [who[i] for i in keep], [mbs[i] for i in keep]
    mbs = take_back(mbs, B, [sets[c][n] for c, n in who], k)  # from the slowest pipelines first
    used = {c: sum(n for cc, n in who if cc == c) for c in sets}
    makespan = max(sets[c][n].iteration_time(b, len(who)) for (c, n), b in zip(who, mbs))
    for c in sets:
        idle = counts[c] - used[c]
        if idle == 0:
            continue
        fits = [n for n in sets[c].sizes() if n <= counts[c]]
        fastest = min((sets[c][n].iteration_time(1, k) for n in fits), default=None)
        if used[c] == 0 and fastest is not None and fastest > z:
            warnings.append(
                f"class {c} left out: its fastest pipeline takes {fastest:.4g} s for one microbatch, "
                f"longer than the step of {makespan:.4g} s the other classes make without it"
            )
        elif used[c] == 0 and fastest is None:
            warnings.append(f"class {c} left out: its {counts[c]} node(s) cannot hold one replica (n0={sets[c].n0})")
        else:
            warnings.append(
                f"{idle} node(s) of class {c} left idle as spares: no more of its pipelines shortens the step"
            )
    return MixedAssignment(
        pipelines=tuple((c, n, b) for (c, n), b in zip(who, mbs)),
        nodes_used=used,
        makespan_s=makespan,
        warnings=tuple(warnings),
    )
