"""Shadow copies in the simulator: which simultaneous losses they turn from a checkpoint restore
into a re-plan (on made-up traces and configurations), what they cost when nothing fails, and what
`oobleck simulate --shadow-copies` reports."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from oobleck_elastic.planning.tolerance.shadows import survives
from oobleck_elastic.simulate import NodeEvent, OobleckElastic, replay
from oobleck_elastic.simulate.paper import load_inputs, run_paper, with_shadows
from oobleck_elastic.simulate.shadows import (
    SHADOW_STEP_OVERHEAD,
    loss_outcome,
    segment_plan,
    shadow_placement,
)

ROOT = Path(__file__).resolve().parents[2]
NODES = ["a", "b", "c", "d"]  # pipelines [a, b] and [c, d]: a and c hold the first half, b and d the second


def tput(n: int) -> float:
    return 5.0 * n  # batch 100: a step takes 5 s on 4 nodes


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
        shadow_overhead=0.0,
    )
    return OobleckElastic("oobleck_elastic", tput, 100, **(base | kw))


def trace(*removed: str, at: float = 38.0) -> list[NodeEvent]:
    return [NodeEvent(0.0, "add", n) for n in NODES] + [NodeEvent(at, "remove", n) for n in removed]


def test_two_losses_of_both_copies_restore_the_checkpoint_without_shadows_and_not_with_one() -> None:
    # 5 s steps from 0.1: four by 20.1, checkpoint to 22.1, three more by 37.1; at 38 a and c go
    without = replay(elastic(shadow_copies=0), trace("a", "c"), end_s=100.0)
    assert without.counts == {"restores": 1}
    assert without.breakdown["restart"] == pytest.approx(0.5 + 40.0)
    assert without.breakdown["lost"] == pytest.approx(3 * 5.0 + 0.9)  # three steps and the one in flight
    shadowed = replay(elastic(shadow_copies=1), trace("a", "c"), end_s=100.0)
    assert {k: v for k, v in shadowed.counts.items() if k != "host_shadow_bytes_per_node"} == {
        "shadow_recoveries": 1,
        "steps_not_redone": 3,
    }
    assert shadowed.breakdown["restart"] == 0
    assert shadowed.breakdown["lost"] == pytest.approx(0.9)  # only the step in flight
    # a re-plan like any loss: start 0.1 s, then detection 0.5 + re-plan 0.1 + a and c's halves of a replica,
    # 2 x 4e9 / 2 over 1e9 B/s
    assert shadowed.breakdown["reconfiguration"] == pytest.approx(0.1 + 0.5 + 0.1 + 4.0)
    assert shadowed.samples > without.samples


def test_one_shadow_does_not_survive_losing_both_holders_and_the_keeper() -> None:
    plan, shares = segment_plan(NODES, [2, 2])
    placement = shadow_placement(plan, shares, 1)
    assert placement is not None
    keeper = placement.layers[0][0]  # of the first half (held by a and c)
    other = ({"b", "d"} - {keeper}).pop()
    assert loss_outcome(NODES, [2, 2], ["a", "c", keeper], 1) == "restore"
    assert loss_outcome(NODES, [2, 2], ["a", "c", other], 1) == "shadow"
    tl = replay(elastic(shadow_copies=1), trace("a", "c", keeper), end_s=100.0)
    assert tl.counts["restores"] == 1 and "shadow_recoveries" not in tl.counts
    assert tl.breakdown["restart"] == pytest.approx(40.5)
    tl = replay(elastic(shadow_copies=1), trace("a", "c", other), end_s=100.0)
    assert tl.counts["shadow_recoveries"] == 1 and "restores" not in tl.counts


@pytest.mark.parametrize("copies, survived", [(0, 1), (1, 2), (2, 3)])
def test_s_shadows_survive_every_loss_of_one_plus_s_nodes_and_not_every_larger_one(copies: int, survived: int) -> None:
    # two 2-node pipelines: 2 device copies of every layer, so f + s = 1 + s losses are always survived
    def restores(k: int) -> list[tuple[str, ...]]:
        return [
            loss for loss in itertools.combinations(NODES, k) if loss_outcome(NODES, [2, 2], loss, copies) == "restore"
        ]

    for k in range(1, survived + 1):
        assert restores(k) == [], k
    assert restores(survived + 1) != []


@pytest.mark.parametrize(
    "n, sizes",
    [(4, [2, 2]), (5, [2, 3]), (7, [3, 4]), (6, [2, 2, 2]), (9, [4, 5])],
)
@pytest.mark.parametrize("layers", [0, 5])
def test_the_segment_plan_loses_a_layer_exactly_when_the_simulator_does(n: int, sizes: list[int], layers: int) -> None:
    nodes = [f"n{i}" for i in range(n)]
    model = elastic(pipelines=lambda _: sizes)
    model.configured = nodes
    plan, shares = segment_plan(nodes, sizes, layers)
    assert sum(shares) == 1
    for k in range(1, 5):
        for loss in itertools.combinations(nodes, k):
            assert survives(plan, None, loss) == (not model.layers_lost(list(loss))), loss


def test_the_shadows_overhead_is_charged_on_every_step_and_their_host_memory_reported() -> None:
    events = [NodeEvent(0.0, "add", n) for n in NODES]
    runs = {
        s: replay(elastic(shadow_copies=s, shadow_overhead=0.25, checkpoint_every=None), events, end_s=60.0)
        for s in (0, 1, 2)
    }
    # steps of 5, 6.25 and 7.5 s from 0.1 s
    assert [runs[s].samples for s in (0, 1, 2)] == [1100, 900, 700]
    assert [runs[s].rate for s in (0, 1, 2)] == pytest.approx([20.0, 16.0, 20.0 / 1.5])
    for s, share in ((0, 0.0), (1, 0.2), (2, 1 / 3)):
        b = runs[s].breakdown
        assert b["redundant"] / (b["useful"] + b["redundant"]) == pytest.approx(share), s
    assert "host_shadow_bytes_per_node" not in runs[0].counts
    # the halves of a 4e9-byte replica: each node keeps at most one half
    assert runs[1].counts["host_shadow_bytes_per_node"] == 2e9
    tl = replay(elastic(shadow_copies=1, num_layers=4), events, end_s=10.0)
    assert tl.counts["host_shadow_bytes_per_node"] == 1e9  # one layer of four on each node
    assert OobleckElastic("x", tput, 100, shadow_copies=1).rate(4) == pytest.approx(20.0 / (1 + SHADOW_STEP_OVERHEAD))


def test_of_the_papers_runs_one_restores_its_checkpoint_and_one_shadow_copy_avoids_it() -> None:
    runs = run_paper(load_inputs(), systems=with_shadows([], [1]))
    assert len(runs) == 5 * 8 * 2
    restored = {(r.model, r.trace, r.system): r.row()["restores"] for r in runs if r.row()["restores"]}
    assert restored == {("GPT-3-6.7B", "scale_p3-trace", "oobleck_elastic"): 1}


def test_shadows_avoid_the_paper_traces_one_restore() -> None:
    # GPT-3-6.7B on the p3 spot trace: three pipelines of 10 nodes lose one share's every copy at once
    runs = run_paper(
        load_inputs(),
        models=["GPT-3-6.7B"],
        traces=["scale_p3-trace"],
        systems=with_shadows(["oobleck"], [1, 2]),
    )
    rows = {r.system: r.row() for r in runs}
    assert list(rows) == ["oobleck", "oobleck_elastic", "oobleck_elastic:s=1", "oobleck_elastic:s=2"]
    assert rows["oobleck_elastic"]["restores"] == 1 and rows["oobleck_elastic"]["shadow_recoveries"] == 0
    for name in ("oobleck_elastic:s=1", "oobleck_elastic:s=2"):
        assert rows[name]["restores"] == 0 and rows[name]["shadow_recoveries"] == 1
        assert rows[name]["steps_not_redone"] > 0
        assert rows[name]["samples_per_s"] > rows["oobleck_elastic"]["samples_per_s"]


def simulate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "oobleck_elastic.cli", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_cli_reports_what_shadows_buy(tmp_path: Path) -> None:
    # GPT-3-6.7B plans two 8-node pipelines on 16 nodes: node1 and node9 hold the same first eighth
    lines = [f"0,add,node{i}" for i in range(1, 17)] + ["3600000,remove,node1", "3600000,remove,node9"]
    path = tmp_path / "pair.csv"
    path.write_text("\n".join(lines) + "\n")
    common = ["--trace", str(path), "--model", "GPT-3-6.7B", "--systems", "oobleck_elastic", "--hours", "2"]
    res = simulate(*common, "--shadow-copies", "1", "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["system"]: r for r in map(json.loads, res.stdout.splitlines())}
    assert set(rows) == {"oobleck_elastic", "oobleck_elastic:s=1"}
    assert (rows["oobleck_elastic"]["restores"], rows["oobleck_elastic:s=1"]["restores"]) == (1, 0)
    assert rows["oobleck_elastic:s=1"]["shadow_recoveries"] == 1
    assert rows["oobleck_elastic:s=1"]["breakdown_s"]["redundant"] > 0
    assert rows["oobleck_elastic"]["breakdown_s"]["redundant"] == 0
    res = simulate(*common, "--shadow-copies", "1", "--shadow-overhead", "0")
    assert res.returncode == 0, res.stderr
    assert "each slows every step by 0.0% (--shadow-overhead)" in res.stdout
    table = res.stdout.split("host memory reported, not charged:\n")[1].splitlines()
    assert table[0].split()[:4] == ["run", "shadows", "samples/s", "vs"]
    assert [line.split()[2:3] + line.split()[5:7] for line in table[1:]] == [["0", "1", "0"], ["1", "0", "1"]]
    bad = simulate(*common, "--shadow-copies", "one")
    assert bad.returncode == 2
    assert "'one' is not a count of shadow copies >= 0 (or several: 1,2)" in bad.stderr
    bad = simulate(*common, "--shadow-copies", "1", "--shadow-overhead", "-0.1")
    assert bad.returncode == 2
    assert bad.stderr.strip().endswith(
        "shadow copies must be >= 0 and their step overhead (--shadow-overhead) a fraction >= 0 (got 1 and -0.1)"
    )


def test_the_scale_study_runs_each_shadow_count_beside_none() -> None:
    from oobleck_elastic.simulate.scale import ScaleSettings, run_scale

    settings = ScaleSettings(nodes=128, hours=6.0, node_mtbf_h=200.0, seed=2, shadow_copies=[1], shadow_overhead=0.05)
    result = run_scale(settings)
    rows = {r["system"]: r for r in result.rows()}
    assert list(rows) == ["oobleck_elastic", "oobleck_elastic:s=1", "checkpoint_restart"] and result.failures > 0
    base, shadowed = rows["oobleck_elastic"], rows["oobleck_elastic:s=1"]
    # independent failures never take all of a layer's 18 device copies at once: nothing to avoid, only the cost
    assert base["restores"] == shadowed["restores"] == shadowed["shadow_recoveries"] == 0
    assert shadowed["breakdown_s"]["redundant"] > 0 and base["breakdown_s"]["redundant"] == 0
    assert shadowed["samples_per_s"] < base["samples_per_s"]
    assert shadowed["host_shadow_gb_per_node"] > 0
