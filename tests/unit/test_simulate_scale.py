"""The scale study charges costs measured from the real code: detection from the rendezvous
settings, re-planning timed on the leader's call, transfer from the bytes those re-plans move."""

from __future__ import annotations

import functools

import pytest

from oobleck_elastic.planning import plan_job
from oobleck_elastic.planning.plan.placement import bytes_received
from oobleck_elastic.simulate.scale import (
    LIVENESS_KILL_TO_PLAN_S,
    MeasuredOobleckElastic,
    Planner,
    ScaleSettings,
    measure_costs,
    run_scale,
)
from oobleck_elastic.simulate.systems import replay
from oobleck_elastic.simulate.trace import NodeEvent


@functools.cache
def _planner() -> Planner:
    return Planner(tensor_parallel=8, global_batch=1536)


def test_costs_come_from_the_config_and_the_planner() -> None:
    planner = _planner()
    costs = measure_costs(ScaleSettings(nodes=96), planner)
    ft = planner.cfg.fault_tolerance
    assert costs["detection"].measured_s == ft.lease_ttl_s + ft.settle_s == 5.5
    assert [c.assumed_s for c in (costs["detection"], costs["replan"])] == [0.6, 0.05]
    assert 0 < costs["replan"].measured_s < 5.0
    # the busiest receiver of the three re-plans, recomputed here for the last node lost
    nodes = [f"node{i}" for i in range(96)]
    before = plan_job(planner.cfg, nodes=nodes, templates=planner.templates, generation=1).plan
    after = plan_job(planner.cfg, nodes=nodes[:-1], templates=planner.templates, generation=2, previous=before).plan
    last_lost = max(bytes_received(before, after, planner.shard_bytes).values()) / 100e9
    assert costs["transfer"].measured_s >= last_lost > 0
    assert costs["transfer"].assumed_s == pytest.approx(planner.replica_bytes / min(planner.pipelines(96)) / 100e9)
    assert costs["detection"].line().startswith("detection: assumed 0.6 s, measured 5.5 s (a failed machine's lease")
    process = measure_costs(ScaleSettings(nodes=96, failure="process"), planner)["detection"]
    assert process.measured_s == LIVENESS_KILL_TO_PLAN_S
    with pytest.raises(ValueError, match="failure must be 'node' or 'process' \\(got 'gpu'\\)"):
        measure_costs(ScaleSettings(nodes=96, failure="gpu"), planner)


def test_a_failure_costs_detection_replan_and_the_measured_transfer() -> None:
    system = MeasuredOobleckElastic(
        "oobleck_elastic",
        lambda n: 10.0 * n,
        batch=10.0,
        min_nodes=1,
        replica_bytes=1e12,
        detection_s=5.5,
        replan_s=0.25,
        measured_transfer_s=3.0,
        pipelines=lambda n: [1] * n,
    )
    events = [NodeEvent(0.0, "add", f"n{i}") for i in range(4)] + [NodeEvent(100.0, "remove", "n2")]
    tl = replay(system, events, end_s=200.0)
    start = 0.25  # the first plan
    assert tl.breakdown["reconfiguration"] == pytest.approx(start + 5.5 + 0.25 + 3.0)


def test_scale_study_charges_and_reports_the_measured_costs() -> None:
    settings = dict(nodes=96, hours=6.0, node_mtbf_h=100.0, seed=3)
    measured = run_scale(ScaleSettings(**settings), _planner())
    assumed = run_scale(ScaleSettings(**settings, measured_costs=False), _planner())
    ours = {r["system"]: r for r in measured.rows()}["oobleck_elastic"]
    assert set(ours["costs"]) == {"detection", "replan", "transfer"}
    assert ours["costs"]["detection"]["measured_s"] == 5.5
    lines = measured.cost_lines()
    assert lines[0] == "oobleck_elastic charges the measured costs:"
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["detection", "replan", "transfer"]
    assert assumed.cost_lines()[0] == "oobleck_elastic charges the assumed costs:"
    recon = [r.timelines["oobleck_elastic"].breakdown["reconfiguration"] for r in (measured, assumed)]
    assert measured.failures == assumed.failures > 0
    assert recon[0] > recon[1] > 0  # 5.5 s detections instead of 0.6 s


@functools.cache
def _small_batch_planner(schedule: str) -> Planner:
    # 256 sequences on 96 nodes: ~20 microbatches a pipeline, as 1,536 give on 1,024 nodes
    # (a simulation's cost grows with the microbatches)
    return Planner(tensor_parallel=8, global_batch=256, schedule=schedule)


def test_the_scale_study_charges_the_schedules_the_planner_chooses() -> None:
    """With planning.schedule=auto every plan of the run (each node count) runs the schedules
    chosen by simulation, and both systems are charged that throughput: at least 1F1B's."""
    settings = dict(nodes=96, hours=6.0, node_mtbf_h=100.0, seed=3, global_batch=256)
    auto = run_scale(ScaleSettings(**settings, schedule="auto"), _small_batch_planner("auto"))
    one = run_scale(ScaleSettings(**settings), _small_batch_planner("1f1b"))
    rows = {(r["schedule"], r["system"]): r for r in auto.rows() + one.rows()}
    for system in ("oobleck_elastic", "checkpoint_restart"):
        assert rows["auto", system]["samples_per_s"] >= rows["1f1b", system]["samples_per_s"] > 0
    assert auto.failures == one.failures > 0
    assert one.chosen == {"1f1b/1": 16} and "1f1b/1" not in auto.chosen  # zero-bubble and zbv
    assert rows["auto", "oobleck_elastic"]["schedules_at_start"] == auto.chosen
    assert auto.start_samples_per_s > 1.1 * one.start_samples_per_s
    # one PipelineSchedules serves every node count: the plans of a fresh one per call
    planner = _small_batch_planner("auto")
    for n in (95, 97):
        fresh = plan_job(planner.cfg, nodes=n, templates=planner.templates).plan
        shared = planner.plan(n)
        assert shared is not None
        assert shared.samples_per_s == fresh.samples_per_s
        assert [(p.nodes, p.schedule, p.num_chunks, p.microbatches) for p in shared.pipelines] == [
            (p.nodes, p.schedule, p.num_chunks, p.microbatches) for p in fresh.pipelines
        ]
    with pytest.raises(ValueError, match="the planner plans with schedule auto, the settings say 1f1b"):
        run_scale(ScaleSettings(**settings), planner)
