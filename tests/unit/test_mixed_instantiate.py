"""A mixed fleet's instantiation (planning/plan/mixed.py) against brute force on small made-up fleets."""

from __future__ import annotations

import itertools
import random

import pytest

from oobleck_elastic.planning.errors import PlanningError
from oobleck_elastic.planning.plan.instantiate import split_microbatches
from oobleck_elastic.planning.plan.mixed import instantiate_mixed
from oobleck_elastic.planning.templates.templates import Template, TemplateSet


def _set(times: dict[int, tuple[float, float]]) -> TemplateSet:
    """Templates by node count with (one microbatch's time, bottleneck): no all-reduce counted."""
    return TemplateSet(
        templates={n: Template(num_nodes=n, gpus_per_node=1, stages=(), total_time_s=t, bottleneck_s=b)
                   for n, (t, b) in times.items()},
        gpus_per_node=1,
        num_layers=8,
    )  # fmt: skip


def _multisets(sizes: list[int], total: int) -> list[tuple[int, ...]]:
    """Every multiset of `sizes` whose sum is at most `total`."""
    out: list[tuple[int, ...]] = [()]
    for s in sizes:
        out = [m + (s,) * r for m in out for r in range(0, (total - sum(m)) // s + 1)]
    return out


def _brute(sets: dict[str, TemplateSet], counts: dict[str, int], B: int, f: int) -> float:
    """The least makespan over every choice of pipelines per class (each class within its
    nodes), at least min(f + 1, holdable, B) and at most B of them, with the best split of B."""
    holdable = sum(counts[c] // sets[c].n0 for c in sets)
    k = min(f + 1, holdable, B)
    per_class = [[(c, m) for m in _multisets(sets[c].sizes(), counts[c])] for c in sets]
    best = float("inf")
    for combo in itertools.product(*per_class):
        pipes = [(c, n) for c, m in combo for n in m]
        if not k <= len(pipes) <= B:
            continue
        # split_microbatches is exact for fixed pipelines of one set: join the classes' templates
        joined = TemplateSet(templates={i: sets[c][n] for i, (c, n) in enumerate(pipes)}, gpus_per_node=1, num_layers=8)
        split = split_microbatches(joined, list(range(len(pipes))), B, B)
        assert split is not None
        best = min(best, max(sets[c][n].iteration_time(b, k) for (c, n), b in zip(pipes, split)))
    return best


def test_the_mixed_makespan_is_the_brute_force_optimum_on_random_small_fleets() -> None:
    rng = random.Random(7)
    checked = 0
    for _ in range(120):
        sets, counts = {}, {}
        for c in ("fast", "slow", "odd")[: rng.randint(1, 3)]:
            n0 = rng.randint(1, 2)
            speed = rng.choice([1.0, 0.5, 0.25, 0.7])
            sets[c] = _set(
                {n: (round(rng.uniform(0.5, 2.0) / speed / n**0.5, 3), round(rng.uniform(0.1, 0.6) / speed / n, 3))
                 for n in range(n0, n0 + rng.randint(1, 3))}
            )  # fmt: skip
            counts[c] = rng.randint(0, 6)
        B, f = rng.randint(1, 9), rng.randint(0, 2)
        if sum(counts[c] // sets[c].n0 for c in sets) == 0:
            with pytest.raises(PlanningError, match="no class has the nodes to hold one replica"):
                instantiate_mixed(sets, counts, num_microbatches=B, f=f)
            continue
        a = instantiate_mixed(sets, counts, num_microbatches=B, f=f)
        assert a.makespan_s == pytest.approx(_brute(sets, counts, B, f), abs=1e-9), (sets, counts, B, f)
        assert sum(b for _, _, b in a.pipelines) == B and all(b >= 1 for _, _, b in a.pipelines)
        for c in sets:
            assert sum(n for cc, n, _ in a.pipelines if cc == c) == a.nodes_used[c] <= counts[c]
        checked += 1
    assert checked > 80


def test_a_class_too_slow_to_help_is_left_out_with_its_reason() -> None:
    fast = _set({1: (1.0, 0.25)})
    slow = _set({1: (10.0, 2.5)})  # one microbatch there takes longer than the whole batch on the fast nodes
    a = instantiate_mixed({"h100": fast, "v100": slow}, {"h100": 2, "v100": 2}, num_microbatches=8, f=1)
    assert [c for c, _, _ in a.pipelines] == ["h100", "h100"] and a.nodes_used == {"h100": 2, "v100": 0}
    assert a.makespan_s == pytest.approx(1.75)
    assert a.warnings == (
        "class v100 left out: its fastest pipeline takes 10 s for one microbatch, longer than the step "
        "of 1.75 s the other classes make without it",
    )
    # a slower class that helps is used: its pipeline takes two microbatches off the fast ones
    medium = _set({1: (1.2, 0.3)})
    b = instantiate_mixed({"h100": fast, "a100": medium}, {"h100": 2, "a100": 1}, num_microbatches=8, f=1)
    assert b.pipelines == (("h100", 1, 3), ("h100", 1, 3), ("a100", 1, 2)) and b.makespan_s == pytest.approx(1.5)
    assert b.warnings == ()
