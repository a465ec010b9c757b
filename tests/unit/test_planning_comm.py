"""Planner: communication in the cost model, tensor-parallel stages and `tensor_parallel=auto`."""

from __future__ import annotations

import dataclasses

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from oobleck_elastic.config import ConfigError, load_config
from oobleck_elastic.planning import (
    LayerProfile,
    Links,
    ModelProfile,
    Plan,
    PlanningError,
    ProfileError,
    build_templates,
    choose_tensor_parallel,
    compare_tensor_parallel,
    load_profiles,
    plan_job,
    templates_for,
)
from oobleck_elastic.planning.profile.analytic import transformer_profile
from oobleck_elastic.planning.templates.templates import GIB, best_template, brute_force_template
from oobleck_elastic.planning.templates.partition import StageCosts

ROOT = Path(__file__).resolve().parents[2]
LINKS = Links(intra_node_gb_s=100.0, inter_node_gb_s=10.0, latency_s=1e-5)


def profile_with_outputs(rng: random.Random, num_layers: int) -> ModelProfile:
    layers = []
    for i in range(num_layers):
        fwd = rng.uniform(0.1, 2.0)
        params = int(rng.uniform(0.05, 0.3) * GIB)
        layers.append(
            LayerProfile(
                name=f"l{i}",
                forward_s=fwd,
                backward_s=2 * fwd,
                param_bytes=params,
                grad_bytes=params,
                optimizer_bytes=2 * params,
                activation_bytes=int(rng.uniform(0.0, 0.2) * GIB),
                output_bytes=int(rng.choice([0.01, 1.0, 20.0]) * 1e9),
            )
        )
    return ModelProfile(layers=layers)


@pytest.mark.parametrize("seed", range(40))
def test_templates_with_communication_equal_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    L = rng.randint(2, 8)
    g, tp = rng.choice([(1, 1), (2, 1), (2, 2), (4, 2)])
    per_node = g // tp
    profile = profile_with_outputs(rng, L)
    costs = StageCosts(profile, memory_limit_bytes=rng.uniform(0.8, 3.0) * GIB, links=LINKS, stages_per_node=per_node)
    for n in range(1, L // per_node + 1):
        got = best_template(costs, n, g, tp)
        want = brute_force_template(costs, n, g, 8, tp)
        if want is None:
            assert got is None
            continue
        assert got is not None and got.num_stages == n * per_node
        assert got.iteration_time(8) == pytest.approx(want[0], rel=1e-9)
        assert [s.local_rank for s in got.stages[:per_node]] == [k * tp for k in range(per_node)]


def four_layers(big_output_after: int) -> ModelProfile:
    """Four equal layers; the activation leaving layer `big_output_after` is 40 GB."""
    return ModelProfile(
        layers=[
            LayerProfile(
                name=f"l{i}",
                forward_s=1.0,
                backward_s=2.0,
                param_bytes=1000,
                grad_bytes=1000,
                optimizer_bytes=2000,
                activation_bytes=0,
                output_bytes=40_000_000_000 if i == big_output_after else 1000,
            )
            for i in range(4)
        ]
    )


def test_counting_communication_changes_the_template() -> None:
    profile = four_layers(big_output_after=1)  # the balanced cut [0,2) [2,4) would ship 40 GB across nodes
    blind = build_templates(profile, gpus_per_node=1, device_memory_gb=1.0)[2]
    aware = build_templates(profile, gpus_per_node=1, device_memory_gb=1.0, links=LINKS)[2]
    assert blind.layer_ranges() == [(0, 2), (2, 4)]
    assert aware.layer_ranges() in ([(0, 1), (1, 4)], [(0, 3), (3, 4)])
    # costed with the links, the communication-aware template is the faster one
    costs = StageCosts(profile, memory_limit_bytes=GIB, links=LINKS)
    blind_costed = sum(costs.stage_time(u, v, i, 2) for i, (u, v) in enumerate(blind.layer_ranges()))
    assert aware.total_time_s < blind_costed
    # each stage receives: 40 GB / 10 GB/s + 10 us, twice (activation, gradient) across the cut
    cut = costs.boundary_s(2, 0)
    assert cut == pytest.approx(1e-5 + 40e9 / 10e9)


def test_a_cut_inside_a_node_costs_the_intra_node_link() -> None:
    profile = four_layers(big_output_after=1)
    costs = StageCosts(profile, memory_limit_bytes=GIB, links=LINKS, stages_per_node=2)
    assert costs.same_node(0) and not costs.same_node(1) and costs.same_node(2)
    assert costs.boundary_s(2, 0) == pytest.approx(1e-5 + 40e9 / 100e9)
    assert costs.boundary_s(2, 1) == pytest.approx(1e-5 + 40e9 / 10e9)
    t = build_templates(profile, gpus_per_node=2, device_memory_gb=1.0, links=LINKS)[1]
    # stage 0 receives the gradient of its output, stage 1 its input: both over NVLink
    assert [s.comm_s for s in t.stages] == pytest.approx([costs.boundary_s(t.stages[0].end, 0)] * 2)


def test_the_step_time_adds_the_part_of_the_all_reduce_the_pipeline_does_not_hide() -> None:
    def ring(nbytes: int, k: int) -> float:
        return 0.0 if k == 1 else 2 * (k - 1) * 1e-5 + 2 * (k - 1) / k * nbytes / 10e9

    profile = four_layers(big_output_after=-1)
    ts = build_templates(profile, gpus_per_node=1, device_memory_gb=1.0, links=LINKS)
    t = ts[2]
    assert [s.grad_bytes for s in t.stages] == [2000, 2000]
    for k in (1, 2, 5):
        # stage 0's last backward finishes layer 1 two seconds before layer 0: layer 1's reduction
        # hides behind layer 0's backward, only layer 0's is left after the schedule
        assert t.grad_sync_s(k) == pytest.approx(ring(1000, k))
        assert t.iteration_time(3, k) == pytest.approx(t.total_time_s + 2 * t.bottleneck_s + ring(1000, k))
    # with an instant backward nothing hides: stage 0's two layers are reduced one after the other
    instant = ModelProfile(layers=[dataclasses.replace(la, backward_s=0.0) for la in profile.layers])
    t0 = build_templates(instant, gpus_per_node=1, device_memory_gb=1.0, links=LINKS)[2]
    for k in (2, 5):
        assert t0.grad_sync_s(k) == pytest.approx(2 * ring(1000, k))
    cfg = load_config(overrides=["training.global_batch_size=8", "training.microbatch_size=1"])
    jp = plan_job(cfg, nodes=4, templates=ts)
    k = len(jp.plan.pipelines)
    assert jp.plan.est_step_time_s == pytest.approx(
        max(ts[p.template_nodes].iteration_time(p.microbatches, k) for p in jp.plan.pipelines)
    )


def gpt_profiles(degrees=(1, 2, 4), **kw) -> dict[int, ModelProfile]:
    base = dict(num_layers=8, hidden=1024, vocab=32000, seq_len=1024, microbatch_size=1, device_tflops=100.0)
    return {d: transformer_profile(**(base | kw), tensor_parallel=d) for d in degrees}


def test_analytic_tensor_parallel_profiles_shard_blocks_and_add_their_collectives() -> None:
    p = gpt_profiles()
    b1, b2 = p[1].layers[1], p[2].layers[1]
    assert b2.param_bytes == b1.param_bytes // 2
    hidden_out = 1024 * 1024 * 2
    collectives = 2 * Links().all_reduce_s(hidden_out, 2, same_node=True)
    assert b2.forward_s == pytest.approx(b1.forward_s / 2 + collectives)
    assert p[2].layers[0] == p[1].layers[0] and p[2].layers[-1] == p[1].layers[-1]  # replicated
    assert p[2].tensor_parallel == 2 and ModelProfile.from_json(p[2].to_json()).tensor_parallel == 2


def auto_config(**overrides: object):
    base = {
        "model.num_layers": 8,
        "training.global_batch_size": 64,
        "training.microbatch_size": 1,
        "planning.gpus_per_node": 4,
        "planning.tensor_parallel": "auto",
        "planning.device_memory_gb": 80.0,
        "training.activation_checkpoint": "full",  # what the analytic profiles are made for
        "planning.profile_path": "profile-tp{tp}.json",
    }
    return load_config(overrides=[f"{k}={v}" for k, v in (base | overrides).items()])


def test_auto_picks_the_degree_with_the_best_estimated_throughput() -> None:
    cfg = auto_config()
    profiles = gpt_profiles()
    plans = compare_tensor_parallel(cfg, profiles, 8)
    rates = {d: jp.plan.samples_per_s for d, jp in plans.items()}
    chosen = choose_tensor_parallel(cfg, profiles, 8)
    assert rates[chosen] == max(rates.values())
    jp = plan_job(cfg, nodes=8, profile=profiles)
    assert jp.plan.tensor_parallel == jp.templates.tensor_parallel == chosen
    assert jp.plan.samples_per_s == pytest.approx(rates[chosen])


def test_auto_takes_a_larger_degree_when_a_stage_does_not_fit_one_device() -> None:
    cfg = auto_config(**{"planning.device_memory_gb": 2.5, "planning.gpus_per_node": 2})
    profiles = gpt_profiles(degrees=(1, 2), num_layers=2, hidden=4096, vocab=1000)  # a block: 3.2 GB, 1.6 at tp=2
    assert isinstance(compare_tensor_parallel(cfg, profiles, 4)[1], PlanningError)
    assert choose_tensor_parallel(cfg, profiles, 4) == 2


def test_a_fixed_degree_needs_a_profile_of_that_degree() -> None:
    cfg = auto_config(**{"planning.tensor_parallel": 2})
    with pytest.raises(
        PlanningError,
        match=r"planning.tensor_parallel=2 but the profile was measured at "
        r"tensor_parallel=1: use a profile measured at that degree",
    ):
        templates_for(cfg, gpt_profiles(degrees=(1,))[1])
    assert templates_for(cfg, gpt_profiles()).tensor_parallel == 2


def test_a_tensor_parallel_plan_gives_every_lane_a_rank_and_round_trips() -> None:
    cfg = auto_config(**{"planning.tensor_parallel": 2})
    plan = plan_job(cfg, nodes=3, profile=gpt_profiles()).plan
    assert plan.tensor_parallel == 2 and plan.world_size == 3 * 4
    assert sorted(plan.entry_ranks().values()) == list(range(12))
    for p in plan.pipelines:
        for s in p.stages:
            assert s.local_rank % 2 == 0
            assert plan.stage_at(s.node, s.local_rank + 1) == s and plan.lane_of(s, s.local_rank + 1) == 1
            assert plan.stage_of(s.rank + 1) == (p, s)
    layer = 3
    assert [r % 2 for r in plan.holders(layer, lane=1)] == [1] * len(plan.pipelines)
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan
    bad = plan.to_json() | {"tensor_parallel": 3}
    with pytest.raises(PlanningError, match="tensor_parallel 3 does not divide gpus_per_node 4"):
        Plan.from_json(bad)


def test_config_rejects_a_degree_that_does_not_divide_the_node() -> None:
    with pytest.raises(
        ConfigError,
        match=r"'planning.tensor_parallel' is 3: give a divisor of "
        r"planning.gpus_per_node \(4\) or auto",
    ):
        load_config(overrides=["planning.gpus_per_node=4", "planning.tensor_parallel=3"])
    with pytest.raises(
        ConfigError,
        match=r"'planning.tensor_parallel' is 2 but 'planning.profile_path' is not set: "
        r"workers measure profiles on one device; measure one at each degree with "
        r"`torchrun --nproc-per-node T -m oobleck_elastic.planning.profile.tp",
    ):
        load_config(overrides=["planning.gpus_per_node=2", "planning.tensor_parallel=2"])
    with pytest.raises(ConfigError, match="'planning.inter_node_bandwidth_gb_s' must be > 0"):
        load_config(overrides=["planning.inter_node_bandwidth_gb_s=0"])


def test_profiles_per_degree_load_from_a_pattern(tmp_path: Path) -> None:
    for d, p in gpt_profiles(degrees=(1, 4)).items():
        p.save(tmp_path / f"p-tp{d}.json")
    cfg = auto_config()
    assert sorted(load_profiles(cfg, str(tmp_path / "p-tp{tp}.json"))) == [1, 4]
    with pytest.raises(ProfileError, match=r"was measured at tensor_parallel=4 but planning.tensor_parallel=2"):
        load_profiles(auto_config(**{"planning.tensor_parallel": 2}), str(tmp_path / "p-tp4.json"))
    (tmp_path / "p-tp2.json").write_text((tmp_path / "p-tp4.json").read_text())
    with pytest.raises(ProfileError, match="records tensor_parallel=4, not 2"):
        load_profiles(cfg, str(tmp_path / "p-tp{tp}.json"))


def test_cli_plan_with_auto_compares_the_degrees() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "oobleck_elastic.cli",
            "plan",
            "--config",
            str(ROOT / "configs/gpt3-175b.yaml"),
            "--nodes",
            "256",
            "planning.tensor_parallel=auto",
            f"planning.profile_path={ROOT / 'configs/profiles/gpt3-175b-tp{tp}.json'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "tensor_parallel=auto: the degree with the best estimated samples/s is chosen" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "%" in line]
    assert [int(r[0]) for r in rows[:4]] == [1, 2, 4, 8]
    best = max(rows[:4], key=lambda r: float(r[4]))
    assert best[-1] == "chosen" and f"tensor parallel {best[0]} (devices per stage" in out
    assert "est. pipeline efficiency" in out
