"""Planner: templates are exactly optimal (brute force), instantiation is exact, complete, and
never fails for any node count >= n0 (the published Oobleck's KeyError: 1)."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from oobleck_elastic.planning import (
    LayerProfile,
    ModelProfile,
    Plan,
    PlanningError,
    best_cover,
    build_templates,
    guarantee,
    instantiate,
    make_plan,
    plan_job,
    templates_for,
)
from oobleck_elastic.planning.profile.analytic import gpt3_175b_profile
from oobleck_elastic.planning.templates.templates import GIB, best_template, brute_force_template
from oobleck_elastic.planning.templates.partition import StageCosts


def random_profile(rng: random.Random, num_layers: int, *, mem_scale: float = 1.0) -> ModelProfile:
    layers = []
    for i in range(num_layers):
        fwd = rng.uniform(0.1, 2.0)
        params = int(rng.uniform(0.05, 0.3) * GIB * mem_scale)
        layers.append(
            LayerProfile(
                name=f"l{i}",
                forward_s=fwd,
                backward_s=2 * fwd * rng.uniform(0.8, 1.2),
                param_bytes=params,
                grad_bytes=params,
                optimizer_bytes=2 * params,
                activation_bytes=int(rng.uniform(0.0, 0.2) * GIB * mem_scale),
            )
        )
    return ModelProfile(layers=layers, key={"random": True})


def uniform_profile(num_layers: int, *, gib_per_layer: float = 0.25) -> ModelProfile:
    b = int(gib_per_layer * GIB / 4)
    return ModelProfile(
        layers=[
            LayerProfile(
                name=f"l{i}",
                forward_s=1.0,
                backward_s=2.0,
                param_bytes=b,
                grad_bytes=b,
                optimizer_bytes=2 * b,
                activation_bytes=0,
            )
            for i in range(num_layers)
        ]
    )


# ---------------------------------------------------------------- templates


@pytest.mark.parametrize("seed", range(60))
def test_template_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    L = rng.randint(2, 9)
    g = rng.choice([1, 1, 2])
    schedule = rng.choice(["1f1b", "gpipe"])
    profile = random_profile(rng, L)
    limit = rng.uniform(0.6, 3.0) * GIB
    costs = StageCosts(profile, memory_limit_bytes=limit, schedule=schedule, gpipe_microbatches=3)
    for n in range(1, L // g + 1):
        got = best_template(costs, n, g)
        for m in (1, 2, 5, 40):
            want = brute_force_template(costs, n, g, m)
            if want is None:
                assert got is None, f"planner found {got} but no partition fits"
                continue
            assert got is not None, f"brute force found {want} but the planner found none"
            assert got.iteration_time(m) == pytest.approx(want[0], rel=1e-9, abs=1e-12)
            assert all(s.memory_bytes <= limit for s in got.stages)
            assert got.num_stages == n * g
            assert [(s.start, s.end) for s in got.stages][0][0] == 0
            assert got.stages[-1].end == L


def test_template_places_stages_on_nodes_and_devices() -> None:
    ts = build_templates(uniform_profile(8), gpus_per_node=2, device_memory_gb=100)
    t = ts[3]
    assert [(s.node, s.local_rank) for s in t.stages] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert t.layer_ranges()[0][0] == 0 and t.layer_ranges()[-1][1] == 8
    assert t.bottleneck_s == pytest.approx(6.0)  # 8 layers of 3 s over 6 stages: 2 layers max


def test_memory_is_a_hard_limit_counting_in_flight_activations() -> None:
    # Each layer: 1 GiB static, 1 GiB activations per microbatch. Under 1F1B stage 0 of S keeps S
    # microbatches, so with 4 GiB per device a 2-stage pipeline cannot put 2 layers on stage 0.
    layers = [
        LayerProfile(
            name=f"l{i}",
            forward_s=1,
            backward_s=1,
            param_bytes=GIB // 4,
            grad_bytes=GIB // 4,
            optimizer_bytes=GIB // 2,
            activation_bytes=GIB,
        )
        for i in range(3)
    ]
    ts = build_templates(ModelProfile(layers=layers), gpus_per_node=1, device_memory_gb=4)
    two = ts[2]
    assert two.layer_ranges() == [(0, 1), (1, 3)]  # stage 0: 1 + 2x1 = 3 GiB; stage 1: 2 + 1x2 = 4 GiB
    assert all(s.memory_bytes <= 4 * GIB for s in two.stages)
    assert 1 not in ts.templates  # one stage: 3 + 3 = 6 GiB
    assert ts.n0 == 2


def test_model_that_cannot_fit_names_the_layer_and_its_memory() -> None:
    layers = [
        LayerProfile(
            name="embedding",
            forward_s=1,
            backward_s=1,
            param_bytes=GIB,
            grad_bytes=GIB,
            optimizer_bytes=2 * GIB,
            activation_bytes=0,
        ),
        LayerProfile(
            name="head",
            forward_s=1,
            backward_s=1,
            param_bytes=GIB,
            grad_bytes=GIB,
            optimizer_bytes=2 * GIB,
            activation_bytes=GIB,
        ),
    ]
    with pytest.raises(PlanningError) as err:
        build_templates(ModelProfile(layers=layers), gpus_per_node=1, device_memory_gb=4.5)
    assert str(err.value) == (
        "the model cannot fit even with one layer per device: layer 1 'head' alone needs 5.00 GiB "
        "(params+grads+optimizer 4.00 GiB, activations 1.00 GiB per microbatch) but a device has 4.50 GiB "
        "usable of planning.device_memory_gb=4.5: raise planning.device_memory_gb or lower "
        "training.microbatch_size"
    )


def test_more_devices_per_node_than_layers_is_refused() -> None:
    with pytest.raises(PlanningError, match="lower planning.gpus_per_node"):
        build_templates(uniform_profile(3), gpus_per_node=4, device_memory_gb=10)


# ---------------------------------------------------------------- guarantee


def test_guarantee_covers_every_count_from_f_plus_1_n0() -> None:
    ts = build_templates(gpt3_175b_profile().in_mode("full"), gpus_per_node=8, device_memory_gb=80, memory_margin=0.1)
    assert (ts.n0, ts.n_max) == (6, 12)
    g = guarantee(ts, 1)
    assert g.meets_2n0 and g.covered_from == 12 and g.uncovered == ()
    for n in range(12, 200):
        assert best_cover(ts.sizes(), [1] * len(ts.sizes()), n, kmin=2) is not None


def test_guarantee_reports_gaps_when_templates_do_not_reach_2n0_minus_1() -> None:
    # 9 layers of 1 GiB on 2 GiB devices: one layer per device, so n0 = 5 (2 GiB margin-free per
    # device holds 2 layers? no: 1 GiB static each, 2 layers = 2 GiB fits) -> templates 5..9.
    profile = uniform_profile(9, gib_per_layer=1.0)
    ts = build_templates(profile, gpus_per_node=1, device_memory_gb=2.0)
    assert (ts.n0, ts.n_max) == (5, 9) and guarantee(ts, 0).meets_2n0
    short = build_templates(profile, gpus_per_node=1, device_memory_gb=2.0, node_counts=[5, 6, 7])
    g = guarantee(short, 0)
    assert not g.meets_2n0
    assert g.uncovered == (8, 9) and g.covered_from == 10
    g1 = guarantee(short, 1)  # f=1 starts at 10 = 2*n0, where sums of two sizes already touch
    assert g1.covered_from == 10 and g1.uncovered == ()
    ts2 = build_templates(profile, gpus_per_node=1, device_memory_gb=2.0, node_counts=[5, 6])
    g2 = guarantee(ts2, 0)
    assert g2.uncovered == (7, 8, 9, 13, 14, 19) and g2.covered_from == 20
    assert "7, 8, 9, 13, 14, 19 leave nodes idle" in g2.describe()


def test_config_that_cannot_hold_f_plus_1_replicas_is_refused() -> None:
    ts = build_templates(gpt3_175b_profile().in_mode("full"), gpus_per_node=8, device_memory_gb=80, memory_margin=0.1)
    with pytest.raises(PlanningError) as err:
        guarantee(ts, 2, max_nodes=16)
    assert str(err.value).startswith(
        "cannot tolerate f=2: 3 replicas need at least (f+1)*n0 = 18 nodes (n0=6) "
        "but the job has at most planning.max_nodes=16"
    )


# ---------------------------------------------------------------- instantiation


def brute_force_makespan(ts, N: int, B: int, kmin: int) -> float:
    """Try every multiset of templates covering N exactly and every split of B."""
    best = math.inf
    sizes = ts.sizes()
    for count in range(max(kmin, 1), min(N // ts.n0, B) + 1):
        for combo in itertools.combinations_with_replacement(sizes, count):
            if sum(combo) != N:
                continue
            for split in itertools.product(range(1, B + 1), repeat=count):
                if sum(split) == B:
                    best = min(best, max(ts[n].iteration_time(b) for n, b in zip(combo, split)))
    return best


@pytest.mark.parametrize("seed", range(25))
def test_instantiation_is_optimal_against_brute_force(seed: int) -> None:
    rng = random.Random(1000 + seed)
    profile = random_profile(rng, rng.randint(4, 7), mem_scale=0.5)
    memory = rng.uniform(0.8, 3.0)
    while True:
        try:
            ts = build_templates(profile, gpus_per_node=1, device_memory_gb=memory)
            break
        except PlanningError:
            memory *= 1.5
    f = rng.randint(0, 2)
    B = rng.randint(1, 6)
    for N in range(ts.n0, 9):
        a = instantiate(ts, num_nodes=N, num_microbatches=B, f=f)
        k = min(f + 1, N // ts.n0, B)
        if a.nodes_used == N:
            want = brute_force_makespan(ts, N, B, k)
            assert a.makespan_s == pytest.approx(want, rel=1e-9)
        assert len(a.pipelines) >= k


@pytest.mark.parametrize("seed", range(40))
def test_instantiation_properties_on_random_profiles(seed: int) -> None:
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(3, 24), mem_scale=rng.uniform(0.2, 1.5))
    g = rng.choice([1, 2, 4])
    try:
        ts = build_templates(profile, gpus_per_node=g, device_memory_gb=rng.uniform(1.0, 6.0))
    except PlanningError:
        return
    f = rng.randint(0, 3)
    B = rng.randint(1, 400)
    for N in sorted({ts.n0, ts.n0 + 1, rng.randint(ts.n0, 300), rng.randint(ts.n0, 3000)}):
        a = instantiate(ts, num_nodes=N, num_microbatches=B, f=f)
        assert sum(b for _, b in a.pipelines) == B
        assert all(b >= 1 and n in ts.templates for n, b in a.pipelines)
        assert sum(n for n, _ in a.pipelines) == a.nodes_used <= N
        assert len(a.pipelines) >= min(f + 1, N // ts.n0, B)
        assert a.makespan_s == pytest.approx(max(ts[n].iteration_time(b) for n, b in a.pipelines))
        contiguous = ts.n_max >= 2 * ts.n0 - 1
        if contiguous and N <= B * ts.n_max and N >= (f + 1) * ts.n0:
            assert a.nodes_used == N, "every node must be used"


@pytest.mark.parametrize("survivors", [8, 7, 6, 5, 4, 3, 2])
def test_seed_002_any_survivor_count_gets_a_plan(survivors: int) -> None:
    # Oobleck's published failure: templates for 2..8 nodes, 8 nodes lose 2 -> Oobleck raised KeyError: 1.
    profile = uniform_profile(16, gib_per_layer=1.0)
    ts = build_templates(profile, gpus_per_node=1, device_memory_gb=10.0, max_nodes=8)
    assert ts.sizes() == [2, 3, 4, 5, 6, 7, 8]
    nodes = [f"n{i}" for i in range(survivors)]
    plan = make_plan(ts, nodes=nodes, num_microbatches=64, microbatch_size=1, f=3)
    assert plan.spares == ()
    assert sum(len(p.nodes) for p in plan.pipelines) == survivors
    assert all(p.template_nodes in ts.templates for p in plan.pipelines)


def test_below_n0_is_a_clear_error() -> None:
    ts = build_templates(uniform_profile(16, gib_per_layer=1.0), gpus_per_node=1, device_memory_gb=10.0)
    with pytest.raises(PlanningError, match=r"1 node\(s\) cannot hold one replica: at least n0=2 are needed"):
        instantiate(ts, num_nodes=1, num_microbatches=8, f=1)


def test_fewer_than_f_plus_1_pipelines_warns() -> None:
    ts = build_templates(uniform_profile(16, gib_per_layer=1.0), gpus_per_node=1, device_memory_gb=10.0)
    a = instantiate(ts, num_nodes=3, num_microbatches=8, f=1)
    assert len(a.pipelines) == 1
    assert a.warnings == (
        "1 pipeline(s) instead of f+1=2 (fault_tolerance.f=1): only 3 nodes (n0=2); "
        "a failure may need a checkpoint restore",
    )


def test_spare_nodes_when_sizes_cannot_add_up() -> None:
    ts = build_templates(
        uniform_profile(16, gib_per_layer=1.0), gpus_per_node=1, device_memory_gb=10.0, node_counts=[4]
    )
    plan = make_plan(ts, nodes=[f"n{i}" for i in range(10)], num_microbatches=8, microbatch_size=1, f=1)
    assert [p.nodes for p in plan.pipelines] == [("n0", "n1", "n2", "n3"), ("n4", "n5", "n6", "n7")]
    assert plan.spares == ("n8", "n9")
    assert "2 node(s) left idle as spares" in plan.warnings[0]


# ---------------------------------------------------------------- plans as JSON


def test_plan_ranks_and_json_round_trip() -> None:
    ts = build_templates(uniform_profile(8), gpus_per_node=2, device_memory_gb=100)
    plan = make_plan(ts, nodes=["a", "b", "c", "d", "e"], num_microbatches=10, microbatch_size=4, f=1, generation=3)
    assert plan.world_size == 10 and plan.num_microbatches == 10
    ranks = {(s.node, s.local_rank): s.rank for p in plan.pipelines for s in p.stages}
    assert ranks == {(n, lr): i * 2 + lr for i, n in enumerate("abcde") for lr in range(2)}
    for layer in range(8):
        assert len(plan.holders(layer)) == len(plan.pipelines)
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan
    import dataclasses

    with_donors = dataclasses.replace(plan, donors=("x", "y"))
    assert Plan.from_json(json.loads(json.dumps(with_donors.to_json()))) == with_donors
    assert with_donors.entry_world_size == 14 and with_donors.donor_rank("y", 1) == 13
    legacy = plan.to_json()
    del legacy["donors"]  # plans written before donors existed
    assert Plan.from_json(legacy) == plan


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("pipelines"), "malformed plan: KeyError: 'pipelines'"),
        (lambda d: d.__setitem__("schema_version", 99), "plan schema_version 99 is not 1"),
        (
            lambda d: d["pipelines"][0]["stages"][0].__setitem__("layers", [1, 4]),
            "plan generation 0: pipeline 0 does not cover layers 0..8 contiguously",
        ),
        (lambda d: d["pipelines"][0]["stages"][0].__setitem__("rank", 7), "plan generation 0: ranks are not 0..9"),
        (lambda d: d["pipelines"][0].__setitem__("microbatches", "many"), "malformed plan: ValueError"),
        (lambda d: d.__setitem__("donors", "e"), "malformed plan: donors is str, not a list"),
        (lambda d: d.__setitem__("donors", ["e"]), "plan generation 0: donors ['e'] must be distinct nodes outside"),
        (lambda d: d.__setitem__("donors", ["x", "x"]), "plan generation 0: donors ['x', 'x'] must be distinct"),
    ],
)
def test_malformed_plan_json_is_rejected(mutate, message: str) -> None:
    ts = build_templates(uniform_profile(8), gpus_per_node=2, device_memory_gb=100)
    data = make_plan(ts, nodes=list("abcde"), num_microbatches=10, microbatch_size=4, f=1).to_json()
    mutate(data)
    with pytest.raises(
        PlanningError,
        match="^" + message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]"),
    ):
        Plan.from_json(data)


def _kept(plan: Plan, previous: Plan) -> int:
    """Layers the workers of `plan` already hold under `previous` (what a re-plan need not copy)."""
    held = {(s.node, s.local_rank): set(range(s.start, s.end)) for p in previous.pipelines for s in p.stages}
    return sum(
        len(held.get((s.node, s.local_rank), set()) & set(range(s.start, s.end)))
        for p in plan.pipelines
        for s in p.stages
    )


def _replan_cases(*extra: str):
    from oobleck_elastic.config import load_config

    cfg = load_config(
        "configs/gpt2-tiny.yaml",
        [
            "training.global_batch_size=16",
            "training.microbatch_size=2",
            "planning.device_memory_gb=1.25",
            "planning.memory_margin=0",
            *extra,
        ],
    )
    tset = templates_for(cfg, uniform_profile(6, gib_per_layer=0.4))  # n0 = 2, as in the recovery tests
    return cfg, tset


def test_replan_keeps_layers_where_they_are() -> None:
    """4 nodes (2 x 2 stages) lose node b; the survivors come in an unlucky preference order.
    Placed naively, d (last layers) would take the first stage; placed by what they hold, the
    three survivors keep the optimum (checked against every permutation)."""
    cfg, tset = _replan_cases()
    old = plan_job(cfg, nodes=["a", "b", "c", "d"], templates=tset, generation=1).plan
    assert [len(p.stages) for p in old.pipelines] == [2, 2]
    order = ["d", "c", "a"]
    naive = plan_job(cfg, nodes=order, templates=tset, generation=2).plan
    placed = plan_job(cfg, nodes=order, templates=tset, generation=2, previous=old).plan
    best = max(
        _kept(plan_job(cfg, nodes=list(p), templates=tset, generation=2).plan, old)
        for p in itertools.permutations(order)
    )
    assert _kept(placed, old) == best > _kept(naive, old)
    assert set(placed.nodes) == set(order) and placed.world_size == naive.world_size
    placed.check()


def test_replan_placement_never_loses_to_preference_order_and_keeps_spares() -> None:
    cfg, tset = _replan_cases("planning.replan_tolerance=0")  # placement alone: the fastest plan's pipelines
    rng = random.Random(5)
    for _ in range(40):
        n_old = rng.randint(2, 8)
        old_nodes = [f"n{i}" for i in range(n_old)]
        old = plan_job(cfg, nodes=old_nodes, templates=tset, generation=1).plan
        survivors = [n for n in old_nodes if rng.random() < 0.7] + [f"new{i}" for i in range(rng.randint(0, 2))]
        rng.shuffle(survivors)
        if len(survivors) < tset.n0:
            continue
        naive = plan_job(cfg, nodes=survivors, templates=tset, generation=2).plan
        placed = plan_job(cfg, nodes=survivors, templates=tset, generation=2, previous=old).plan
        assert _kept(placed, old) >= _kept(naive, old)
        assert placed.spares == naive.spares  # who runs follows the preference order
        assert [len(p.stages) for p in placed.pipelines] == [len(p.stages) for p in naive.pipelines]
