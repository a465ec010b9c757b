"""Planning at scale: the fast paths give the very results of the direct computations they replace."""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Optional

import pytest
from test_planning import random_profile

from oobleck_elastic.planning import (
    Links,
    ModelProfile,
    PipelineSpec,
    Plan,
    PlanningError,
    StagePlacement,
    TemplateSet,
    build_templates,
    instantiate,
    make_plan,
)
from oobleck_elastic.planning.profile.analytic import gpt3_175b_profile
from oobleck_elastic.planning.plan.instantiate import _cover_dp, _least_makespan, candidate_makespans
from oobleck_elastic.planning.templates.templates import GIB, brute_force_template
from oobleck_elastic.planning.templates.partition import StageCosts, best_partition
from oobleck_elastic.planning.plan.placement import (
    bytes_received,
    keep_layers_in_place,
    keep_layers_in_place_pairwise,
    shard_bytes_of,
)


@functools.cache
def _gpt3_templates(tp: int, max_nodes: int | None = None) -> TemplateSet:
    return build_templates(
        gpt3_175b_profile(tensor_parallel=tp).in_mode("full"),  # what configs/gpt3-175b.yaml plans
        gpus_per_node=8,
        device_memory_gb=80.0,
        memory_margin=0.1,
        links=Links(),
        tensor_parallel=tp,
        max_nodes=max_nodes,
    )


def test_candidate_makespans_are_the_iteration_times_bit_for_bit() -> None:
    ts = _gpt3_templates(8, 20)
    tpl = [ts[n] for n in ts.sizes()]
    want = sorted({t.iteration_time(b, 3) for t in tpl for b in range(1, 41)})
    assert candidate_makespans(tpl, 3, 40).tolist() == want


@pytest.mark.parametrize("seed", range(20))
def test_partitions_sharing_one_stage_costs_equal_brute_force(seed: int) -> None:
    """One StageCosts serves every stage count in a random order (its matrices and bottleneck
    chains are shared), counts that are no multiple of the stages per node included."""
    rng = random.Random(seed)
    L = rng.randint(3, 9)
    profile = ModelProfile(  # with what crosses a stage boundary, so that the links matter
        layers=[
            dataclasses.replace(layer, output_bytes=int(rng.uniform(0.01, 0.5) * GIB))
            for layer in random_profile(rng, L).layers
        ]
    )
    costs = StageCosts(
        profile,
        memory_limit_bytes=rng.uniform(0.8, 3.0) * GIB,
        schedule=rng.choice(["1f1b", "gpipe"]),
        gpipe_microbatches=3,
        links=Links(intra_node_gb_s=rng.uniform(1, 100), inter_node_gb_s=rng.uniform(0.1, 5), latency_s=1e-3),
        stages_per_node=rng.choice([2, 3]),
    )
    for stages in rng.sample(range(1, L + 1), L):
        got = best_partition(costs, stages)
        want = brute_force_template(costs, stages, 1, 8)
        assert (got is None) == (want is None)
        if got is not None:
            times = [costs.stage_time(u, v, i, stages) for i, (u, v) in enumerate(got)]
            assert sum(times) + 7 * max(times) == pytest.approx(want[0], rel=1e-9)


def test_a_window_of_candidates_is_the_full_list_cut() -> None:
    tpl = [_gpt3_templates(8, 20)[n] for n in _gpt3_templates(8, 20).sizes()]
    full = candidate_makespans(tpl, 2, 300)
    lowest, highest = float(full[1000]) - 1e-9, float(full[2500])
    window = candidate_makespans(tpl, 2, 300, lowest=lowest, highest=highest)
    assert window.tolist() == full[(full >= lowest) & (full <= highest)].tolist() and len(window) == 1501


@pytest.mark.parametrize("at", [0, 1, 7, 500, 20_000, 59_999])
def test_least_makespan_is_the_least_feasible_candidate(at: int) -> None:
    """Wherever the answer lies above the relaxation's start (the window grows to reach it), the
    search returns the least candidate the feasibility test accepts; None when it accepts none."""
    tpl = [_gpt3_templates(8)[n] for n in _gpt3_templates(8).sizes()]
    full = candidate_makespans(tpl, 2, 1000)
    need = [3] * len(tpl)
    start = min(t.iteration_time(3, 2) for t in tpl)
    first = int((full >= start).argmax())
    threshold = float(full[min(first + at, len(full) - 1)])
    asked: list[float] = []

    def feasible(z: float) -> bool:
        asked.append(z)
        return z >= threshold

    got = _least_makespan(tpl, 2, 1000, lambda z: z >= start, feasible, need=need)
    assert got == threshold
    assert len(asked) < 80  # a gallop and a bisection, not a scan
    assert _least_makespan(tpl, 2, 1000, lambda z: z >= start, lambda z: False, need=need) is None


def _cover_dp_by_rows(sizes: list[int], values: list[int], total: int, kmin: int) -> Optional[tuple[int, dict]]:
    """The knapsack of `_cover_dp` one row and one size at a time, in plain Python: the order
    its ties must follow (the first size in order, then the smaller count, wins)."""
    best: list[list[Optional[tuple[int, int, int]]]] = [[None] * (kmin + 1) for _ in range(total + 1)]
    best[0][0] = (0, 0, 0)
    for j in range(1, total + 1):
        for s, v in zip(sizes, values):
            for c, prev in enumerate(best[j - s] if s <= j else []):
                nc = min(c + 1, kmin)
                if prev is not None and (best[j][nc] is None or prev[0] + v > best[j][nc][0]):
                    best[j][nc] = (prev[0] + v, s, c)
    ok = [c for c in range(kmin, kmin + 1) if best[total][c] is not None]
    if not ok:
        return None
    c, cover, j = ok[0], {}, total
    value = best[total][c][0]
    while j > 0:
        _, s, c = best[j][c]
        cover[s] = cover.get(s, 0) + 1
        j -= s
    return value, cover


@pytest.mark.parametrize("seed", range(40))
def test_cover_dp_equals_the_row_by_row_knapsack(seed: int) -> None:
    rng = random.Random(seed)
    sizes = sorted(rng.sample(range(1, 30), rng.randint(1, 8)))
    for _ in range(10):
        values = [rng.randint(1, 6) for _ in sizes]  # few distinct values: many ties
        total, kmin = rng.randint(1, 120), rng.randint(0, 4)
        assert _cover_dp(sizes, values, total, kmin, None) == _cover_dp_by_rows(sizes, values, total, kmin)


def _random_replans(seed: int):
    """A random template set, a plan on some nodes, then survivors (shuffled, some new nodes)."""
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(3, 30), mem_scale=rng.uniform(0.2, 1.5))
    g = rng.choice([1, 2, 4, 8])
    tp = rng.choice([d for d in (1, 2, 4, 8) if g % d == 0])
    try:
        ts = build_templates(
            profile, gpus_per_node=g, device_memory_gb=rng.uniform(1.0, 8.0), tensor_parallel=tp, max_nodes=12
        )
    except PlanningError:
        return
    B, f = rng.randint(1, 200), rng.randint(0, 2)
    nodes = [f"n{i}" for i in range(rng.randint(ts.n0, 60))]
    previous = make_plan(ts, nodes=nodes, num_microbatches=B, microbatch_size=1, f=f)
    for _ in range(4):
        keep = rng.choice([0.5, 0.9, 0.98])
        survivors = [x for x in nodes if rng.random() < keep] + [f"new{i}" for i in range(rng.randint(0, 3))]
        if rng.random() < 0.5:
            rng.shuffle(survivors)
        if len(survivors) >= ts.n0:
            a = instantiate(ts, num_nodes=len(survivors), num_microbatches=B, f=f)
            yield ts, a, survivors, previous


@pytest.mark.parametrize("seed", range(60))
def test_placement_equals_the_pairwise_rule(seed: int) -> None:
    for ts, a, survivors, previous in _random_replans(seed):
        assert keep_layers_in_place(ts, a, list(survivors), previous) == keep_layers_in_place_pairwise(
            ts, a, list(survivors), previous
        )


def test_placement_equals_the_pairwise_rule_for_gpt3_at_tp8() -> None:
    ts = _gpt3_templates(8)
    nodes = [f"node{i}" for i in range(128)]
    previous = make_plan(ts, nodes=nodes, num_microbatches=1536, microbatch_size=1, f=1)
    survivors = nodes[:40] + nodes[41:90] + nodes[92:] + ["fresh"]
    a = instantiate(ts, num_nodes=len(survivors), num_microbatches=1536, f=1)
    placed = keep_layers_in_place(ts, a, list(survivors), previous)
    assert placed == keep_layers_in_place_pairwise(ts, a, list(survivors), previous)
    assert placed != survivors  # the loss shifts the pipelines: placement has work to do


def _two_stage_plan(nodes: list[str], generation: int, cuts: list[tuple[int, int]]) -> Plan:
    """One pipeline of one stage per node (1 device per node) over the given layer ranges."""
    stages = tuple(
        StagePlacement(index=i, start=s, end=e, node=n, local_rank=0, rank=i)
        for i, (n, (s, e)) in enumerate(zip(nodes, cuts))
    )
    pipe = PipelineSpec(
        index=0, template_nodes=len(nodes), nodes=tuple(nodes), microbatches=1, stages=stages, est_time_s=1.0
    )
    return Plan(
        generation=generation,
        nodes=tuple(nodes),
        spares=(),
        gpus_per_node=1,
        num_layers=cuts[-1][1],
        microbatch_size=1,
        pipelines=(pipe,),
        est_step_time_s=1.0,
        f=0,
    )


def test_bytes_received_counts_the_layers_a_worker_did_not_hold() -> None:
    layer = [1, 10, 100, 1000, 10000]
    before = _two_stage_plan(["a", "b"], 1, [(0, 2), (2, 5)])  # a: 0-1, b: 2-4
    after = _two_stage_plan(["b", "c"], 2, [(0, 3), (3, 5)])  # b: 0-2 (keeps 2), c: 3-4 (new)
    assert bytes_received(before, after, layer) == {"b": 1 + 10, "c": 1000 + 10000}
    assert bytes_received(after, after, layer) == {}
    shards = shard_bytes_of(gpt3_175b_profile(tensor_parallel=8).layers)
    block = gpt3_175b_profile(tensor_parallel=8).layers[1]
    assert shards[1] == block.param_bytes + block.optimizer_bytes


@pytest.mark.parametrize("seed", range(20))
def test_placement_equals_the_pairwise_rule_across_degrees(seed: int) -> None:
    """A previous plan at another tensor-parallel degree: a stage's lanes overlap partly."""
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(8, 30), mem_scale=0.2)
    ts = {tp: build_templates(profile, gpus_per_node=4, device_memory_gb=8.0, tensor_parallel=tp) for tp in (1, 2, 4)}
    old_tp, new_tp = rng.sample([1, 2, 4], 2)
    nodes = [f"n{i}" for i in range(rng.randint(ts[old_tp].n0, 40))]
    previous = make_plan(ts[old_tp], nodes=nodes, num_microbatches=64, microbatch_size=1, f=1)
    survivors = [x for x in nodes if rng.random() < 0.8]
    rng.shuffle(survivors)
    if len(survivors) < ts[new_tp].n0:
        return
    a = instantiate(ts[new_tp], num_nodes=len(survivors), num_microbatches=64, f=1)
    assert keep_layers_in_place(ts[new_tp], a, list(survivors), previous) == keep_layers_in_place_pairwise(
        ts[new_tp], a, list(survivors), previous
    )
