"""Stragglers (engine/resilience/straggler.py, planning/plan/rebalance.py): naming on made-up times, the re-split of
the batch, the compute clock, and a job with one slowed node."""

from __future__ import annotations

import dataclasses
import random
import re
import time
from pathlib import Path

import pytest
import torch

from oobleck_elastic.config import load_config
from oobleck_elastic.engine.resilience.faults import FaultInjector
from oobleck_elastic.engine.resilience.straggler import ComputeClock, StragglerWatch, slowdowns
from oobleck_elastic.planning import Plan
from oobleck_elastic.planning.plan.rebalance import mitigate, rebalance, rebalanced_plan, step_estimate
from oobleck_elastic.rendezvous.decide import LeaderAction, Clocks, LeaderView, Rules, decide, plan_events
from oobleck_elastic.etcd import EtcdSettings, connect
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.rendezvous.membership import read_events
from oobleck_elastic.records.control import NodeState, StragglerRecord
from oobleck_elastic.records.job import EventKind
from helpers import ROOT, assert_same, layout_plan, run_job, tensorboard_run, tiny_profile


def _plan(microbatches=(4, 4, 4, 4)) -> Plan:
    """Four one-stage pipelines (ranks 0-3 on nodes n0-n3), each stage estimated at 0.1 s per microbatch."""
    plan = layout_plan([[(0, 6)]] * 4, list(microbatches), generation=3)
    return dataclasses.replace(
        plan,
        pipelines=tuple(
            dataclasses.replace(p, stages=tuple(dataclasses.replace(s, compute_s=0.1) for s in p.stages))
            for p in plan.pipelines
        ),
    )


def test_slowdowns_are_relative_to_the_stage_s_peers_or_its_estimate() -> None:
    plan = _plan()
    # the profile's scale does not matter: every worker twice its estimate is no slowdown
    assert slowdowns(plan, [0.8, 0.8, 0.8, 0.8]) == {r: (1.0, 0.2, 0.2) for r in range(4)}
    got = slowdowns(plan, [0.8, 2.4, 0.8, 0.8])
    assert got[1] == pytest.approx((3.0, 0.6, 0.2)) and got[0] == pytest.approx((1.0, 0.2, 0.2))
    # peers run the same layers: a stage whose estimate is off (here the last one, 3x its estimate
    # on every pipeline) is compared with its peers, not with the estimate
    two = _two_stage_plan()
    got = slowdowns(two, [0.4, 1.2, 0.4, 1.2])
    assert {r: round(v[0], 6) for r, v in got.items()} == {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}
    got = slowdowns(two, [0.4, 3.6, 0.4, 1.2])
    assert got[1][0] == pytest.approx(3.0) and got[3][0] == pytest.approx(1.0)


def _two_stage_plan() -> Plan:
    plan = layout_plan([[(0, 3), (3, 6)], [(0, 3), (3, 6)]], [4, 4], generation=1)
    return dataclasses.replace(
        plan,
        pipelines=tuple(
            dataclasses.replace(p, stages=tuple(dataclasses.replace(s, compute_s=0.1) for s in p.stages))
            for p in plan.pipelines
        ),
    )


def _observe(watch: StragglerWatch, plan: Plan, busy: list[float], times: int) -> list:
    return [watch.observe(plan, busy) for _ in range(times)]


def test_a_node_is_named_after_the_window_and_cleared_the_same_way() -> None:
    plan, watch = _plan(), StragglerWatch(factor=1.5, steps=3)
    slow = [0.4, 1.2, 0.4, 0.4]
    verdicts = _observe(watch, plan, slow, 4)  # the generation's first step is left out
    assert [v.named for v in verdicts] == [{}, {}, {}, {"n1": 3.0}]
    assert verdicts[-1].changed and verdicts[-1].report
    assert verdicts[-1].pipeline_s == pytest.approx((0.1, 0.3, 0.1, 0.1))
    again = watch.observe(plan, slow)
    assert again.named == {"n1": 3.0} and not again.changed and not again.report
    # the window's fastest step counts: one step at full speed shows the node is not slow any more
    cleared = watch.observe(plan, [0.4] * 4)
    assert cleared.named == {} and cleared.changed and cleared.report
    # a new generation (the re-split) starts a new window, and its first full one reports again
    re_split = dataclasses.replace(_plan((5, 1, 5, 5)), generation=4)
    seen = _observe(watch, re_split, [0.5, 0.3, 0.5, 0.5], 4)
    assert [v.named for v in seen] == [{}, {}, {}, {"n1": 3.0}] and seen[-1].report


def test_noise_and_tiny_stages_are_no_stragglers() -> None:
    watch = StragglerWatch(factor=1.5, steps=5)
    # contention only adds time: every worker slowed in four steps of five is still no straggler
    noisy = [
        [0.4, 0.4, 0.4, 0.4],
        [0.9, 0.4, 1.2, 1.2],
        [1.5, 0.9, 0.4, 1.3],
        [1.4, 1.9, 1.2, 0.4],
        [0.4, 1.4, 1.9, 0.9],
        [0.9, 0.4, 1.4, 1.8],
        [1.4, 1.9, 0.4, 1.4],
    ]
    assert all(not watch.observe(_plan(), busy).named for busy in noisy)
    # one pipeline cut [0, 1) + [1, 6), the other [0, 6): the 1-layer stage has no peer, and its
    # estimate (1 ms) is far off (5 ms of fixed overheads): 5x, but too small to matter
    plan = layout_plan([[(0, 1), (1, 6)], [(0, 6)]], [4, 4], generation=1)
    plan = dataclasses.replace(
        plan,
        pipelines=(
            dataclasses.replace(
                plan.pipelines[0],
                stages=(
                    dataclasses.replace(plan.pipelines[0].stages[0], compute_s=0.001),
                    dataclasses.replace(plan.pipelines[0].stages[1], compute_s=0.1),
                ),
            ),
            dataclasses.replace(
                plan.pipelines[1], stages=(dataclasses.replace(plan.pipelines[1].stages[0], compute_s=0.101),)
            ),
        ),
    )
    watch = StragglerWatch(factor=1.5, steps=2)
    assert all(not watch.observe(plan, [0.02, 0.4, 0.404]).named for _ in range(4))
    assert StragglerWatch(factor=0, steps=2).observe(plan, [1, 9, 1]).named == {}


def _noisy_times(seed: int, steps: int, workers: int, base: list[float], slow: dict[int, float]) -> list[list[float]]:
    """Compute times of a shared machine, by step then rank: `base[r]` times `slow.get(r, 1)`, and
    contention on top, which only adds time: in half the steps each worker is slowed 1.0-1.8x
    on its own; every 40 steps one worker is slowed 1.5-1.8x more, alone, for 6 steps (another job
    on its core), and 20 steps later every worker is, for 8 steps, but one keeps its speed in one
    of them (the whole machine busy). No worker is slowed alone for a whole window: that is what
    a straggler is."""
    rng = random.Random(seed)
    factor = [[1.0] * workers for _ in range(steps)]
    for t in range(steps):
        for r in range(workers):
            if rng.random() < 0.5:
                factor[t][r] *= rng.uniform(1.0, 1.8)
    for start in range(0, steps - 28, 40):
        lone = rng.randrange(workers)
        for t in range(start, start + 6):
            factor[t][lone] *= rng.uniform(1.5, 1.8)
        lucky, clean = rng.randrange(workers), rng.randrange(start + 20, start + 28)
        for t in range(start + 20, start + 28):
            for r in range(workers):
                if not (r == lucky and t == clean):
                    factor[t][r] *= rng.uniform(1.5, 1.8)
    return [[base[r] * slow.get(r, 1.0) * factor[t][r] for r in range(workers)] for t in range(steps)]


@pytest.mark.parametrize("plan", ["four one-stage pipelines", "two two-stage pipelines"])
def test_a_noisy_shared_machine_names_nobody_and_a_3x_worker_is_named_within_the_window(plan) -> None:
    """200 steps of the noise of `_noisy_times` on healthy workers name nobody (20 seeds), at the
    default factor and window; the same noise with one worker 3x slower names its node once the
    window is full (the window plus the generation's first step, left out), or up to 6 steps later."""
    defaults = load_config(ROOT / "configs/gpt2-tiny.yaml").fault_tolerance
    factor, window = defaults.straggler_factor, defaults.straggler_steps
    layout = _plan() if plan.startswith("four") else _two_stage_plan()
    base = [0.4] * 4 if plan.startswith("four") else [0.4, 0.3, 0.4, 0.3]
    for seed in range(20):
        watch = StragglerWatch(factor, window)
        named = [watch.observe(layout, busy).named for busy in _noisy_times(seed, 200, 4, base, {})]
        assert not any(named), (seed, next(n for n in named if n))
        watch = StragglerWatch(factor, window)
        named = [watch.observe(layout, busy).named for busy in _noisy_times(seed, 40, 4, base, {1: 3.0})]
        first = next(i for i, n in enumerate(named) if n)
        # once the window is full; later only while a peer of its stage was slowed alone too (the
        # 6 steps of `_noisy_times`' lone stretch: the two look alike in those steps)
        assert window <= first <= window + 6, (seed, named)
        # 3x slower with its peers slowed up to 1.8x: at least 3 / 1.8 in every step
        assert set(named[first]) == {"n1"} and named[first]["n1"] >= 3 / 1.8, (seed, named[first])


def test_rebalance_gives_the_slow_pipeline_fewer_microbatches() -> None:
    assert rebalance([1, 1, 1, 1], [0.1, 0.3, 0.1, 0.1], 16) == (5, 1, 5, 5)
    assert step_estimate([1, 1, 1, 1], [0.1, 0.3, 0.1, 0.1], (4, 4, 4, 4)) == pytest.approx(1.2)
    assert step_estimate([1, 1, 1, 1], [0.1, 0.3, 0.1, 0.1], (5, 1, 5, 5)) == pytest.approx(0.5)
    # two-stage pipelines pay the fill: (b + 1) x w
    assert rebalance([2, 2], [0.1, 0.2], 8) == (6, 2)  # 0.7 s and 0.6 s; (5, 3) would take 0.8 s
    with pytest.raises(ValueError, match="3 microbatches cannot give 4 pipelines one each"):
        rebalance([1] * 4, [0.1] * 4, 3)


def test_rebalanced_plan_keeps_nodes_stages_and_the_global_batch() -> None:
    plan = _plan()
    new = rebalanced_plan(plan, [0.1, 0.3, 0.1, 0.1])
    assert new is not None and new.rebalanced and new.generation == 4
    assert [p.microbatches for p in new.pipelines] == [5, 1, 5, 5]
    assert new.nodes == plan.nodes and [p.stages for p in new.pipelines] == [p.stages for p in plan.pipelines]
    # the plan's estimates stay in the profile's units: each pipeline's scaled by its microbatches
    assert new.num_microbatches == plan.num_microbatches and new.est_step_time_s == pytest.approx(1.25)
    assert [p.est_time_s for p in new.pipelines] == pytest.approx([1.25, 0.25, 1.25, 1.25])
    assert Plan.from_json(new.to_json()) == new and "rebalanced" not in plan.to_json()
    # no gain worth a re-plan, or speeds that do not fit the plan: nothing
    assert rebalanced_plan(plan, [0.1, 0.105, 0.1, 0.1]) is None
    assert rebalanced_plan(new, [0.1, 0.3, 0.1, 0.1]) is None
    assert rebalanced_plan(plan, [0.1, 0.3]) is None
    # a pipeline whose schedule runs microbatches in rounds (zero-bubble, interleaved) is never re-split:
    # its new count could be one the schedule cannot run
    for schedule in ("zero-bubble", "interleaved-1f1b"):
        ran = dataclasses.replace(
            plan, pipelines=(dataclasses.replace(plan.pipelines[0], schedule=schedule),) + plan.pipelines[1:]
        )
        assert rebalanced_plan(ran, [0.1, 0.3, 0.1, 0.1]) is None


ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # CPU workers measure their compute with one intra-op thread each


def _spin(cpu_seconds: float) -> float:
    t0 = time.thread_time()
    while time.thread_time() - t0 < cpu_seconds:
        pass
    return cpu_seconds


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_leader_re_splits_when_the_plan_is_otherwise_current() -> None:
    plan = _plan()
    rules = Rules(min_nodes=4, max_nodes=4, last_call_s=1, settle_s=0.5, rebalance=True)
    view = LeaderView(up=plan.nodes, plan=plan, speeds=(0.1, 0.3, 0.1, 0.1))
    got = decide(view, Clocks(), 10.0, rules)
    assert got.action == LeaderAction.REBALANCE and got.plan == rebalanced_plan(plan, view.speeds)
    events = plan_events(got.plan, plan, {n: NodeState.UP for n in plan.nodes}, {}, leader="n0", now=1.0)
    assert [e.detail for e in events] == ["4 node(s), 4 pipeline(s), 4 worker(s) (rebalance)"]
    # off, no gain, or a membership change pending (which re-plans anyway): no re-split
    assert decide(view, Clocks(), 10.0, dataclasses.replace(rules, rebalance=False)).action == LeaderAction.NONE
    assert decide(dataclasses.replace(view, speeds=(0.1,) * 4), Clocks(), 10.0, rules).action == LeaderAction.NONE
    assert decide(dataclasses.replace(view, up=plan.nodes[:3]), Clocks(), 10.0, rules).action == LeaderAction.WAIT


def _without_n1(est_step_time_s: float) -> Plan:
    """The planner's plan for n0, n2, n3 (made up): 16 microbatches as 6/5/5, estimated at 1.5x the
    step of the four-pipeline plan (whose pipelines the profile estimates at 1 s each)."""
    plan = layout_plan([[(0, 6)]] * 3, [6, 5, 5], generation=4)
    return dataclasses.replace(plan, nodes=("n0", "n2", "n3"), est_step_time_s=est_step_time_s)


def test_mitigate_re_splits_or_leaves_the_straggler_out_whichever_is_faster() -> None:
    plan = _plan()
    # 3x slower: re-split 5/1/5/5 takes 0.5 s; without node n1, 6 microbatches at the healthy
    # pipelines' measured/estimated ratio (0.4 s / 1 s) x 1.5 = 0.6 s: the re-split wins
    remedy = mitigate(plan, [0.1, 0.3, 0.1, 0.1], ["n1"], _without_n1(1.5))
    assert remedy is not None and remedy.plan is not None and remedy.leave_out == ()
    assert (remedy.now_s, remedy.split_s, remedy.without_s) == pytest.approx((1.2, 0.5, 0.6))
    assert [p.microbatches for p in remedy.plan.pipelines] == [5, 1, 5, 5]
    # 10x slower: even one microbatch takes it 1 s; without it 0.6 s
    remedy = mitigate(plan, [0.1, 1.0, 0.1, 0.1], ["n1"], _without_n1(1.5))
    assert remedy is not None and remedy.plan is None and remedy.leave_out == ("n1",)
    assert remedy.describe() == "the step now 4.0000 s, re-split 1.0000 s, without the straggler(s) 0.6000 s"
    # no plan without it (too few nodes): the re-split; no gain anywhere: nothing
    assert mitigate(plan, [0.1, 1.0, 0.1, 0.1], ["n1"], None).plan is not None
    assert mitigate(plan, [0.1, 0.105, 0.1, 0.1], ["n1"], _without_n1(1.5)) is None
    rules = Rules(min_nodes=3, max_nodes=4, last_call_s=1, settle_s=0.5, rebalance=True)
    view = LeaderView(up=plan.nodes, plan=plan, speeds=(0.1, 1.0, 0.1, 0.1), slow=("n1",), without=_without_n1(1.5))
    got = decide(view, Clocks(), 10.0, rules)
    assert got.action == LeaderAction.REPLAN and got.nodes == ("n0", "n2", "n3") and got.leave_out == ("n1",)
    # once left out, the leader counts it as not ready: the plan without it is current
    after = LeaderView(up=plan.nodes, plan=_without_n1(1.5), not_ready=frozenset({"n1"}))
    assert decide(after, Clocks(), 11.0, rules).action == LeaderAction.NONE


def test_the_report_reaches_the_leader_and_oobleck_status(etcd_settings, run_id) -> None:
    from oobleck_elastic import cluster_ops
    from oobleck_elastic.rendezvous.stragglers import LeaderStragglers
    from oobleck_elastic.rendezvous.worker import WorkerContext

    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    plan = _plan()
    try:
        ctx = WorkerContext(client=client, keys=keys, node_id="n0", local_rank=0)
        ctx.report_stragglers(generation=3, step=6, nodes={"n1": 3.04}, pipeline_s=(0.1, 0.3, 0.1, 0.1))
        assert "stragglers (generation 3, after step 6): n1 3.0x slower" in cluster_ops.status(client, keys)
        made: list[list[str]] = []
        leader = LeaderStragglers(lambda nodes, g, old: made.append(nodes) or _without_n1(1.5), enabled=True)
        fields = leader.view_fields(client, keys, plan)
        assert fields == {"speeds": (0.1, 0.3, 0.1, 0.1), "slow": ("n1",), "without": _without_n1(1.5)}
        assert leader.view_fields(client, keys, plan) == fields and made == [["n0", "n2", "n3"]]  # once a report
        # a report about another generation, or none named, or the remedy off: nothing to see
        assert leader.view_fields(client, keys, dataclasses.replace(plan, generation=4)) == {}
        assert LeaderStragglers(lambda *a: plan, enabled=False).view_fields(client, keys, plan) == {}
        ctx.report_stragglers(generation=3, step=9, nodes={}, pipeline_s=(0.1, 0.1, 0.1, 0.1))
        assert leader.view_fields(client, keys, plan) == {}
        assert not any(line.startswith("stragglers") for line in cluster_ops.status(client, keys))
    finally:
        client.close()


def test_compute_clock_counts_cpu_time_and_stretches_calls(one_thread) -> None:
    clock = ComputeClock(torch.device("cpu"))
    assert clock.timed(_spin)(0.05) == 0.05 and 0.05 <= clock.take() < 0.5 and clock.take() == 0.0
    clock.timed(time.sleep)(0.05)  # waiting is no compute (more workers than cores)
    assert clock.take() < 0.01
    # with more threads a worker's time says little about its device: it reports none, and a
    # generation where any worker reports none names nobody
    torch.set_num_threads(2)
    unmeasured = ComputeClock(torch.device("cpu"))
    unmeasured.timed(_spin)(0.01)
    assert not unmeasured.measures and unmeasured.take() == 0.0
    watch = StragglerWatch(factor=1.5, steps=2)
    assert all(not watch.observe(_plan(), [0.4, 1.2, 0.4, 0.0]).named for _ in range(5))
    torch.set_num_threads(1)
    slowed = ComputeClock(torch.device("cpu"), slowdown=lambda: 3.0)
    t0 = time.perf_counter()
    slowed.timed(_spin)(0.05)
    assert time.perf_counter() - t0 >= 0.15 and 0.15 <= slowed.take() < 1.0


def test_settings_fault_specs_and_records() -> None:
    with pytest.raises(
        ValueError,
        match=r"'fault_tolerance.straggler_factor' must be 0 \(off\) or > 1 and "
        r"'fault_tolerance.straggler_steps' >= 1 \(got 1.0 and 10\)",
    ):
        load_config(ROOT / "configs/gpt2-tiny.yaml", ["fault_tolerance.straggler_factor=1"])
    with pytest.raises(
        ValueError,
        match=r"^OOBLECK_STRAGGLE_AT='node1:3': each item must be NODE@STEP:FACTOR with "
        r"FACTOR >= 1, e.g. node1@0:3$",
    ):
        FaultInjector.from_env({"OOBLECK_STRAGGLE_AT": "node1:3"})
    faults = FaultInjector.from_env({"OOBLECK_STRAGGLE_AT": "node1@4:3"})
    assert [faults.slowdown(node="node1", step=s) for s in (3, 4, 9)] == [1.0, 3.0, 3.0]
    assert faults.slowdown(node="node0", step=9) == 1.0
    rec = StragglerRecord(generation=2, step=7, time=1.0, nodes={"node1": 3.1}, pipeline_s=(0.1, 0.3))
    assert StragglerRecord.parse(rec.to_json()) == rec
    with pytest.raises(ValueError, match="not a stragglers record"):
        StragglerRecord.parse({"schema_version": 1, "generation": 2})


@pytest.mark.slow
def test_a_slow_node_is_named_and_the_batch_re_split_around_it(tmp_path: Path, etcd_server, run_id) -> None:
    """Four one-stage pipelines; node1 computes 3x slower from the start. Its peers name it once
    the window (10 steps) is full, or a few steps later on a noisy machine; the leader re-splits
    the 32 microbatches (node1's pipeline gets about a third of the others'; without node1 the
    step would take 11 microbatch times against about 10), and the job ends with the weights of
    one process (the global batch never changed)."""
    profile = tiny_profile(tmp_path / "profile.json")
    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4"],
        24,
        profile,
        extra=["planning.device_memory_gb=100", "training.global_batch_size=64"],
        env={"OOBLECK_STRAGGLE_AT": "node1@0:3", **ONE_THREAD},
    )
    named = re.search(r"gen 1 step (\d+) node \S+: step \d+: straggler\(s\) node1 \(([\d.]+)x\)", out)
    assert named is not None and int(named.group(1)) <= 17 and float(named.group(2)) >= 2, out[-3000:]
    assert "reconfiguration: generation 1 -> 2 (rebalance): 4 node(s), 4 pipeline(s)" in out, out[-3000:]
    assert "gen 2 step" in out and "communication failed" not in out and "abandoned" not in out, out[-3000:]
    assert_same(job, ref)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tensorboard_run(tmp_path / "job" / "runs")), size_guidance={"scalars": 0})
    ea.Reload()
    assert {e.value for e in ea.Scalars("straggler/count")} == {1.0}
    # injected 3x; measured on shared cores it compresses towards 2 (seen: 1.91 with a busy loop
    # beside the suite): every point stays above the naming threshold (straggler_factor 1.5),
    # and their median at 2 or more
    slowdowns = sorted(e.value for e in ea.Scalars("straggler/slowdown/node1"))
    assert slowdowns[0] > 1.5 and slowdowns[(len(slowdowns) - 1) // 2] >= 2, slowdowns


@pytest.mark.slow
def test_no_straggler_is_named_in_a_clean_run(tmp_path: Path, etcd_server, run_id) -> None:
    """Two two-stage pipelines (the last stages hold the head: their profile estimate is off, their
    peers are not), 200 steps with nothing slowed: no node named, no re-split."""
    profile = tiny_profile(tmp_path / "profile.json")
    out, _, _ = run_job(tmp_path, etcd_server, run_id, ["--nodes", "4"], 200, profile, reference=False, env=ONE_THREAD)
    assert "step 200/200" in out and "straggler(s)" not in out and "(rebalance)" not in out, out[-3000:]


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
@pytest.mark.slow
def test_a_very_slow_node_is_left_out_when_that_is_faster(tmp_path: Path, etcd_server, run_id) -> None:
    """node1 computes 10x slower: even one microbatch of eight keeps every step waiting for it, so
    the leader leaves it out (three pipelines, the same global batch: the reference weights); its
    workers wait outside the plan and exit 0 at the end."""
    profile = tiny_profile(tmp_path / "profile.json")
    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4"],
        20,
        profile,
        extra=["planning.device_memory_gb=100"],
        env={"OOBLECK_STRAGGLE_AT": "node1@0:10", **ONE_THREAD},
    )
    assert re.search(r"reconfiguration: generation 1 -> 2 \([^)]*-node1\): 3 node\(s\), 3 pipeline\(s\)", out), out[
        -3000:
    ]
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    try:
        left = [
            e
            for _, e in read_events(client, Keys("/oobleck", run_id))
            if e.kind == EventKind.STRAGGLER and e.detail.startswith("left out")
        ]
    finally:
        client.close()
    assert [(e.node, e.generation) for e in left] == [("node1", 2)], left
    assert left[0].detail.startswith(
        "left out of the plan: a straggler, and the step is faster without it (the step now "
    ), left[0].detail
    assert "0 killed on purpose, 0 preempted, 0 failed" in out
    assert_same(job, ref)
