"""`training.activation_checkpoint: auto`: the planner recomputes exactly the stages that do not fit
without, with the template's split and each schedule, and the plan records each stage's mode
(planning/templates/partition.py, planning/schedules/choice.py, planning/plan/recompute.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from oobleck_elastic.planning import LayerProfile, ModelProfile, PlanningError
from oobleck_elastic.planning.plan.build import make_plan
from oobleck_elastic.planning.plan.plan import Plan
from oobleck_elastic.planning.plan.recompute import stage_runs, summary
from oobleck_elastic.planning.schedules.choice import PipelineSchedules
from oobleck_elastic.planning.schedules.cost import chunk_ranges, template_cost
from oobleck_elastic.planning.templates.templates import build_templates, memory_limit_bytes

GIB = 2**30


def profile() -> ModelProfile:
    """4 layers of 1 GiB (params, grads, optimizer state) keeping 1 GiB of activations per
    microbatch, 1/8 GiB recomputed; forward 1 s, backward 2 s, 3 s recomputed."""
    q = GIB // 4
    layer = dict(forward_s=1.0, backward_s=2.0, param_bytes=q, grad_bytes=q, optimizer_bytes=2 * q)
    layer |= dict(activation_bytes=GIB, recomputed_backward_s=3.0, recomputed_activation_bytes=GIB // 8)
    return ModelProfile(layers=[LayerProfile(name=f"block.{i}", **layer) for i in range(4)])  # type: ignore[arg-type]


def templates(memory_gb: float, mode: str = "auto"):
    prof = profile().in_mode(mode)
    tset = build_templates(
        prof, gpus_per_node=2, device_memory_gb=memory_gb, node_counts=[1], activation_checkpoint=mode
    )
    return dataclasses.replace(tset, profile=prof, microbatch_size=1)


def modes(plan: Plan) -> list[str | None]:
    return [s.activation_checkpoint for p in plan.pipelines for s in p.stages]


def test_auto_recomputes_only_the_stage_that_does_not_fit_without() -> None:
    """Two stages of two layers under 1F1B: the first keeps 2 microbatches in flight (2 + 2 x 2 =
    6 GiB without recomputation, over the 5 GiB), the second 1 (4 GiB: fits)."""
    tset = templates(5.0)
    t = tset[1]
    assert t.layer_ranges() == [(0, 2), (2, 4)]
    assert [s.recompute for s in t.stages] == [True, False]
    assert [s.memory_bytes / GIB for s in t.stages] == [2.5, 4.0]
    assert [s.time_s for s in t.stages] == [8.0, 6.0]  # the first stage's backward replays its forward
    plan = make_plan(tset, nodes=["a"], num_microbatches=4, microbatch_size=1, f=0)
    assert modes(plan) == ["full", "none"]
    assert modes(Plan.from_json(plan.to_json())) == ["full", "none"]
    # under a simulated schedule: the devices over the limit without recomputation recompute
    limit = memory_limit_bytes(5.0, 0.0)
    for schedule, chunks in (("1f1b", 1), ("zero-bubble", 1), ("interleaved-1f1b", 2)):
        schedules = PipelineSchedules(tset.profile, tset, limit, [(schedule, chunks)])
        cost = schedules.cost(1, 4, 1)
        ranges = tset[1].layer_ranges() if chunks == 1 else chunk_ranges(tset.profile, 2 * chunks)
        without = template_cost(tset.profile, tset[1], schedule, 4, chunks=chunks, ranges=ranges)
        over = [without.memory_bytes[d] > limit for d in without.placement]
        assert cost.recompute == tuple(over) and any(over) and cost.fits(limit), schedule
        plan = make_plan(tset, nodes=["a"], num_microbatches=4, microbatch_size=1, f=0, schedules=schedules)
        assert modes(plan) == [("full" if without.memory_bytes[d] > limit else "none") for d in range(2)]
        if schedule == "1f1b":
            assert modes(plan) == ["full", "none"]


def test_auto_recomputes_nothing_where_everything_fits() -> None:
    tset = templates(100.0)
    assert not any(s.recompute for s in tset[1].stages)
    assert modes(make_plan(tset, nodes=["a"], num_microbatches=4, microbatch_size=1, f=0)) == ["none", "none"]
    schedules = PipelineSchedules(tset.profile, tset, memory_limit_bytes(100.0, 0.0), [("zero-bubble", 1)])
    assert schedules.cost(1, 4, 1).recompute == ()


def test_none_and_full_are_every_stage_and_auto_is_between() -> None:
    full, none = templates(100.0, "full"), templates(100.0, "none")
    assert modes(make_plan(full, nodes=["a"], num_microbatches=4, microbatch_size=1, f=0)) == ["full", "full"]
    assert modes(make_plan(none, nodes=["a"], num_microbatches=4, microbatch_size=1, f=0)) == ["none", "none"]
    with pytest.raises(PlanningError, match="set training.activation_checkpoint=auto"):
        templates(5.0, "none")  # the first stage does not fit without recomputation
    tight = templates(5.0)
    assert (tight[1].total_time_s, templates(5.0, "full")[1].total_time_s) == (14.0, 16.0)  # one stage replays


def test_where_even_recomputation_does_not_fit_the_error_says_so() -> None:
    with pytest.raises(PlanningError, match="even with its activations recomputed"):
        templates(2.2)  # 2 layers' parameters alone are 2 GiB: 2 + 2 x 1/8 > 2.2
    tset = templates(5.0)  # a schedule over the limit on a device even recomputed is refused, saying so
    schedules = PipelineSchedules(tset.profile, tset, memory_limit_bytes(2.2, 0.0), [("zero-bubble", 1)])
    with pytest.raises(PlanningError, match="with its activations recomputed, over the limit"):
        schedules.cost(1, 4, 1)


def test_a_plan_without_the_stages_mode_reads_as_not_recorded() -> None:
    plan = make_plan(templates(5.0), nodes=["a"], num_microbatches=4, microbatch_size=1, f=0)
    data = plan.to_json()
    for p in data["pipelines"]:
        for s in p["stages"]:
            del s["activation_checkpoint"]
    assert modes(Plan.from_json(data)) == [None, None]
    data["pipelines"][0]["stages"][0]["activation_checkpoint"] = "selective"
    with pytest.raises(PlanningError, match="activation_checkpoint is 'selective'"):
        Plan.from_json(data)


def test_the_leader_ignores_a_published_profile_without_the_jobs_mode() -> None:
    """A worker's profile in etcd that has no numbers for `training.activation_checkpoint` (made by
    an older version, under one mode) is ignored with a warning, as one measured for another job."""
    from oobleck_elastic.config import load_config
    from oobleck_elastic.rendezvous.planner import JobPlanner

    cfg = load_config(overrides=["model.num_layers=2", "training.activation_checkpoint=auto"])
    planner = JobPlanner(cfg, None, None)  # type: ignore[arg-type]  # the check only: no etcd
    both = profile()
    assert planner._valid("profiles/a", json.dumps(both.to_json()).encode(), 1, of_this_job=True) == both
    one = ModelProfile(layers=both.in_mode("full").layers, key={"recompute": True})
    assert planner._valid("profiles/b", json.dumps(one.to_json()).encode(), 1, of_this_job=True) is None


def test_oobleck_plan_shows_each_stages_mode(capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-3 175B on 1,024 nodes as configs/gpt3-175b.yaml plans it (tp 1, 1F1B): without
    recomputation no split fits, with it everywhere 62.25 samples/s; auto recomputes on the
    stages that need it (the early ones, with the most microbatches in flight) and plans more."""
    from oobleck_elastic.cli import main as cli_main

    assert stage_runs([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and stage_runs([]) == "none"
    plan = make_plan(templates(5.0), nodes=["a"], num_microbatches=4, microbatch_size=1, f=0)
    assert summary(plan, "auto") == "auto: 1 of 2 stages recompute (full), the others none"
    base = ["plan", "--config", "configs/gpt3-175b.yaml", "--nodes", "1024"]
    rates = {}
    for mode in ("full", "auto"):
        assert cli_main([*base, f"training.activation_checkpoint={mode}"]) == 0
        out = capsys.readouterr().out
        rates[mode] = float(out.split(" samples/s")[0].rsplit(" ", 1)[1])
        assert "stages recomputed: 0-" in out if mode == "auto" else "activation checkpointing: full\n" in out
    assert "activation checkpointing: auto: 3405 of 8192 stages recompute (full), the others none" in out
    assert rates == {"full": 62.25, "auto": 71.25}
    assert cli_main([*base, "training.activation_checkpoint=none"]) == 2
    assert "set training.activation_checkpoint=auto" in capsys.readouterr().err
