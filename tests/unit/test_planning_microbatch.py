"""`training.microbatch_size: auto`: the planner's choice of the microbatch size, on made-up
profiles (pure planning), through `oobleck plan`, the leader's planner and a one-worker job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from oobleck_elastic.config import ConfigError, load_config
from oobleck_elastic.planning import (
    LayerProfile,
    MicrobatchError,
    MicrobatchOption,
    ModelProfile,
    PlanningError,
    ProfileError,
    build_templates,
    choose_microbatch_size,
    microbatch_candidates,
    plan_job,
    profile_at,
    profile_microbatch_sizes,
)
from oobleck_elastic.planning.profile.microbatch import pick_microbatch_size

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024**3
CFG = ROOT / "configs/gpt2-tiny.yaml"


def linear_profile(
    *, layers: int, a: float, c: float, act_per_sample: int, static: int, sizes: tuple[int, ...] = (1, 4)
) -> ModelProfile:
    """Every layer takes a + c*b seconds (1/3 forward) and keeps act_per_sample*b bytes, measured
    at `sizes` (the first as `layers`)."""

    def at(b: int) -> list[LayerProfile]:
        t = a + c * b
        return [
            LayerProfile(
                name=f"l{i}",
                forward_s=t / 3,
                backward_s=2 * t / 3,
                param_bytes=static // 4,
                grad_bytes=static // 4,
                optimizer_bytes=static // 2,
                activation_bytes=act_per_sample * b,
                output_bytes=1000 * b,
            )
            for i in range(layers)
        ]

    return ModelProfile(
        layers=at(sizes[0]), microbatch_size=sizes[0], at_microbatch_sizes={b: at(b) for b in sizes[1:]}
    )


def cfg_of(*overrides: str):
    return load_config(
        CFG,
        ["training.microbatch_size=auto", "planning.memory_margin=0", "planning.count_communication=false", *overrides],
    )


# ------------------------------------------------------------------ config and candidates
def test_config_accepts_auto_and_numbers_only() -> None:
    assert load_config(CFG, ["training.microbatch_size=auto"]).training.microbatch_size == "auto"
    # the global-batch multiple is checked for numbers only
    assert load_config(CFG, ["training.microbatch_size=auto", "training.global_batch_size=10"])
    assert load_config(CFG, ["training.microbatch_size=4"]).training.microbatch_size == 4
    for bad in ("big", "0"):
        with pytest.raises(ConfigError) as err:
            load_config(CFG, [f"training.microbatch_size={bad}"])
        assert "'training.microbatch_size'" in str(err.value) and "auto" in str(err.value)
        assert "\n" not in str(err.value)


def test_candidates_are_divisors_leaving_f_plus_1_pipelines_a_microbatch() -> None:
    assert microbatch_candidates(cfg_of("training.global_batch_size=64")) == [1, 2, 4, 8, 16, 32]
    assert microbatch_candidates(cfg_of("training.global_batch_size=12", "fault_tolerance.f=0")) == [1, 2, 3, 4, 6, 12]
    assert microbatch_candidates(cfg_of("training.global_batch_size=2", "fault_tolerance.f=3")) == [1]
    # the profiler measures 1 and the largest candidate <= 4 (one size when that is all there is)
    assert profile_microbatch_sizes(cfg_of("training.global_batch_size=16")) == [1, 4]
    assert profile_microbatch_sizes(cfg_of("training.global_batch_size=6")) == [1, 3]
    assert profile_microbatch_sizes(cfg_of("training.global_batch_size=2")) == [1]
    assert profile_microbatch_sizes(load_config(CFG, [])) == [2]


# ------------------------------------------------------------------ time and memory at any size
def test_profile_at_fits_lines_through_the_measured_sizes() -> None:
    prof = linear_profile(layers=3, a=0.01, c=0.002, act_per_sample=1000, static=4000)
    at8 = profile_at(prof, 8)
    assert at8.layers[0].time_s == pytest.approx(0.01 + 0.002 * 8)
    assert at8.layers[0].activation_bytes == 8000 and at8.layers[0].output_bytes == 8000
    assert at8.layers[0].static_bytes == prof.layers[0].static_bytes
    assert at8.microbatch_size == 8 and at8.key["fitted_from_microbatch_sizes"] == [1, 4]
    assert profile_at(prof, 4).layers == prof.at_microbatch_sizes[4]  # a measured size as measured
    # one measured size: proportional (no fixed cost known); a falling line is clamped at 0
    one = linear_profile(layers=1, a=0.01, c=0.002, act_per_sample=1000, static=4000, sizes=(2,))
    assert profile_at(one, 6).layers[0].time_s == pytest.approx(3 * (0.01 + 0.004))
    falling = ModelProfile(
        layers=[LayerProfile("x", 1.0, 0.0, 0, 0, 0, 10)],
        microbatch_size=1,
        at_microbatch_sizes={2: [LayerProfile("x", 0.5, 0.0, 0, 0, 0, 20)]},
    )
    assert profile_at(falling, 8).layers[0].forward_s == 0.0
    # the size a profile was measured at: its field, else the key's number, else unknown
    keyed = ModelProfile(layers=[LayerProfile("x", 1.0, 1.0, 0, 0, 0, 10)], key={"microbatch_size": 2})
    assert profile_at(keyed, 4).layers[0].activation_bytes == 20
    with pytest.raises(PlanningError, match="training.microbatch_size"):
        profile_at(ModelProfile(layers=[LayerProfile("x", 1.0, 1.0, 0, 0, 0, 10)]), 2)


def test_profile_at_fits_the_measured_backward_split_too() -> None:
    def layer(b: int, split: bool) -> LayerProfile:
        i, w = (0.001 + 0.002 * b, 0.003 * b) if split else (None, None)
        return LayerProfile("x", 0.01 * b, 0.005 * b, 0, 0, 0, 10 * b, input_grad_s=i, weight_grad_s=w)

    both = ModelProfile(layers=[layer(1, True)], microbatch_size=1, at_microbatch_sizes={4: [layer(4, True)]})
    at8 = profile_at(both, 8).layers[0]
    assert at8.input_grad_s == pytest.approx(0.001 + 0.002 * 8) and at8.weight_grad_s == pytest.approx(0.024)
    # a size measured without the split: none fitted (the planner splits by its share)
    half = ModelProfile(layers=[layer(1, True)], microbatch_size=1, at_microbatch_sizes={4: [layer(4, False)]})
    assert not profile_at(half, 8).layers[0].split_measured


def test_multi_size_profile_json_round_trip_and_validation() -> None:
    prof = linear_profile(layers=2, a=0.01, c=0.002, act_per_sample=1000, static=4000)
    data = json.loads(json.dumps(prof.to_json()))
    assert data["microbatch_size"] == 1 and set(data["at_microbatch_sizes"]) == {"4"}
    assert ModelProfile.from_json(data) == prof
    data["at_microbatch_sizes"]["4"] = data["at_microbatch_sizes"]["4"][:1]
    with pytest.raises(ProfileError, match="at_microbatch_sizes"):
        ModelProfile.from_json(data)
    with pytest.raises(ProfileError, match="microbatch_size"):
        ModelProfile.from_json({**prof.to_json(), "microbatch_size": 0})


# ------------------------------------------------------------------ the choice
def test_memory_bound_the_largest_fitting_size_wins_when_time_has_a_fixed_cost() -> None:
    # one stage per pipeline (2 nodes, f=1): T = microbatches x (a + c b) falls with b, so the
    # largest size whose activations fit wins; 4 layers x 0.1 GiB per sample fit up to b = 4 in 2 GiB
    prof = linear_profile(layers=4, a=0.01, c=0.001, act_per_sample=GIB // 10, static=GIB // 100)
    cfg = cfg_of("training.global_batch_size=64", "planning.device_memory_gb=2")
    choice = choose_microbatch_size(cfg, prof, 2)
    fits = {o.size: o.fits for o in choice.options}
    assert fits == {1: True, 2: True, 4: True, 8: False, 16: False, 32: False}
    assert choice.size == 4 and all(o.memory_bound for o in choice.options if not o.fits)
    steps = [o.step_s for o in choice.options if o.fits]
    assert steps == sorted(steps, reverse=True)
    jp = plan_job(cfg, nodes=2, profile=prof)
    assert jp.plan.microbatch_size == 4 and jp.microbatch == choice
    assert jp.plan.num_microbatches == 16 and jp.templates.microbatch_size == 4


def bubble_profile() -> ModelProfile:
    """8 layers, each filling most of a 1 GiB device: every template has 8 one-layer stages."""
    return linear_profile(layers=8, a=0.01, c=0.001, act_per_sample=1000, static=int(0.6 * GIB))


def test_bubble_bound_a_smaller_size_wins_and_depends_on_the_pipelines() -> None:
    # 8 stages: T(b) = 7 (a + c b) + (256 / (P b)) (a + c b): the bubble grows with b; the best b
    # is ~sqrt(256 a / (7 P c)): 16 for P = 2 pipelines (16 nodes), 8 for P = 8 (64 nodes)
    cfg = cfg_of("training.global_batch_size=256", "planning.device_memory_gb=1")
    few, many = choose_microbatch_size(cfg, bubble_profile(), 16), choose_microbatch_size(cfg, bubble_profile(), 64)
    assert all(o.fits for o in few.options) and max(o.size for o in few.options) == 128
    assert (few.size, many.size) == (16, 8)

    def est(b: int, pipes: int) -> float:
        t = 0.01 + 0.001 * b
        return 8 * t + (256 // (pipes * b) - 1) * t

    for o in many.options:  # up to 32, every one of the 8 pipelines gets a microbatch
        if o.size <= 32:
            assert o.step_s == pytest.approx(est(o.size, 8)) and o.pipelines == 8


def test_chosen_once_per_job_max_nodes_and_replans_keep_it() -> None:
    prof = bubble_profile()
    cfg = cfg_of("training.global_batch_size=256", "planning.device_memory_gb=1")
    first = plan_job(cfg, nodes=16, profile=prof)
    assert first.plan.microbatch_size == 16
    # a re-plan on 64 nodes (where 8 would be chosen afresh) keeps the job's size
    again = plan_job(cfg, nodes=64, profile=prof, previous=first.plan, generation=1)
    assert again.plan.microbatch_size == 16 and again.microbatch is None
    # planning.max_nodes: chosen for that many nodes, whatever the first plan's count
    capped = cfg_of("training.global_batch_size=256", "planning.device_memory_gb=1", "planning.max_nodes=64")
    assert plan_job(capped, nodes=16, profile=prof).plan.microbatch_size == 8
    # deterministic: the same inputs give the same choice
    assert choose_microbatch_size(cfg, prof, 16) == choose_microbatch_size(cfg, prof, 16)


def test_ties_go_to_the_larger_size() -> None:
    # time proportional to b on one-stage pipelines: every size takes the same step time
    prof = linear_profile(layers=4, a=0.0, c=0.001, act_per_sample=1000, static=GIB // 100)
    choice = choose_microbatch_size(cfg_of("training.global_batch_size=64", "planning.device_memory_gb=2"), prof, 2)
    assert len({round(o.samples_per_s, 6) for o in choice.options}) == 1 and choice.size == 32
    opts = [
        MicrobatchOption(size=b, microbatches=16 // b, step_s=1.0, samples_per_s=16.0, pipelines=2) for b in (1, 2, 4)
    ]
    assert pick_microbatch_size(opts, nodes=2, min_pipelines=2).size == 4
    # a larger size never wins by dropping below f+1 pipelines when a smaller one keeps them
    fewer = opts + [MicrobatchOption(size=8, microbatches=2, step_s=0.5, samples_per_s=32.0, pipelines=1)]
    assert pick_microbatch_size(fewer, nodes=2, min_pipelines=2).size == 4


def test_none_fits_one_line_error_naming_the_keys() -> None:
    prof = linear_profile(layers=4, a=0.01, c=0.001, act_per_sample=GIB, static=GIB // 100)
    cfg = cfg_of("training.global_batch_size=16", "planning.device_memory_gb=0.5")
    with pytest.raises(MicrobatchError) as err:
        choose_microbatch_size(cfg, prof, 2)
    text = str(err.value)
    assert "\n" not in text and err.value.memory_bound
    assert "training.microbatch_size" in text and "planning.device_memory_gb" in text
    with pytest.raises(PlanningError, match="training.microbatch_size=auto"):
        plan_job(cfg, nodes=2, profile=prof)
    # sizes that fit in memory but need more nodes than given: not memory-bound (the job waits)
    with pytest.raises(MicrobatchError) as err:
        choose_microbatch_size(
            cfg_of("training.global_batch_size=256", "planning.device_memory_gb=1"), bubble_profile(), 4
        )
    assert not err.value.memory_bound and "on 4 node(s)" in str(err.value)


def test_a_fixed_size_plans_exactly_as_before() -> None:
    prof = linear_profile(layers=4, a=0.01, c=0.001, act_per_sample=GIB // 10, static=GIB // 100)
    cfg = load_config(
        CFG,
        [
            "training.microbatch_size=2",
            "planning.memory_margin=0",
            "planning.device_memory_gb=2",
            "training.global_batch_size=64",
        ],
    )
    jp = plan_job(cfg, nodes=3, profile=prof)
    assert jp.microbatch is None and jp.plan.microbatch_size == 2 and jp.plan.num_microbatches == 32
    # the profile is used as it is (no fitting), whatever other sizes it holds
    direct = build_templates(prof, gpus_per_node=1, device_memory_gb=2, links=jp.templates.links)
    assert jp.templates.to_json() == direct.to_json()


# ------------------------------------------------------------------ the leader's planner
def test_leader_chooses_once_and_a_new_leader_keeps_the_plans_size() -> None:
    from oobleck_elastic.rendezvous.leader import JobUnplannable
    from oobleck_elastic.rendezvous.planner import JobPlanner

    def handler(cfg, prof):
        h = JobPlanner(cfg, None, None)  # the planner only: no etcd
        h._profile = lambda nodes: prof
        return h

    cfg = cfg_of("training.global_batch_size=256", "planning.device_memory_gb=1")
    leader = handler(cfg, bubble_profile())
    with pytest.raises(PlanningError) as err:  # 4 nodes: too few for any size; wait for more
        leader.plan_for([f"n{i}" for i in range(4)], 1)
    assert not isinstance(err.value, JobUnplannable)
    first = leader.plan_for([f"n{i}" for i in range(16)], 1)
    assert first.microbatch_size == 16
    assert leader.plan_for([f"n{i}" for i in range(64)], 2, first).microbatch_size == 16
    assert handler(cfg, bubble_profile()).plan_for([f"n{i}" for i in range(64)], 2, first).microbatch_size == 16
    tight = cfg_of("training.global_batch_size=256", "planning.device_memory_gb=0.5")
    with pytest.raises(JobUnplannable, match="planning.device_memory_gb"):
        handler(tight, bubble_profile()).plan_for([f"n{i}" for i in range(16)], 1)


# ------------------------------------------------------------------ oobleck plan
def oobleck(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "oobleck_elastic.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_cli_prints_the_choice_from_a_profile_file(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    linear_profile(layers=6, a=0.01, c=0.001, act_per_sample=GIB // 10, static=GIB // 100).save(path)
    args = [
        "plan",
        "--config",
        str(CFG),
        "--nodes",
        "2",
        "--profile",
        str(path),
        "training.microbatch_size=auto",
        "planning.device_memory_gb=2",
        "planning.memory_margin=0",
        "training.global_batch_size=16",
    ]
    res = oobleck(*args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "training.microbatch_size=auto:" in res.stdout and "measured at 1, 4" in res.stdout
    chosen = [line for line in res.stdout.splitlines() if "<- chosen" in line]
    # one-stage pipelines of 6 layers x 0.1 GiB per sample fit up to b = 2; b = 4 fits only as one
    # 2-stage pipeline, fewer than f+1 = 2 pipelines, so it is not chosen though it is faster
    assert len(chosen) == 1 and chosen[0].split()[0] == "2"
    assert "(fewer than f+1 = 2 pipelines)" in res.stdout
    assert "does not fit" in res.stdout and "8 microbatches of 2 (training.microbatch_size=auto)" in res.stdout
    out = json.loads(oobleck(*args, "--json", cwd=tmp_path).stdout)
    assert out["microbatch_size"]["chosen"] == out["plan"]["microbatch_size"] == 2
    assert [c["size"] for c in out["microbatch_size"]["candidates"]] == [1, 2, 4, 8]
    assert [c["fits"] for c in out["microbatch_size"]["candidates"]] == [True, True, True, False]
    assert [c.get("pipelines") for c in out["microbatch_size"]["candidates"]] == [2, 2, 1, None]


def test_cli_profiles_two_sizes_and_caches_them_under_an_auto_key(tmp_path: Path) -> None:
    args = [
        "plan",
        "--config",
        str(CFG),
        "--nodes",
        "4",
        "--json",
        "training.microbatch_size=auto",
        "planning.device_memory_gb=1",
        "data.seq_len=16",
        "planning.profile_repeats=1",
        "planning.profile_warmup=0",
        f"data.cache_dir={tmp_path}",
    ]
    res = oobleck(*args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "microbatch 1 x 16" in res.stderr and "microbatch 4 x 16" in res.stderr
    out = json.loads(res.stdout)
    choice = out["microbatch_size"]
    assert choice["chosen"] == out["plan"]["microbatch_size"] and choice["measured_sizes"] == [1, 4]
    assert sum(p["microbatches"] for p in out["plan"]["pipelines"]) * choice["chosen"] == 16
    (cached,) = (tmp_path / "profiles").glob("*.json")
    prof = ModelProfile.load(cached)
    assert prof.key["microbatch_size"] == "auto" and prof.key["profiled_microbatch_sizes"] == [1, 4]
    assert prof.microbatch_size == 1 and set(prof.at_microbatch_sizes) == {4}


# ------------------------------------------------------------------ a one-worker job
def test_single_process_trains_with_the_chosen_size(tmp_path: Path) -> None:
    from helpers import RandomTokens
    from oobleck_elastic.engine.reference import single_process

    path = tmp_path / "profile.json"
    # one stage of 6 layers, 0.05 GiB per sample each: b <= 3 fits in 1 GiB; a fixed cost makes it win
    linear_profile(layers=6, a=0.01, c=0.001, act_per_sample=GIB // 20, static=GIB // 100).save(path)
    cfg = load_config(
        CFG,
        [
            "training.microbatch_size=auto",
            "training.global_batch_size=12",
            "data.seq_len=8",
            f"planning.profile_path={path}",
            "planning.device_memory_gb=1",
            "planning.memory_margin=0",
            "training.steps=1",
        ],
    )
    trainer = single_process(cfg, dataset=RandomTokens(n=32, seq_len=8))
    try:
        assert trainer.plan is not None and trainer.plan.microbatch_size == 3
        assert trainer.plan.pipelines[0].microbatches == 4 and len(trainer.my_samples(0)) == 12
        result = trainer.train_step(0)
        assert result.loss == result.loss and result.loss > 0
    finally:
        trainer.close()
