"""Instantiation: which templates run on N nodes, and how many microbatches each pipeline gets.

Pipelines (a multiset of templates) and b_p >= 1 microbatches each, sum b_p = B, that keep at
least min(f + 1, N // n0, B) pipelines, use as many nodes as possible, then minimise the makespan
max_p T_p(b_p). Exact: the optimal makespan is one of the values T_t(b), searched by galloping and
bisection, each candidate decided by an unbounded knapsack with an exact weight (cut to the
remainder N mod n_t* by an exchange argument on the template of best capacity per node).
Its speed at scale is in bench/RESULTS.md (`python bench/planner.py`). docs/planning.md.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..errors import PlanningError
from ..templates.templates import TemplateSet

Cover = dict[int, int]  # template node count -> number of pipelines


@dataclass(frozen=True)
class Assignment:
    """The pure-number result of instantiation (node ids are attached by `plan.make_plan`)."""

    pipelines: tuple[tuple[int, int], ...]
    """(template node count, microbatches) per pipeline, larger templates first."""
    nodes_used: int
    """Nodes that run pipelines; the rest are spares."""
    makespan_s: float
    """Estimated time of one step: the slowest pipeline's iteration time."""
    warnings: tuple[str, ...] = ()
    """Why the plan is below the fault-tolerance target or leaves nodes idle."""


def _cover_dp(
    sizes: Sequence[int], values: Sequence[int], total: int, kmin: int, kmax: Optional[int]
) -> Optional[tuple[int, Cover]]:
    """Exact cover of `total` nodes with template sizes, pipeline count in [kmin, kmax],
    maximising the summed value. DP over (nodes, count): the count is capped at kmin (all that
    matters for a lower bound) unless kmax can bind, then tracked exactly up to kmax."""
    exact = kmax is not None and total // min(sizes) > kmax
    if exact:
        assert kmax is not None
        return _cover_dp_exact_count(sizes, values, total, kmin, kmax)
    value, last, before = cover_table(sizes, values, total, kmin)
    if value[total, kmin] < 0:
        return None
    return int(value[total, kmin]), cover_walk(sizes, last, before, total, kmin)


def cover_table(
    sizes: Sequence[int], values: Sequence[int], total: int, cmax: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The knapsack of `_cover_dp` for every node count up to `total`: value[j, c] is the best
    value of exactly j nodes covered by min(count, cmax) == c pipelines (-1: unreachable); last
    and before let `cover_walk` rebuild the cover of any (j, c)."""
    # value[j, c]: best value of j nodes with min(count, cmax) == c pipelines (-1: unreachable);
    # last[j, c]: index of the last pipeline's size; before[j, c]: the count before it
    size = np.asarray(sizes, dtype=np.int64)
    gain = np.asarray(values, dtype=np.int64)
    value = np.full((total + 1, cmax + 1), -1, dtype=np.int64)
    last = np.zeros((total + 1, cmax + 1), dtype=np.int64)
    before = np.zeros((total + 1, cmax + 1), dtype=np.int64)
    value[0, 0] = 0
    # row j reads rows j - s only, s >= min(sizes): that many rows at a time depend on earlier rows only
    step = int(size.min())
    from_count = np.maximum(np.arange(cmax + 1) - 1, 0)  # a pipeline more: count c comes from c - 1 ...
    for j0 in range(1, total + 1, step):
        rows = slice(j0, min(j0 + step, total + 1))
        src = np.arange(rows.start, rows.stop)[:, None] - size[None, :]  # (rows, sizes)
        prev = value[np.maximum(src, 0)]  # (rows, sizes, count)
        cand = np.where((src >= 0)[:, :, None] & (prev >= 0), prev + gain[None, :, None], -1)
        if cmax == 0:
            new, came = cand, None
        else:  # ... and the capped count from cmax itself, on a strictly better value (the earlier count wins ties)
            new = np.empty_like(cand)
            new[:, :, 0] = -1
            new[:, :, 1:] = cand[:, :, :-1]
            capped = cand[:, :, cmax] > new[:, :, cmax]
            new[:, :, cmax][capped] = cand[:, :, cmax][capped]
            came = np.broadcast_to(from_count, new.shape).copy()
            came[:, :, cmax] = np.where(capped, cmax, cmax - 1)
        pick = new.argmax(axis=1)  # the first size with the best value, as a scan in size order keeps
        value[rows] = new.max(axis=1)
        last[rows] = pick
        if came is not None:
            r, c = np.indices(pick.shape)
            before[rows] = came[r, pick, c]
    return value, last, before


def cover_walk(sizes: Sequence[int], last: np.ndarray, before: np.ndarray, j: int, c: int) -> Cover:
    """The cover `cover_table` found for j nodes at capped count c."""
    cover: Cover = {}
    while j > 0:
        s, c = sizes[int(last[j, c])], int(before[j, c])
        cover[s] = cover.get(s, 0) + 1
        j -= s
    return cover


def _cover_dp_exact_count(
    sizes: Sequence[int], values: Sequence[int], total: int, kmin: int, kmax: int
) -> Optional[tuple[int, Cover]]:
    """`_cover_dp` when the pipeline count must stay <= kmax (more nodes than microbatches can
    keep busy): the count is tracked exactly, vectorised over it with numpy."""
    best = np.full((total + 1, kmax + 1), -1, dtype=np.int64)  # -1 = unreachable
    choice = np.full((total + 1, kmax + 1), -1, dtype=np.int64)
    best[0, 0] = 0
    for j in range(1, total + 1):
        row, pick = best[j], choice[j]
        for ti, (s, v) in enumerate(zip(sizes, values)):
            if s > j:
                continue
            prev = best[j - s, :-1]
            cand = np.where(prev >= 0, prev + v, -1)
            better = cand > row[1:]
            row[1:][better] = cand[better]
            pick[1:][better] = ti
    counts = [c for c in range(kmin, kmax + 1) if best[total, c] >= 0]
    if not counts:
        return None
    c = max(counts, key=lambda c: (int(best[total, c]), -c))
    value = int(best[total, c])
    cover: Cover = {}
    j = total
    while j > 0:
        s = sizes[int(choice[j, c])]
        cover[s] = cover.get(s, 0) + 1
        j, c = j - s, c - 1
    return value, cover


def best_cover(
    sizes: Sequence[int], values: Sequence[int], total: int, *, kmin: int = 0, kmax: Optional[int] = None
) -> Optional[tuple[int, Cover]]:
    """Max-value exact cover of `total` by `sizes` with kmin <= count <= kmax; sizes whose value
    is 0 are unusable. Returns (value, cover) or None."""
    usable = [(s, v) for s, v in zip(sizes, values) if v > 0 and s <= total]
    if total == 0:
        return (0, {}) if kmin == 0 else None
    if not usable:
        return None
    sizes, values = [s for s, _ in usable], [v for _, v in usable]
    n_max = max(sizes)
    binds = (-(-total // n_max) < kmin) or (kmax is not None and total // min(sizes) > kmax)
    star = max(range(len(sizes)), key=lambda i: (values[i] / sizes[i], -sizes[i]))
    ns, vs = sizes[star], values[star]
    bound = ns * n_max + n_max
    if binds or total <= bound:
        return _cover_dp(sizes, values, total, kmin, kmax)
    # Some optimal cover has < ns pipelines of other templates (module docstring), so its
    # non-t* part weighs r_opt <= (ns - 1) * n_max. The largest r <= bound congruent to total
    # is >= r_opt, so r_opt's cover plus t* copies covers r: one DP on r is exact.
    r = total % ns + ((bound - total % ns) // ns) * ns
    sub = _cover_dp(sizes, values, r, 0, None)
    if sub is None:
        return None
    q = (total - r) // ns
    cover = dict(sub[1])
    cover[ns] = cover.get(ns, 0) + q
    return sub[0] + q * vs, cover


def instantiate(
    templates: TemplateSet, *, num_nodes: int, num_microbatches: int, f: int, microbatch_cap: Optional[int] = None
) -> Assignment:
    """Pipelines and microbatches for `num_nodes` nodes. Never fails for num_nodes >= n0.

    `microbatch_cap` bounds microbatches per pipeline (GPipe memory was planned for it).
    """
    n0 = templates.n0
    B = num_microbatches
    if num_nodes < n0:
        raise PlanningError(f"{num_nodes} node(s) cannot hold one replica: at least n0={n0} are needed")
    if B < 1:
        raise PlanningError("the global batch has no microbatch")
    sizes = templates.sizes()
    tpl = [templates[n] for n in sizes]
    warnings: list[str] = []
    k = min(f + 1, num_nodes // n0, B)
    if k < f + 1:
        why = (
            f"only {num_nodes} nodes (n0={n0})"
            if num_nodes // n0 < f + 1
            else f"only {B} microbatches per global batch"
        )
        warnings.append(
            f"{k} pipeline(s) instead of f+1={f + 1} (fault_tolerance.f={f}): {why}; "
            "a failure may need a checkpoint restore"
        )
    ones = [1] * len(sizes)
    used = min(num_nodes, B * max(sizes))  # at most B pipelines: one microbatch each
    while used >= n0 and best_cover(sizes, ones, used, kmin=k, kmax=B) is None:
        used -= 1
    if used < num_nodes:
        warnings.append(
            f"{num_nodes - used} node(s) left idle as spares: no combination of template "
            f"sizes {sizes} adds up to {num_nodes} with at least {k} pipelines"
            + (f" and at most {B} (one microbatch each)" if num_nodes // n0 > B else "")
        )
    cap = microbatch_cap if microbatch_cap is not None else B

    def capacity(t, z: float) -> int:
        return template_capacity(t, z, k, cap)

    checked: dict[float, Optional[tuple[int, Cover]]] = {}

    def feasible(z: float) -> Optional[tuple[int, Cover]]:
        if z not in checked:
            got = best_cover(sizes, [capacity(t, z) for t in tpl], used, kmin=k, kmax=B)
            checked[z] = got if got is not None and got[0] >= B else None
        return checked[z]

    def allowed(z: float) -> bool:
        """No cover of `used` nodes holds more than `used` x the best capacity per node (an
        integer test, no rounding): where this is False nothing is feasible."""
        return any(capacity(t, z) * used >= B * t.num_nodes for t in tpl)

    z = _least_makespan(
        tpl, k, min(B, cap), allowed, lambda z: feasible(z) is not None, need=[-(-B * t.num_nodes // used) for t in tpl]
    )
    if z is None:
        raise PlanningError(
            f"{B} microbatches do not fit: each pipeline may take at most {cap} "
            "(GPipe keeps all of them in memory); use schedule 1f1b or more memory"
        )
    _, cover = feasible(z)  # type: ignore[misc]
    pipes = [[n, capacity(templates[n], z)] for n in sorted(cover, reverse=True) for _ in range(cover[n])]
    counts = take_back([b for _, b in pipes], B, [templates[n] for n, _ in pipes], k)
    pipes = [[n, b] for (n, _), b in zip(pipes, counts)]
    makespan = max(templates[n].iteration_time(b, len(pipes)) for n, b in pipes)
    return Assignment(
        pipelines=tuple((n, b) for n, b in pipes), nodes_used=used, makespan_s=makespan, warnings=tuple(warnings)
    )


def take_back(counts: Sequence[int], total: int, tpl: Sequence, k: int) -> list[int]:
    """`counts` (microbatches per pipeline of templates `tpl`, at least `total` in all) with the
    excess taken back one at a time from the pipeline whose iteration time among `k` is then
    longest (the first of equals), never below one each."""
    counts = list(counts)
    excess = sum(counts) - total
    heap = [(-t.iteration_time(b, k), i) for i, (t, b) in enumerate(zip(tpl, counts))]
    heapq.heapify(heap)
    while excess > 0:
        _, i = heapq.heappop(heap)
        if counts[i] > 1:
            counts[i] -= 1
            excess -= 1
            heapq.heappush(heap, (-tpl[i].iteration_time(counts[i], k), i))
    return counts


def template_capacity(t, z: float, k: int, cap: int) -> int:
    """Microbatches template `t` runs within makespan `z` among `k` pipelines (at most `cap`;
    0 when even one does not fit)."""
    first = t.iteration_time(1, k)
    if z < first - 1e-12:
        return 0
    if t.bottleneck_s <= 0:
        return cap
    return min(cap, int(math.floor((z - first) / t.bottleneck_s + 1e-9)) + 1)


def _least_makespan(
    tpl: Sequence, replicas: int, most: int, allowed, feasible, *, need: Sequence[int]
) -> Optional[float]:
    """The least candidate makespan (`candidate_makespans`) that `feasible` accepts, None when
    not even the largest is. `allowed` is a relaxation (False: surely infeasible) and `need[i]` the
    microbatches template i must take for it to allow; both predicates are monotone in Z.

    The candidates are built only in a window: from one bottleneck below where the relaxation
    first allows (bisected exactly within the window) up to a span that quadruples while no
    candidate of the window is feasible. Galloping up from the relaxation's start, then
    bisecting, finds the least feasible one in a handful of knapsacks. The windows hold every
    candidate between their ends, so the answer is the one a search over all of them gives."""
    top = max(t.iteration_time(most, replicas) for t in tpl)
    starts = [t.iteration_time(b, replicas) for t, b in zip(tpl, need) if 1 <= b <= most]
    if not starts:
        return top if feasible(top) else None
    margin = max(t.bottleneck_s for t in tpl)
    lowest = min(starts) - margin  # below this, every template falls short of its need by a whole microbatch
    span = 64 * margin if margin > 0 else math.inf
    while True:
        highest = min(min(starts) + span, top)
        cands = candidate_makespans(tpl, replicas, most, lowest=lowest, highest=highest)
        lo, hi = 0, len(cands) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if allowed(float(cands[mid])):
                hi = mid
            else:
                lo = mid + 1
        if lo == 0 and allowed(float(cands[0])) and lowest > -math.inf:
            lowest = -math.inf  # the relaxation allows even the window's first: take every candidate
            continue
        step, below = 1, lo - 1
        while not feasible(float(cands[lo])):
            if lo == len(cands) - 1:
                break
            below, lo = lo, min(lo + step, len(cands) - 1)
            step *= 2
        else:
            hi, lo = lo, below + 1
            while lo < hi:
                mid = (lo + hi) // 2
                if feasible(float(cands[mid])):
                    hi = mid
                else:
                    lo = mid + 1
            return float(cands[lo])
        if highest >= top:
            return None
        span *= 4


def candidate_makespans(
    tpl: Sequence, replicas: int, most: int, *, lowest: float = -math.inf, highest: float = math.inf
) -> np.ndarray:
    """Every T_t(b) for b = 1..`most` within [lowest, highest], sorted and distinct: the values the
    optimal makespan can take. Computed as `Template.iteration_time` computes them (the same float
    operations in the same order, so the same values), in numpy: 93 templates x 8,192
    microbatches is 760,000, so the search asks for a window of them."""
    parts = []
    for t in tpl:
        base, step, sync = t.total_time_s, t.bottleneck_s, t.grad_sync_s(replicas)
        first, last = 0, most - 1
        if step <= 0:
            last = 0  # every b gives the same value
        else:  # the b range of the window, one wider on each side; the values decide below
            if lowest > -math.inf:
                first = max(first, math.floor((lowest - base - sync) / step) - 1)
            if highest < math.inf:
                last = min(last, math.ceil((highest - base - sync) / step) + 1)
        if first > last:
            continue
        b = np.arange(first, last + 1, dtype=np.float64)
        values = base + b * step + sync
        parts.append(values[(values >= lowest) & (values <= highest)])
    return np.unique(np.concatenate(parts)) if parts else np.empty(0)


def coverage(templates: TemplateSet, f: int, *, upto: int) -> tuple[list[int], list[int]]:
    """Node counts in [(f+1)*n0, upto] that can / cannot be fully used with >= f+1 pipelines."""
    sizes = templates.sizes()
    lo = (f + 1) * templates.n0
    # reach[c][j]: j nodes as a sum of min(count, f+1) == c template sizes
    reach = [[False] * (upto + 1) for _ in range(f + 2)]
    reach[0][0] = True
    for j in range(1, upto + 1):
        for s in sizes:
            if s <= j:
                for c in range(f + 2):
                    if reach[c][j - s]:
                        reach[min(c + 1, f + 1)][j] = True
    ok = [n for n in range(lo, upto + 1) if reach[f + 1][n]]
    bad = [n for n in range(lo, upto + 1) if not reach[f + 1][n]]
    return ok, bad


def split_microbatches(
    templates: TemplateSet, sizes: Sequence[int], num_microbatches: int, cap: int
) -> Optional[list[int]]:
    """Microbatches per pipeline for the fixed pipelines `sizes` (template node counts): each
    takes at least one and at most `cap`, and each next one goes to the pipeline whose iteration
    time after taking it is least, which minimises the makespan (times never fall as a pipeline
    takes more). None when the pipelines cannot take `num_microbatches`."""
    k = len(sizes)
    if not 1 <= k <= num_microbatches or k * cap < num_microbatches:
        return None
    counts = [1] * k
    heap = [(templates[n].iteration_time(2, k), i) for i, n in enumerate(sizes) if cap > 1]
    heapq.heapify(heap)
    for _ in range(num_microbatches - k):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        if counts[i] < cap:
            heapq.heappush(heap, (templates[sizes[i]].iteration_time(counts[i] + 1, k), i))
    return counts


def instantiate_near(
    templates: TemplateSet,
    *,
    kept: Sequence[int],
    num_nodes: int,
    num_microbatches: int,
    f: int,
    best: Assignment,
    microbatch_cap: Optional[int] = None,
) -> Optional[Assignment]:
    """The assignment that keeps the pipelines `kept` (template node counts of the previous plan's
    pipelines whose nodes all remain) and forms pipelines only of the other `num_nodes` - sum(kept)
    nodes (the touched pipelines' survivors, spares, arrivals), with as many of them as templates
    cover and at least the pipelines f + 1 needs; the new pipelines are the cover whose capacity at
    `best`'s makespan is largest. None when no such assignment exists. A re-plan takes it over
    `best` when it costs little (plan/build.py, `planning.replan_tolerance`)."""
    B = num_microbatches
    cap = microbatch_cap if microbatch_cap is not None else B
    sizes = templates.sizes()
    kept = [n for n in kept if n in sizes]
    rest = num_nodes - sum(kept)
    if rest < 0 or len(kept) > B:
        return None
    k = min(f + 1, num_nodes // templates.n0, B)

    # what a pipeline of each size runs within best's makespan (at least 1: best_cover skips 0s)
    values = [max(1, template_capacity(templates[n], best.makespan_s, k, cap)) for n in sizes]
    need = max(0, k - len(kept))
    used = rest
    found = None
    while used >= 0 and found is None:
        found = best_cover(sizes, values, used, kmin=need, kmax=B - len(kept))
        if found is None:
            used -= 1
    if found is None:
        return None
    pipelines = sorted(kept + [n for n, c in found[1].items() for _ in range(c)], reverse=True)
    counts = split_microbatches(templates, pipelines, B, cap)
    if counts is None:
        return None
    k_all = len(pipelines)
    makespan = max(templates[n].iteration_time(b, k_all) for n, b in zip(pipelines, counts))
    idle = num_nodes - sum(pipelines)
    warnings = [w for w in best.warnings if "left idle" not in w]
    if idle:
        warnings.append(
            f"{idle} node(s) left idle as spares: the pipelines the change did not touch are kept, "
            f"and no combination of template sizes {sizes} covers the other {rest} node(s)"
        )
    return Assignment(
        pipelines=tuple(zip(pipelines, counts)),
        nodes_used=sum(pipelines),
        makespan_s=makespan,
        warnings=tuple(warnings),
    )
