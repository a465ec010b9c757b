"""The planner chooses each pipeline's schedule: planning.schedule / planning.chunks_per_device,
the per-pipeline simulation, the plan's virtual stages, and the GPT-3 figure (planning/schedules/choice.py)."""

from __future__ import annotations

import random

import pytest

from oobleck_elastic.cli import main as cli_main
from oobleck_elastic.config import ConfigError, load_config
from oobleck_elastic.engine.startup import check_start
from oobleck_elastic.planning import LayerProfile, ModelProfile, PlanningError, load_profiles, plan_job
from oobleck_elastic.planning.plan.plan import Plan
from oobleck_elastic.planning.schedules.choice import ENGINE_RUNS, PipelineSchedules, candidates
from oobleck_elastic.rendezvous.planner import JobPlanner
from oobleck_elastic.planning.schedules.cost import ScheduleCost, schedule_cost, template_cost

GIB = 2**30


def model(layers: int = 24, seed: int = 0) -> ModelProfile:
    """A transformer-like profile: blocks of varying speed, embeddings, real byte counts."""
    rng = random.Random(seed)
    out = []
    for i in range(layers):
        f = rng.uniform(0.8, 1.2) * 1e-2
        out.append(
            LayerProfile(
                name=f"block{i}",
                forward_s=f,
                backward_s=2 * f,
                param_bytes=50 * 2**20,
                grad_bytes=50 * 2**20,
                optimizer_bytes=100 * 2**20,
                activation_bytes=40 * 2**20,
                output_bytes=8 * 2**20,
            )
        )
    return ModelProfile(layers=out)


def config(**overrides: object):
    base = {
        "planning.device_memory_gb": 3,  # 3 nodes hold one replica
        "planning.gpus_per_node": 1,
        "training.global_batch_size": 16,
        "training.microbatch_size": 1,
        "fault_tolerance.f": 1,
    }
    return load_config(overrides=[f"{k}={v}" for k, v in (base | overrides).items()])


def test_the_candidates_each_setting_allows() -> None:
    assert candidates("1f1b", "auto") == [("1f1b", 1)]
    assert candidates("zbv", "auto") == [("zbv", 2)]
    assert candidates("interleaved-1f1b", 3) == [("interleaved-1f1b", 3)]
    assert candidates("zero-bubble", "auto") == [("zero-bubble", v) for v in range(1, 9)]
    auto = candidates("auto", "auto")
    assert auto[0] == ("1f1b", 1) and ("zbv", 2) in auto and ("gpipe", 1) not in auto
    assert len(auto) == 1 + 7 + 8 + 1
    interleaved = [("interleaved-1f1b", v) for v in range(2, 9)]
    zero_bubble = [("zero-bubble", v) for v in range(1, 9)]
    # the engine runs every candidate: a job's auto is oobleck plan's
    assert candidates("auto", "auto", engine_only=True) == auto
    assert candidates("zero-bubble", "auto", engine_only=True) == zero_bubble
    assert candidates("zbv", "auto", engine_only=True) == [("zbv", 2)]
    assert set(candidates("gpipe", 1, engine_only=True)) <= ENGINE_RUNS
    assert ENGINE_RUNS == {("1f1b", 1), ("gpipe", 1), ("zbv", 2), *zero_bubble, *interleaved}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"planning.schedule": "1f1b", "planning.chunks_per_device": 2},
            "planning.schedule=1f1b runs one stage per device but planning.chunks_per_device=2: "
            "use interleaved-1f1b or zero-bubble for more chunks, or chunks_per_device=auto",
        ),
        (
            {"planning.schedule": "zbv", "planning.chunks_per_device": 3},
            "planning.schedule=zbv runs exactly 2 chunks per device but planning.chunks_per_device=3: use 2 or auto",
        ),
        ({"planning.chunks_per_device": 9}, "'planning.chunks_per_device' is 9: use auto or 1..8"),
        ({"planning.chunks_per_device": "many"}, "'planning.chunks_per_device' is 'many': use auto or 1..8"),
    ],
)
def test_bad_schedule_settings_are_one_line_naming_the_key(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(**overrides)
    assert str(err.value) == f"<defaults>: {message}"


def test_a_job_refuses_a_chunk_count_the_engine_does_not_run_and_auto_plans_only_what_it_runs() -> None:
    with pytest.raises(ConfigError) as err:
        check_start(config(**{"planning.schedule": "interleaved-1f1b", "planning.chunks_per_device": 1}))
    assert str(err.value) == (
        "planning.schedule=interleaved-1f1b with planning.chunks_per_device=1 is planned (oobleck plan shows it) "
        "but the engine runs interleaved-1f1b with 2..8 chunk(s) per device only: set planning.chunks_per_device "
        "to 2..8 or auto"
    )
    check_start(config(**{"planning.schedule": "zbv"}))
    check_start(config(**{"planning.schedule": "zero-bubble", "planning.chunks_per_device": 2}))
    check_start(config(**{"planning.schedule": "zero-bubble"}))
    check_start(config(**{"planning.schedule": "interleaved-1f1b"}))
    cfg = config(**{"planning.schedule": "auto"})
    plan = plan_job(cfg, nodes=10, profile=model(), engine_only=True).plan
    # on this model the V beats 1F1B (the weight gradients fill the cool-down), and the engine runs it
    chosen = {(p.schedule, p.num_chunks) for p in plan.pipelines}
    assert chosen <= ENGINE_RUNS and ("zbv", 2) in chosen


def test_compiled_layers_run_zero_bubble() -> None:
    """Compiled layers split their backward (engine/stage/split_layer.py): zero-bubble with
    training.compile=true starts, and a job's leader plans the same schedules whether its workers
    compile or not (the V among them on this model)."""
    check_start(config(**{"planning.schedule": "zero-bubble", "training.compile": "true"}))
    chosen = []
    for compile_ in ("true", "false", "null"):
        cfg = config(**{"planning.schedule": "auto", "training.compile": compile_})
        check_start(cfg)
        planner = JobPlanner(cfg, None, None)  # type: ignore[arg-type]
        planner._profile = lambda nodes: model()  # type: ignore[method-assign]  # the planner only: no etcd
        plan = planner.plan_for([f"node{i}" for i in range(10)], 1)
        chosen.append(sorted((p.schedule, p.num_chunks) for p in plan.pipelines))
    assert chosen[0] == chosen[1] == chosen[2] and ("zbv", 2) in chosen[0], chosen


def test_each_pipeline_runs_the_fastest_candidate_at_its_microbatches_and_the_plan_round_trips() -> None:
    prof = model()
    cfg = config(**{"planning.schedule": "auto"})
    jp = plan_job(cfg, nodes=10, profile=prof)
    plan, schedules = jp.plan, jp.schedules
    assert schedules is not None and len(plan.pipelines) == 3
    limit = 3 * GIB * 0.9  # memory_margin
    for p in plan.pipelines:
        # the estimate is the simulation of the chosen schedule on the pipeline's own stages
        tset = jp.templates[p.template_nodes]
        ranges = list(schedules.cost(p.template_nodes, p.microbatches, len(plan.pipelines)).ranges)
        again = schedule_cost(
            prof,
            ranges,
            p.schedule,
            p.microbatches,
            chunks=p.num_chunks,
            links=tset.links,
            replicas=len(plan.pipelines),
        )
        assert p.est_time_s == pytest.approx(again.step_s, rel=1e-12)
        # and no candidate that fits is faster
        for name, chunks, got in schedules.table(p.template_nodes, p.microbatches, len(plan.pipelines)):
            if not isinstance(got, str):
                assert got.fits(limit)
                assert got.step_s >= p.est_time_s * (1 - 1e-9), (name, chunks)
    assert plan.est_step_time_s == max(p.est_time_s for p in plan.pipelines)
    assert any(p.num_chunks > 1 for p in plan.pipelines)  # this model gains from chunks
    assert Plan.from_json(plan.to_json()) == plan
    for layer in range(prof.num_layers):  # every layer has exactly one holder per pipeline
        assert len(plan.holders(layer)) == len(plan.pipelines)


def test_chunks_are_virtual_stages_in_loop_placement_and_cover_the_model() -> None:
    prof = model()
    cfg = config(**{"planning.schedule": "interleaved-1f1b", "planning.chunks_per_device": 2})
    plan = plan_job(cfg, nodes=10, profile=prof).plan
    for p in plan.pipelines:
        d = len(p.stages)
        assert p.schedule == "interleaved-1f1b" and p.num_chunks == 2
        for s in p.stages:
            assert len(s.chunks) == 2 and (s.start, s.end) == s.chunks[0]
        # stage c*D + d on device d: device d's second chunk follows the last device's first
        assert p.stages[0].chunks[1][0] == p.stages[d - 1].chunks[0][1]
        held = sorted(i for s in p.stages for i in s.layers())
        assert held == list(range(prof.num_layers))
    broken = plan.to_json()
    broken["pipelines"][0]["stages"][0]["chunks"] = broken["pipelines"][0]["stages"][0]["chunks"][:1]
    with pytest.raises(PlanningError, match="runs 2 chunk\\(s\\) per device but its stages list"):
        Plan.from_json(broken)


def test_a_fixed_schedule_its_microbatches_cannot_feed_says_what_to_change() -> None:
    # 10 microbatches on a 5-device pipeline run in 2 rounds of 5: fine; 11 do not divide into 2 rounds
    def plan(microbatches: int):
        cfg = config(
            **{
                "planning.schedule": "interleaved-1f1b",
                "planning.chunks_per_device": 2,
                "training.global_batch_size": microbatches,
                "fault_tolerance.f": 0,
            }
        )
        return plan_job(cfg, nodes=5, profile=model())

    assert plan(10).plan.pipelines[0].num_chunks == 2
    with pytest.raises(PlanningError) as err:
        plan(11)
    text = str(err.value)
    assert text.startswith("no template of at most 5 node(s) runs a schedule of planning.schedule (the 3-node one: ")
    assert "interleaved schedules run microbatches in 2 rounds of equal size" in text
    assert text.endswith("change planning.schedule or planning.chunks_per_device, or give the devices more memory")


def test_memory_is_a_hard_limit_and_a_candidate_over_it_is_not_chosen() -> None:
    prof = model()
    jp = plan_job(config(**{"planning.schedule": "auto"}), nodes=10, profile=prof)
    assert jp.schedules is not None
    tried = 0
    for n in jp.schedules.simulated_sizes():
        fits = [got for _, _, got in jp.schedules.table(n, 8, 2) if isinstance(got, ScheduleCost)]
        fastest = jp.schedules.cost(n, 8, 2)
        smaller = [c for c in fits if c.peak_memory_bytes < fastest.peak_memory_bytes]
        if not smaller:
            continue
        # one byte below the fastest's peak: it is refused, the fastest of those below runs
        limit = fastest.peak_memory_bytes - 1
        tight = PipelineSchedules(prof, jp.templates, limit, jp.schedules.options)
        again = tight.cost(n, 8, 2)
        assert again.step_s == min(c.step_s for c in smaller) and again.peak_memory_bytes <= limit
        refused = {(name, c): got for name, c, got in tight.table(n, 8, 2)}
        assert refused[(fastest.schedule, fastest.chunks)] == (
            f"needs {fastest.peak_memory_bytes / GIB:.2f} GiB on a device, over the limit of {limit / GIB:.2f} GiB"
        )
        tried += 1
    assert tried >= 3


def test_the_instantiation_line_is_the_simulated_steady_state() -> None:
    prof = model()
    jp = plan_job(config(**{"planning.schedule": "zero-bubble"}), nodes=10, profile=prof)
    assert jp.schedules is not None
    lines = jp.schedules.lines(10, 16, 2)
    for n in jp.schedules.simulated_sizes():
        t, d = lines[n], jp.templates[n].num_stages
        for m in (2 * d, 4 * d, 6 * d):  # also far from where the line was drawn
            exact = min(got.makespan_s for _, _, got in jp.schedules.table(n, m, 2) if not isinstance(got, str))
            # an estimate: the line is one candidate's, the best at m may be another
            assert t.total_time_s + (m - 1) * t.bottleneck_s == pytest.approx(exact, rel=0.07)


def test_a_candidate_is_simulated_once_for_every_replica_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The instantiation's lines and the pipelines' choice ask for the same candidates with
    different replica counts: the simulation does not depend on them, only the all-reduce does,
    and that is the one a fresh simulation for those replicas gives."""
    import oobleck_elastic.planning.schedules.choice as choice

    prof = model()
    jp = plan_job(config(**{"planning.schedule": "auto"}), nodes=10, profile=prof)
    assert jp.schedules is not None
    fresh = PipelineSchedules(prof, jp.templates, jp.schedules.memory_limit_bytes, jp.schedules.options)
    runs: list[tuple] = []
    monkeypatch.setattr(choice, "template_cost", lambda *a, **k: runs.append(a) or template_cost(*a, **k))
    n = jp.templates.n0
    two = fresh.table(n, 8, 2)
    simulated = len(runs)
    assert simulated >= 5
    five = fresh.table(n, 8, 5)
    assert len(runs) == simulated  # none again
    for (name, chunks, got), (_, _, other) in zip(two, five):
        if isinstance(got, str):
            assert other == got
            continue
        assert isinstance(other, ScheduleCost)
        t = jp.templates[n]
        alone = schedule_cost(
            prof,
            got.ranges,
            name,
            8,
            chunks=chunks,
            links=t.links,
            stages_per_node=t.gpus_per_node // t.tensor_parallel,
            replicas=5,
        )
        assert (other.step_s, other.grad_sync_s, other.makespan_s) == (
            alone.step_s,
            alone.grad_sync_s,
            alone.makespan_s,
        )
        assert other.grad_sync_s > got.grad_sync_s > 0


def test_gpt3_on_1024_nodes_auto_cuts_the_bubble(capsys: pytest.CaptureFixture[str]) -> None:
    """The figure the README and docs/schedules.md quote: GPT-3 175B on 1,024 nodes of 8 devices at tp 8."""
    base = ["planning.tensor_parallel=8"]
    cfg = load_config("configs/gpt3-175b.yaml", base)
    profiles = load_profiles(cfg)
    one = plan_job(cfg, nodes=1024, profile=profiles)
    auto_cfg = load_config("configs/gpt3-175b.yaml", base + ["planning.schedule=auto"])
    auto = plan_job(auto_cfg, nodes=1024, profile=profiles)
    assert 1 - one.efficiency == pytest.approx(0.464, abs=0.01)  # with the all-reduce overlapped
    assert 1 - auto.efficiency < 0.20
    assert auto.plan.samples_per_s > 1.45 * one.plan.samples_per_s
    assert {(p.schedule, p.num_chunks) for p in auto.plan.pipelines} == {("zero-bubble", 4), ("zero-bubble", 5)}
    assert auto.plan.samples_per_s == pytest.approx(296.0, abs=0.05)
    # a job plans it so (the engine runs every schedule, compiled layers included)
    job = plan_job(auto_cfg, nodes=1024, profile=profiles, engine_only=True)
    assert job.plan == auto.plan
    code = cli_main(["plan", "--config", "configs/gpt3-175b.yaml", "--nodes", "1024", *base, "planning.schedule=auto"])
    out = capsys.readouterr().out
    assert code == 0
    assert "schedules (per kind of pipeline" in out and "<- chosen" in out


def test_a_replan_of_interleaved_pipelines_moves_only_what_changes_owner_and_loses_nothing() -> None:
    from oobleck_elastic.engine.entry.reconfigure import plan_transfers

    prof = model()
    cfg = config(**{"planning.schedule": "interleaved-1f1b", "planning.chunks_per_device": 2})
    old = plan_job(cfg, nodes=10, profile=prof, generation=1).plan
    assert all(p.num_chunks == 2 for p in old.pipelines) and len(old.pipelines) >= 2
    held = old.layers_by_worker()
    survivors = [n for n in old.nodes if n != old.pipelines[0].nodes[0]]  # a node of the first pipeline dies
    held = {ident: layers for ident, layers in held.items() if ident[0] in survivors}
    new = plan_job(cfg, nodes=survivors, profile=prof, generation=2, previous=old).plan
    transfers, lost = plan_transfers(held, new)
    assert lost == []
    needs = {(s.node, s.local_rank): set(s.layers()) for p in new.pipelines for s in p.stages}
    # every layer a worker needs and did not hold arrives exactly once, from a worker that held it
    for (node, lr), layers in needs.items():
        rank = new.entry_ranks()[(node, lr)]
        got = sorted(t.layer for t in transfers if t.dst == rank)
        assert got == sorted(layers - set(held.get((node, lr), ())))
    by_rank = {r: ident for ident, r in new.entry_ranks().items()}
    assert all(t.layer in held[by_rank[t.src]] for t in transfers)


def test_the_leaders_replans_reuse_its_simulations_and_plan_the_same() -> None:
    cfg = config(**{"planning.schedule": "auto"})
    nodes = [f"node{i}" for i in range(10)]

    def planner() -> JobPlanner:
        p = JobPlanner(cfg, None, None)  # type: ignore[arg-type]
        p._profile = lambda n: model()  # type: ignore[method-assign]  # the planner only: no etcd
        return p

    leader = planner()
    first = leader.plan_for(nodes, 1)
    chooser = leader._schedules
    assert chooser is not None
    again = leader.plan_for(nodes[:-1], 2, previous=first)  # a node lost
    assert leader._schedules is chooser  # the same cache, not a new one
    fresh = planner()
    fresh.plan_for(nodes, 1)
    assert again == fresh.plan_for(nodes[:-1], 2, previous=first)
