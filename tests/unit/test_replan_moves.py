"""Move-aware re-planning (planning/plan/build.py `make_plan`, plan/instantiate.py
`instantiate_near`): a re-plan keeps the pipelines a change did not touch when that costs at most
`planning.replan_tolerance` of the step, and then moves the layers of a few nodes instead of the
cluster's. Made-up and analytic profiles; no torch work."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest
from test_planning import random_profile
from test_planning_scale import _gpt3_templates

from oobleck_elastic.config import load_config
from oobleck_elastic.config.schema import ConfigError
from oobleck_elastic.planning import PlanningError, build_templates, make_plan
from oobleck_elastic.planning.job import load_profiles, plan_job
from oobleck_elastic.planning.plan.instantiate import split_microbatches
from oobleck_elastic.planning.plan.placement import bytes_received, shard_bytes_of
from oobleck_elastic.planning.preview import format_preview, preview_loss, read_plan
from oobleck_elastic.planning.profile.analytic import gpt3_175b_profile

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("seed", range(20))
def test_the_microbatch_split_of_fixed_pipelines_is_the_least_makespan(seed: int) -> None:
    rng = random.Random(seed)
    try:
        ts = build_templates(random_profile(rng, rng.randint(3, 12)), gpus_per_node=1, device_memory_gb=8.0)
    except PlanningError:
        return
    sizes = [rng.choice(ts.sizes()) for _ in range(rng.randint(1, 3))]
    B, cap = rng.randint(len(sizes), 9), rng.randint(1, 9)
    got = split_microbatches(ts, sizes, B, cap)
    k = len(sizes)
    splits = [c for c in itertools.product(range(1, cap + 1), repeat=k) if sum(c) == B]
    if not splits:
        assert got is None
        return
    assert got is not None and sum(got) == B and all(1 <= b <= cap for b in got)

    def makespan(counts) -> float:
        return max(ts[n].iteration_time(b, k) for n, b in zip(sizes, counts))

    assert makespan(got) == pytest.approx(min(makespan(c) for c in splits), rel=1e-12)


def _loss_at_1024(tolerance: float):
    profile = gpt3_175b_profile(tensor_parallel=8).in_mode("full")
    templates = dataclasses.replace(_gpt3_templates(8), profile=profile)  # bytes as a job's templates count them
    shards = shard_bytes_of(templates.profile.layers)
    nodes = [f"node{i}" for i in range(1024)]
    previous = make_plan(templates, nodes=nodes, num_microbatches=1536, microbatch_size=1, f=1)
    survivors = nodes[:341] + nodes[342:]
    plan = make_plan(
        templates,
        nodes=survivors,
        num_microbatches=1536,
        microbatch_size=1,
        f=1,
        generation=1,
        previous=previous,
        replan_tolerance=tolerance,
    )
    return previous, plan, bytes_received(previous, plan, shards)


def test_one_node_lost_of_1024_at_tp8_moves_a_few_nodes_layers_for_under_1_percent_of_the_step() -> None:
    previous, fastest, moved_fastest = _loss_at_1024(0.0)
    _, kept, moved = _loss_at_1024(0.01)
    # the fastest plan re-forms the cluster; the kept one refills the touched pipeline from one other
    assert sum(moved_fastest.values()) > 50e12
    assert sum(moved.values()) < 1e12
    model = 8 * sum(shard_bytes_of(gpt3_175b_profile(tensor_parallel=8).layers))  # 8 lanes of one lane's shards
    stage = min(model // p.template_nodes for p in kept.pipelines)  # a node's stage in the longest pipeline
    assert max(moved.values()) <= stage
    assert kept.est_step_time_s <= fastest.est_step_time_s * 1.01
    # one pipeline is formed of the touched one's survivors and another's nodes: only its nodes
    # hold other layers than before, and each of the others keeps its stage
    before, after = previous.layers_by_worker(), kept.layers_by_worker()
    changed = {n for (n, lr), layers in after.items() if before.get((n, lr)) != layers}
    assert set(moved) <= changed and len(changed) <= 11, sorted(changed)


@pytest.mark.parametrize("seed", range(40))
def test_a_kept_plan_is_within_the_tolerance_and_moves_no_more_to_its_busiest_node(seed: int) -> None:
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(3, 30))
    try:
        ts = build_templates(profile, gpus_per_node=rng.choice([1, 2]), device_memory_gb=4.0)
    except PlanningError:
        return
    ts = dataclasses.replace(ts, profile=profile)  # as a job's templates: the re-plan prices bytes
    B, f = rng.randint(1, 200), rng.randint(0, 2)
    nodes = [f"n{i}" for i in range(rng.randint(ts.n0, 60))]
    previous = make_plan(ts, nodes=nodes, num_microbatches=B, microbatch_size=1, f=f)
    shards = shard_bytes_of(profile.layers)
    for _ in range(3):
        survivors = [x for x in nodes if rng.random() < 0.95] + [f"new{i}" for i in range(rng.randint(0, 2))]
        if len(survivors) < ts.n0:
            continue
        args = dict(nodes=survivors, num_microbatches=B, microbatch_size=1, f=f, generation=1, previous=previous)
        fastest = make_plan(ts, **args)
        tolerance = rng.choice([0.01, 0.05, 0.2])
        chosen = make_plan(ts, **args, replan_tolerance=tolerance)
        assert chosen.est_step_time_s <= fastest.est_step_time_s * (1 + tolerance) + 1e-12
        busiest = [max(bytes_received(previous, q, shards).values(), default=0) for q in (fastest, chosen)]
        assert busiest[1] <= busiest[0]
        assert len(chosen.pipelines) >= min(f + 1, len(survivors) // ts.n0, B)


def test_a_negative_tolerance_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"'planning.replan_tolerance' must be >= 0 \(got -0.5\)"):
        load_config(ROOT / "configs/gpt2-tiny.yaml", ["planning.replan_tolerance=-0.5"])


def _gpt3_cfg(*extra: str):
    prof = ROOT / "configs/profiles/gpt3-175b-tp{tp}.json"
    return load_config(ROOT / "configs/gpt3-175b.yaml", [f"planning.profile_path={prof}", *extra])


def test_a_loss_previewed_names_the_receivers_and_the_fastest_plan_beside_it(tmp_path: Path) -> None:
    cfg = _gpt3_cfg("planning.tensor_parallel=8")
    profiles = load_profiles(cfg)
    previous = plan_job(cfg, nodes=1024, profile=profiles).plan
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"plan": previous.to_json() | {"samples_per_s": 1.0}}))  # as `oobleck plan --json`
    pv = preview_loss(cfg, profiles, read_plan(path), ["node341"])
    assert set(pv.plan.nodes) == set(previous.nodes) - {"node341"}
    assert sum(pv.received.values()) < 1e12 < sum(pv.fastest_received.values())
    assert len(pv.formed) == 1  # one pipeline has a node that receives layers
    text = format_preview(pv, tolerance=0.01)
    assert text.splitlines()[1] == (
        f"  pipelines with a node that receives layers: 1 of {len(pv.plan.pipelines)}; "
        "every other node keeps its layers"
    )
    busiest = max(pv.received, key=lambda n: pv.received[n])
    assert f"  {busiest} receives {pv.received[busiest] / 1e9:.1f} GB" in text
    assert "the fastest plan instead: " in text and "within planning.replan_tolerance=0.01" in text


def test_a_preview_of_nodes_the_plan_does_not_have_is_one_line() -> None:
    cfg = _gpt3_cfg()
    profiles = load_profiles(cfg)
    previous = plan_job(cfg, nodes=12, profile=profiles).plan
    with pytest.raises(PlanningError) as err:
        preview_loss(cfg, profiles, previous, ["node1", "node99"])
    assert str(err.value) == (
        "--lose node1,node99: node99 not in the previous plan "
        "(its nodes: node0, node1, node2, node3, node4, node5, node6, node7, ...)"
    )
