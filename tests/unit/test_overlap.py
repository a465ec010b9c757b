"""The part of the gradient all-reduce a pipeline leaves exposed (planning/templates/overlap.py), in the
closed form of templates.py and in the simulation of planning/schedules/cost.py, and what it does to the
GPT-3 plan."""

from __future__ import annotations

import random

import pytest

from oobleck_elastic.config import load_config
from oobleck_elastic.planning import LayerProfile, Links, ModelProfile, load_profiles, plan_job
from oobleck_elastic.planning.templates.overlap import exposed_sync_s, layer_ready_times
from oobleck_elastic.planning.templates.partition import StageCosts
from oobleck_elastic.planning.schedules.cost import schedule_cost
from oobleck_elastic.planning.templates.templates import make_template

LINKS = Links(intra_node_gb_s=150.0, inter_node_gb_s=12.5, latency_s=1e-5)


def test_a_full_backward_finishes_its_layers_last_to_first_and_a_split_one_all_at_its_end() -> None:
    # layers of backward 1, 2, 1 s over a last backward from 10 to 14 s
    assert layer_ready_times(10.0, 14.0, [1.0, 2.0, 1.0], [7, 8, 9], split=False) == [(14.0, 7), (13.0, 8), (11.0, 9)]
    assert layer_ready_times(10.0, 14.0, [1.0, 2.0, 1.0], [7, 8, 9], split=True) == [(14.0, 7), (14.0, 8), (14.0, 9)]


def test_reductions_run_one_after_another_per_device_and_only_what_passes_the_end_counts() -> None:
    links = Links(intra_node_gb_s=1.0, inter_node_gb_s=1.0, latency_s=0.0)
    per = links.all_reduce_s(1e9, 2, same_node=False)  # 1 s for 1 GB between two replicas
    assert per == pytest.approx(1.0)
    # device 0: ready at 8 and 10 (the end): 8-9, then 10-11; device 1: ready at 5, 5, 5: 5-8
    devices = [[(8.0, int(1e9)), (10.0, int(1e9))], [(5.0, int(1e9))] * 3]
    assert exposed_sync_s(devices, 10.0, links, 2) == pytest.approx(1.0)
    # device 1 four layers ready at 8: 8-12 passes the end by 2
    assert exposed_sync_s([[(8.0, int(1e9))] * 4], 10.0, links, 2) == pytest.approx(2.0)
    assert exposed_sync_s([[(3.0, int(1e9))]], 10.0, links, 2) == 0.0  # hidden entirely
    assert exposed_sync_s(devices, 10.0, links, 1) == 0.0  # one replica: nothing to reduce


def profile(rng: random.Random, layers: int, *, uniform: bool) -> ModelProfile:
    out = []
    for i in range(layers):
        f = 1.0 if uniform else rng.uniform(0.5, 1.5)
        out.append(
            LayerProfile(
                name=f"l{i}",
                forward_s=f * 1e-2,
                backward_s=2 * f * 1e-2,
                param_bytes=25_000_000,
                grad_bytes=25_000_000 if uniform else rng.randrange(5_000_000, 50_000_000),
                optimizer_bytes=50_000_000,
                activation_bytes=1000,
                output_bytes=4_000_000,
            )
        )
    return ModelProfile(layers=out)


@pytest.mark.parametrize("seed", range(10))
def test_the_closed_form_equals_the_simulated_1f1b_on_equal_stages(seed: int) -> None:
    rng = random.Random(seed)
    stages = rng.choice([2, 3, 4])
    per = rng.choice([1, 2, 3])
    prof = profile(rng, stages * per, uniform=True)
    ranges = [(i * per, (i + 1) * per) for i in range(stages)]
    per_node = rng.choice([1, stages])
    costs = StageCosts(prof, memory_limit_bytes=1e30, links=LINKS, stages_per_node=per_node)
    t = make_template(costs, ranges, num_nodes=stages // per_node, gpus_per_node=per_node)
    for replicas in (2, 8, 64):
        for m in (stages, 2 * stages + 1):
            sim = schedule_cost(prof, ranges, "1f1b", m, links=LINKS, stages_per_node=per_node, replicas=replicas)
            assert t.grad_sync_s(replicas) == pytest.approx(sim.grad_sync_s, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_the_exposed_part_is_at_most_the_whole_all_reduce_of_the_busiest_device(seed: int) -> None:
    rng = random.Random(seed)
    prof = profile(rng, 12, uniform=False)
    ranges = [(0, 3), (3, 7), (7, 9), (9, 12)]
    for name, chunks, rr in (
        ("1f1b", 1, ranges),
        ("zero-bubble", 1, ranges),
        ("zbv", 2, [(i, i + 1) for i in range(8)]),
    ):
        rr = rr if name != "zbv" else [(0, 2), (2, 3), (3, 5), (5, 6), (6, 8), (8, 9), (9, 11), (11, 12)]
        cost = schedule_cost(prof, rr, name, 8, chunks=chunks, links=LINKS, replicas=16)
        whole = max(
            sum(
                LINKS.all_reduce_s(la.grad_bytes, 16, same_node=False)
                for s, (u, v) in enumerate(rr)
                if cost.placement[s] == d
                for la in prof.layers[u:v]
            )
            for d in range(max(cost.placement) + 1)
        )
        assert 0.0 < cost.grad_sync_s <= whole + 1e-12


def test_gpt3_on_1024_nodes_overlap_and_schedules_meet_the_bubble_goal() -> None:
    base = ["planning.tensor_parallel=8"]
    profiles = load_profiles(load_config("configs/gpt3-175b.yaml", base))
    one = plan_job(load_config("configs/gpt3-175b.yaml", base), nodes=1024, profile=profiles)
    auto = plan_job(
        load_config("configs/gpt3-175b.yaml", base + ["planning.schedule=auto"]), nodes=1024, profile=profiles
    )
    assert 1 - auto.efficiency <= 0.24
    assert auto.plan.samples_per_s >= 1.4 * 191.2  # the 1F1B plan before the overlap
    assert auto.plan.samples_per_s > 1.4 * one.plan.samples_per_s
