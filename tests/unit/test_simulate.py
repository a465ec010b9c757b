"""The simulator: each system model charges exactly its mechanism on small hand-made traces,
traces load (and fail) as documented, and `oobleck simulate` reproduces the paper's runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from oobleck_elastic.simulate import (
    Bamboo,
    CheckpointRestart,
    NodeEvent,
    Oobleck,
    OobleckElastic,
    TraceError,
    Varuna,
    load_trace,
    node_counts,
    replay,
    synthetic_trace,
)
from oobleck_elastic.simulate.paper import (
    SYSTEMS,
    load_inputs,
    paper_table,
    run_paper,
    smallest_template,
    table_throughput,
)
from oobleck_elastic.simulate.timeline import CATEGORIES, Timeline

ROOT = Path(__file__).resolve().parents[2]


def start(*nodes: str) -> list[NodeEvent]:
    return [NodeEvent(0.0, "add", n) for n in nodes]


def tput(n: int) -> float:
    """Samples/s with n nodes: 5 per node (batch 100: a step takes 20 / n seconds x 10)."""
    return 5.0 * n


def check_breakdown(tl: Timeline) -> None:
    assert set(tl.breakdown) == set(CATEGORIES)
    assert sum(tl.breakdown.values()) == pytest.approx(tl.t)


def test_a_timeline_commits_steps_and_checkpoints() -> None:
    tl = Timeline(batch=100, checkpoint_every=2, checkpoint_s=3.0)
    tl.set_rate(10.0)  # 10 s per step
    tl.advance(50.0)  # steps end at 10, 20 | checkpoint 20-23 | 33, 43 | checkpoint 43-46 | 46-50 in flight
    assert tl.samples == 400
    assert tl.breakdown["checkpoint"] == pytest.approx(6.0)
    assert tl.into_step == pytest.approx(4.0)
    lost = tl.rollback()  # back to the checkpoint at step 4: only the step in flight goes
    assert lost == pytest.approx(4.0) and tl.samples == 400
    check_breakdown(tl)


def test_oobleck_loses_the_step_in_flight_and_pays_one_reconfiguration() -> None:
    events = start("a", "b") + [NodeEvent(25.0, "remove", "b")]
    tl = replay(Oobleck("oobleck", tput, 100, reconfiguration_s=2.0), events, end_s=100.0)
    # the start is a reconfiguration too (2 s); 2 nodes: 10 s steps end at 12, 22; at 25 the step in
    # flight (3 s) is lost; 2 s reconfiguration; 1 node: 20 s steps end at 47, 67, 87; 13 s in flight
    assert tl.samples == 500
    assert tl.breakdown["lost"] == pytest.approx(3.0)
    assert tl.breakdown["reconfiguration"] == pytest.approx(2.0 + 2.0)
    assert tl.breakdown["useful"] == pytest.approx(20.0 + 60.0 + 13.0)
    check_breakdown(tl)


def test_oobleck_admits_joining_nodes_only_at_the_next_reconfiguration() -> None:
    events = start("a") + [NodeEvent(30.0, "add", "b"), NodeEvent(65.0, "remove", "zz-not-running")]
    tl = replay(Oobleck("oobleck", tput, 100, reconfiguration_s=1.0), events, end_s=65.0)
    assert tl.rate == tput(1)  # the join waits (a removal of an unknown node changes nothing)
    # idle node-time: b from 30 to 65, a during the first second's reconfiguration
    assert tl.node_s == pytest.approx(65 + 35) and tl.idle_node_s == pytest.approx(35 + 1)
    events = start("a") + [NodeEvent(30.0, "add", "b"), NodeEvent(50.0, "remove", "a")]
    tl = replay(Oobleck("oobleck", tput, 100, reconfiguration_s=1.0), events, end_s=60.0)
    assert tl.rate == tput(1) and tl.breakdown["reconfiguration"] == pytest.approx(1.0 + 1.0)


def test_varuna_restarts_from_its_last_checkpoint() -> None:
    events = start("a", "b") + [NodeEvent(55.0, "remove", "b")]
    tl = replay(Varuna("varuna", tput, 100, restart_s=10.0, checkpoint_every=3, checkpoint_s=4.0), events, end_s=200.0)
    # start: 10 s; 10 s steps end at 20, 30, 40 | checkpoint 40-44 | 54 | failure at 55: step 4 and 1 s lost
    assert tl.breakdown["lost"] == pytest.approx(11.0)
    assert tl.breakdown["restart"] == pytest.approx(10.0 + 10.0)
    # from 65 on one node: 20 s steps end at 85, 105, 125 | checkpoint 125-129 | 149, 169, 189 | ckpt 189-193
    assert tl.samples == 900
    assert tl.breakdown["checkpoint"] == pytest.approx(12.0)
    check_breakdown(tl)


def test_checkpoint_restart_ignores_joins_and_restarts_from_its_checkpoint_on_a_failure() -> None:
    """torchrun's restart-from-checkpoint: a node that joins a running job waits (no restart); a
    failure rolls back to the last checkpoint and restarts on the nodes up."""
    events = start("a", "b") + [NodeEvent(30.0, "add", "c"), NodeEvent(55.0, "remove", "b")]
    tl = replay(
        CheckpointRestart("torchrun", tput, 100, restart_s=5.0, checkpoint_every=2, checkpoint_s=1.0),
        events,
        end_s=100.0,
    )
    # start 0-5; 10 s steps end at 15, 25 | ckpt 25-26 | 36, 46 | ckpt 46-47 | c joins at 30: nothing |
    # failure at 55: the 8 s in flight are lost (step 4 was checkpointed); restart 55-60 on a and c:
    # steps end at 70, 80 | ckpt 80-81 | 91 | 9 s in flight at 100
    assert tl.samples == 700 and tl.rate == tput(2)
    b = tl.breakdown
    assert (b["lost"], b["restart"], b["checkpoint"]) == pytest.approx((8.0, 10.0, 3.0))
    assert tl.breakdown["useful"] == pytest.approx(79.0)
    check_breakdown(tl)


def test_bamboo_absorbs_one_failure_and_restarts_after_two_neighbours() -> None:
    nodes = ["n0", "n1", "n2", "n3", "n4"]
    one = start(*nodes) + [NodeEvent(35.0, "remove", "n2")]
    tl = replay(
        Bamboo("bamboo", tput, 100, reconfiguration_s=7.0, restart_s=30.0, redundant_fraction=0.8), one, end_s=100.0
    )
    # start: a 30 s restart; 4 s steps (5 nodes) from 30; at 35 the step in flight (1 s done) finishes
    # 1.5x slower: 3 s + 1.5 s, then a 7 s reconfiguration
    assert tl.breakdown["restart"] == pytest.approx(30.0) and tl.breakdown["lost"] == 0
    assert tl.breakdown["reconfiguration"] == pytest.approx(1.5 + 7.0)
    assert tl.breakdown["redundant"] == pytest.approx(4 * tl.breakdown["useful"])
    two = start(*nodes) + [NodeEvent(35.0, "remove", "n2"), NodeEvent(36.0, "remove", "n3")]
    tl = replay(Bamboo("bamboo", tput, 100, reconfiguration_s=7.0, restart_s=30.0), two, end_s=100.0)
    assert tl.breakdown["restart"] == pytest.approx(60.0)  # n3 was n2's neighbour, redundancy not restored
    apart = start(*nodes) + [NodeEvent(35.0, "remove", "n0"), NodeEvent(36.0, "remove", "n2")]
    tl = replay(Bamboo("bamboo", tput, 100, reconfiguration_s=7.0, restart_s=30.0), apart, end_s=100.0)
    assert tl.breakdown["restart"] == pytest.approx(30.0)


def elastic(**kw) -> OobleckElastic:
    base = dict(
        detection_s=0.5,
        replan_s=0.1,
        replica_bytes=4e9,
        node_bandwidth_b_s=1e9,
        restart_s=40.0,
        checkpoint_every=4,
        checkpoint_s=2.0,
        pipelines=lambda n: [n // 2, n - n // 2],
    )
    return OobleckElastic("oobleck_elastic", tput, 100, **(base | kw))


def test_oobleck_elastic_charges_detection_replanning_and_the_layer_transfer() -> None:
    nodes = ["a", "b", "c", "d"]
    events = start(*nodes) + [NodeEvent(6.0, "remove", "c")]
    tl = replay(elastic(), events, end_s=60.0)
    # start: 0.1 s plan; 5 s steps end at 5.1; at 6 the step in flight (0.9 s) is lost; c held half a
    # replica (1 of its pipeline's 2 nodes): 4e9 / 2 / 1e9 = 2 s
    assert tl.breakdown["lost"] == pytest.approx(0.9)
    assert tl.breakdown["reconfiguration"] == pytest.approx(0.1 + 0.5 + 0.1 + 2.0)
    assert tl.breakdown["restart"] == 0
    check_breakdown(tl)


def test_oobleck_elastic_restores_the_checkpoint_when_every_copy_of_a_layer_is_gone() -> None:
    nodes = ["a", "b", "c", "d"]  # pipelines [a, b] and [c, d]: a and c hold the first half of the model
    survivable = start(*nodes) + [NodeEvent(21.0, "remove", "a"), NodeEvent(21.0, "remove", "d")]
    tl = replay(elastic(), survivable, end_s=60.0)
    assert tl.breakdown["restart"] == 0
    fatal = start(*nodes) + [NodeEvent(21.0, "remove", "a"), NodeEvent(21.0, "remove", "c")]
    tl = replay(elastic(), fatal, end_s=80.0)
    # 4 steps by 20.1 s, checkpoint 20.1-22.1; at 21 the failure cuts it; restart 0.5 + 40 s, to 61.5
    assert tl.breakdown["restart"] == pytest.approx(40.5)
    assert tl.samples == 400 + 100  # the checkpoint's 4 steps, then one 10 s step (2 nodes) by 80 s
    check_breakdown(tl)


def test_oobleck_elastic_admits_a_join_at_the_step_boundary() -> None:
    events = start("a", "b") + [NodeEvent(12.0, "add", "c")]
    tl = replay(elastic(checkpoint_every=None), events, end_s=40.0)
    # 10 s steps from 0.1; the join at 12 lets the step in flight finish (20.1), then 0.1 s + c's layers
    # (pipelines [1, 2]: the 1-node one's whole replica, 4e9 / 1e9)
    assert tl.breakdown["lost"] == 0
    assert tl.breakdown["reconfiguration"] == pytest.approx(0.1 + 0.1 + 4.0)
    assert tl.rate == tput(3)


def test_traces_load_and_refuse_bad_lines(tmp_path: Path) -> None:
    events = load_trace(ROOT / "configs/simulate/traces/10m.csv")
    assert sum(e.kind == "add" for e in events) == 30 and sum(e.kind == "remove" for e in events) == 15
    assert node_counts(events)[0] == (0.0, 30) and node_counts(events)[-1][1] == 15
    bad = tmp_path / "bad.csv"
    bad.write_text("0,add,node1\n1000,explode,node1\n")
    with pytest.raises(
        TraceError,
        match=r"bad.csv:2: expected add or remove of a named node at a time >= 0 "
        r"\(got '1000,explode,node1'\)",
    ):
        load_trace(bad)
    with pytest.raises(TraceError, match="trace file '.*missing.csv' does not exist"):
        load_trace(tmp_path / "missing.csv")


def test_synthetic_traces_are_poisson_per_node_and_reproducible() -> None:
    a = synthetic_trace(200, mtbf_h=100.0, duration_h=50.0, seed=3)
    assert a == synthetic_trace(200, mtbf_h=100.0, duration_h=50.0, seed=3)
    failures = sum(e.kind == "remove" for e in a)
    assert 60 < failures < 100  # expected 200 x (1 - exp(-0.5)) = 78.7
    joins = synthetic_trace(50, mtbf_h=10.0, duration_h=10.0, join_delay_s=600.0, seed=1)
    removed = [e for e in joins if e.kind == "remove"]
    assert sum(e.kind == "add" for e in joins) - 50 == sum(1 for e in removed if e.time_s + 600 < 36000)


def test_the_paper_tables_are_looked_up_as_the_authors_did() -> None:
    inputs = load_inputs()
    table = inputs["models"]["BERT-large"]["throughput"]["oobleck"]
    f = table_throughput(table, top=30)
    assert f(40) == f(30) == table[0] and f(16) == table[14] and f(12) == f(15) == table[15]
    six = table_throughput(inputs["models"]["GPT-3-6.7B"]["throughput"]["oobleck"], top=30)
    assert six(15) == 0 and smallest_template(six, 12, 30) == 8  # 6.7B needs 16 nodes: two pipelines of 8


def test_paper_reproduction_runs_every_model_trace_and_system() -> None:
    inputs = load_inputs()
    runs = run_paper(inputs, traces=["6h", "scale_gcp-trace"])
    assert len(runs) == 2 * 5 * len(SYSTEMS)
    by = {(r.model, r.trace, r.system): r.timeline.average_samples_per_s() for r in runs}
    assert by[("GPT-3-medium", "6h", "bamboo")] == 0  # out of memory with redundancy
    for key, value in by.items():
        assert value >= 0, key
    table = paper_table(runs)
    assert table.splitlines()[0].split()[:3] == ["model", "trace", "oobleck"]


def test_cli_paper_json_has_the_documented_keys() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "oobleck_elastic.cli", "simulate", "--paper", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=ROOT,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 5 * 8 * 5
    assert {r["model"] for r in rows} == {"BERT-large", "GPT-2", "GPT-3-medium", "GPT-3-2.7B", "GPT-3-6.7B"}
    assert {r["trace"] for r in rows} == {"6h", "3h", "1h", "30m", "10m", "5m", "scale_p3-trace", "scale_gcp-trace"}
    assert {r["system"] for r in rows} == set(SYSTEMS)
    assert all(isinstance(r["samples_per_s"], float) for r in rows)


def test_cli_reports_a_bad_trace_in_one_line() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "oobleck_elastic.cli", "simulate", "--trace", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 2
    assert res.stderr.strip().endswith("configs/simulate/traces/nope.csv' does not exist")


def test_scale_study_runs_the_planner_against_checkpoint_restart() -> None:
    from oobleck_elastic.simulate.scale import ScaleSettings, run_scale

    result = run_scale(ScaleSettings(nodes=128, hours=6.0, node_mtbf_h=200.0, seed=2))
    rows = {r["system"]: r for r in result.rows()}
    assert set(rows) == {"oobleck_elastic", "checkpoint_restart"} and result.failures > 0
    for r in rows.values():
        assert 0 < r["useful_fraction"] <= 1 and r["checkpoint_every_steps"] >= 1
    assert rows["checkpoint_restart"]["breakdown_s"]["restart"] > 0
    assert rows["oobleck_elastic"]["breakdown_s"]["reconfiguration"] > 0


def test_cli_synthetic_run_prints_a_table_and_plots(tmp_path: Path) -> None:
    png = tmp_path / "run.png"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "oobleck_elastic.cli",
            "simulate",
            "--nodes",
            "20",
            "--mtbf",
            "5",
            "--hours",
            "6",
            "--join-delay-s",
            "600",
            "--model",
            "GPT-2",
            "--systems",
            "oobleck_elastic,varuna",
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=ROOT,
    )
    lines = res.stdout.splitlines()
    assert lines[0].startswith("GPT-2 on synthetic-20n-mtbf5h:") and lines[0].endswith("6.00 h")
    assert lines[1].split()[:3] == ["system", "samples/s", "samples"]
    assert [line.split()[0] for line in lines[2:]] == ["oobleck_elastic", "varuna"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_detection_model_for_machine_losses_in_paper_and_scale() -> None:
    """The traces remove machines: a lost machine closes no socket, so its lease decides. `--paper`
    charges what `--scale` charges, the default config's lease TTL + settle window (it charged a
    killed process's 0.6 s)."""
    from oobleck_elastic.config import FaultToleranceConfig
    from oobleck_elastic.simulate.paper import load_inputs, systems_for
    from oobleck_elastic.simulate.systems import OobleckElastic, machine_loss_detection_s

    ft = FaultToleranceConfig()
    assert machine_loss_detection_s() == ft.lease_ttl_s + ft.settle_s == 5.5
    (ours,) = systems_for(load_inputs(), "GPT-2", ["oobleck_elastic"])
    assert isinstance(ours, OobleckElastic) and ours.detection_s == 5.5
