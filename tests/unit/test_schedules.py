"""Pipeline schedules as action lists, and the one simulator that costs all of them: the orders
are torch's, 1F1B and GPipe agree with templates.py's formula where that formula is exact, the
published bubbles of interleaved 1F1B and ZB-H1 come out, memory is counted per device, and an
order that cannot run is refused with the actions that block it."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from oobleck_elastic.planning import LayerProfile, Links, ModelProfile
from oobleck_elastic.planning.templates.partition import StageCosts
from oobleck_elastic.planning.schedules.choice import PipelineSchedules
from oobleck_elastic.planning.schedules.cost import (
    ScheduleCost,
    chunk_ranges,
    schedule_cost,
    stage_times,
    template_cost,
)
from oobleck_elastic.planning.schedules.sim import StageTimes, simulate, simulate_reference
from oobleck_elastic.planning.schedules.schedules import ScheduleAction, Order, ScheduleError, schedule_order
from oobleck_elastic.planning.errors import PlanningError
from oobleck_elastic.planning.templates.templates import TemplateSet, make_template

LINKS = Links(intra_node_gb_s=150.0, inter_node_gb_s=12.5, latency_s=1e-5)


def profile(forward: list[float], backward: list[float], *, act: int = 1000, out: list[int] | None = None):
    return ModelProfile(
        layers=[
            LayerProfile(
                name=f"l{i}",
                forward_s=f,
                backward_s=b,
                param_bytes=100 * (i + 1),
                grad_bytes=100 * (i + 1),
                optimizer_bytes=200 * (i + 1),
                activation_bytes=act * (i + 1),
                output_bytes=(out or [0] * len(forward))[i],
            )
            for i, (f, b) in enumerate(zip(forward, backward))
        ]
    )


def template(prof: ModelProfile, ranges: list[tuple[int, int]], *, links: Links | None, per_node: int = 1):
    costs = StageCosts(prof, memory_limit_bytes=1e30, links=links, stages_per_node=per_node)
    return make_template(costs, ranges, num_nodes=len(ranges) // per_node, gpus_per_node=per_node)


def strings(order: Order) -> list[list[str]]:
    return [[str(a) for a in acts] for acts in order.devices]


# ---------------------------------------------------------------- the orders are torch's


def torch_order(cls_name: str, devices: int, microbatches: int, chunks: int) -> list[list[str]]:
    """torch's pipeline_order for a schedule class, built from stand-in stages (no process group),
    without the idle slots and the REDUCE_GRAD bookkeeping."""
    import torch
    from torch.distributed.pipelining import schedules

    stage_kw = {"group_size": devices, "group_rank": 0, "num_stages": devices * chunks}
    from oobleck_elastic.engine.stage.zero_bubble import OneChunkZeroBubble

    cls = OneChunkZeroBubble if cls_name == "OneChunkZeroBubble" else getattr(schedules, cls_name)
    if cls_name in ("Schedule1F1B", "ScheduleGPipe"):
        sched = cls(SimpleNamespace(**stage_kw), n_microbatches=microbatches)
    else:
        stages = [SimpleNamespace(stage_index=i, submod=torch.nn.Identity(), **stage_kw) for i in range(chunks)]
        sched = cls(stages, n_microbatches=microbatches)
    return [
        [str(a) for a in sched.pipeline_order[r] if a is not None and a.computation_type.value in "FBIW"]
        for r in range(devices)
    ]


@pytest.mark.parametrize(
    "name, cls_name, chunks",
    [
        ("interleaved-1f1b", "ScheduleInterleaved1F1B", 2),
        ("interleaved-1f1b", "ScheduleInterleaved1F1B", 3),
        ("zero-bubble", "ScheduleInterleavedZeroBubble", 1),
        ("zero-bubble", "ScheduleInterleavedZeroBubble", 2),
        ("zbv", "ScheduleZBVZeroBubble", 2),
    ],
)
def test_orders_are_the_ones_torch_builds(name: str, cls_name: str, chunks: int) -> None:
    compared = 0
    for p in range(1, 7):
        for m in range(1, 3 * p + 3):
            try:
                theirs = torch_order(cls_name, p, m, chunks)
            except ValueError:  # m does not divide into torch's rounds
                if chunks == 1:  # one chunk needs no rounds: the engine runs the order of one round
                    theirs = torch_order("OneChunkZeroBubble", p, m, chunks)
                    assert strings(schedule_order(name, p, m, chunks)) == theirs, (p, m)
                    continue
                with pytest.raises(ScheduleError, match="rounds of equal size"):  # ours refuses it too
                    schedule_order(name, p, m, chunks)
                continue
            assert strings(schedule_order(name, p, m, chunks)) == theirs, (p, m)
            compared += 1
    assert compared >= 50


def test_1f1b_and_gpipe_are_the_orders_torch_runs() -> None:
    for p in range(1, 7):
        for m in range(p, 3 * p + 2):  # torch's Schedule1F1B refuses m < p (the engine runs GPipe then)
            assert strings(schedule_order("gpipe", p, m)) == torch_order("ScheduleGPipe", p, m, 1)
            ours, theirs = strings(schedule_order("1f1b", p, m)), torch_order("Schedule1F1B", p, m, 1)
            # torch's pipeline_order numbers the last rank's forwards from 1 (1F1 .. 1Fm, no 1F0);
            # its runtime (_step_microbatches, which the engine runs) does not use it
            assert ours[:-1] == theirs[:-1]
            assert [a.rstrip("0123456789")[-1] for a in ours[-1]] == [a.rstrip("0123456789")[-1] for a in theirs[-1]]
            assert ours[-1] == [f"{p - 1}{k}{i}" for i in range(m) for k in "FB"]


def test_1f1b_warms_up_with_one_forward_per_stage_after_it() -> None:
    assert str(schedule_order("1f1b", 3, 5)) == (
        "0: 0F0 0F1 0F2 0B0 0F3 0B1 0F4 0B2 0B3 0B4\n"
        "1: 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1F4 1B3 1B4\n"
        "2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4"
    )
    order = schedule_order("zbv", 2, 3, 2)
    assert Order.parse(str(order), name="zbv") == order
    assert ScheduleAction.parse(" 12W3 ") == ScheduleAction(12, "W", 3)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ("pipedream", 2, 4),
            "unknown schedule 'pipedream': use one of 1f1b, gpipe, interleaved-1f1b, zero-bubble, zbv",
        ),
        (("zbv", 2, 4, 3), "schedule zbv runs exactly 2 chunks per device (got chunks=3)"),
        (("1f1b", 2, 4, 2), "schedule 1f1b runs one stage per device (got chunks=2): use interleaved-1f1b"),
        (
            ("interleaved-1f1b", 4, 9, 2),
            "interleaved schedules run microbatches in 2 rounds of equal size, and 9 microbatches on 4 devices "
            "do not divide into them: use a multiple of 2",
        ),
        (("gpipe", 0, 4), "a schedule needs >= 1 device, microbatch and chunk (got 0, 4, 1)"),
    ],
)
def test_a_schedule_that_cannot_be_built_says_what_to_change(args: tuple, message: str) -> None:
    with pytest.raises(ScheduleError) as err:
        schedule_order(*args)
    assert str(err.value) == message


# ---------------------------------------------------------------- 1F1B and GPipe against templates.py


def test_1f1b_and_gpipe_equal_the_template_formula_on_uniform_stages() -> None:
    prof = profile([1.0] * 8, [2.0] * 8)
    for p in (1, 2, 4, 8):
        t = template(prof, [(i * 8 // p, (i + 1) * 8 // p) for i in range(p)], links=None)
        for m in range(1, 17):
            for name in ("1f1b", "gpipe"):
                assert template_cost(prof, t, name, m).step_s == pytest.approx(t.iteration_time(m), rel=1e-12)
    for p in range(1, 9):  # any forward/backward split, stage times alike
        for m in range(1, 17):
            times = StageTimes.uniform(p, 0.7, 1.9)
            for name in ("1f1b", "gpipe"):
                assert simulate(schedule_order(name, p, m), times).makespan_s == pytest.approx((m + p - 1) * 2.6)


@pytest.mark.parametrize("seed", range(25))
def test_1f1b_equals_the_template_formula_when_the_last_stage_is_the_slowest(seed: int) -> None:
    """Non-uniform stages, communication counted: once the last stage (the head, usually) is the
    bottleneck it never waits after its first forward, so T = sum w + (m - 1) max w exactly."""
    rng = random.Random(seed)
    p = rng.randint(2, 6)
    per_node = rng.choice([1, 2]) if p % 2 == 0 else 1
    n = 2 * p
    fwd = [rng.uniform(0.1, 1.0) for _ in range(n)]
    bwd = [rng.uniform(0.1, 2.0) for _ in range(n)]
    fwd[-1] = bwd[-1] = 2.0 * n  # a heavy head on the last stage
    prof = profile(fwd, bwd, out=[int(rng.uniform(1e8, 5e9)) for _ in range(n)])
    t = template(prof, [(2 * i, 2 * i + 2) for i in range(p)], links=LINKS, per_node=per_node)
    assert t.stages[-1].time_s == t.bottleneck_s
    assert any(s.comm_s > 0 for s in t.stages)
    for m in range(1, 3 * p + 1):
        cost = template_cost(prof, t, "1f1b", m, replicas=3)
        assert cost.step_s == pytest.approx(t.iteration_time(m, replicas=3), rel=1e-12)
        # the exposed all-reduce too (planning/templates/overlap.py): the cool-down's chain is exact here
        assert cost.grad_sync_s == pytest.approx(t.grad_sync_s(3), rel=1e-9) and cost.grad_sync_s > 0


@pytest.mark.parametrize("seed", range(25))
def test_gpipe_is_two_flow_shops_and_the_template_formula_when_backward_tracks_forward(seed: int) -> None:
    rng = random.Random(seed)
    p, m = rng.randint(1, 6), rng.randint(1, 12)
    fwd = [rng.uniform(0.1, 3) for _ in range(p)]
    bwd = [rng.uniform(0.1, 5) for _ in range(p)]
    recv = [0.0] + [rng.uniform(0, 1) for _ in range(p - 1)]  # recv[s]: the message into stage s
    sim = simulate(schedule_order("gpipe", p, m), StageTimes(fwd, bwd, [0.0] * p), lambda b, s, d: recv[b + 1])
    f = [fwd[s] + recv[s] for s in range(p)]
    b = [bwd[s] + (recv[s + 1] if s < p - 1 else 0.0) for s in range(p)]
    assert sim.makespan_s == pytest.approx(sum(f) + (m - 1) * max(f) + sum(b) + (m - 1) * max(b), rel=1e-12)
    assert sim.comm_s == pytest.approx([m * (recv[s] + (recv[s + 1] if s < p - 1 else 0)) for s in range(p)])
    # backward = 2 x forward on every layer, no communication: templates.py's formula is exact
    prof = profile(fwd, [2 * x for x in fwd])
    t = template(prof, [(s, s + 1) for s in range(p)], links=None)
    assert template_cost(prof, t, "gpipe", m).step_s == pytest.approx(t.iteration_time(m), rel=1e-12)


def test_the_template_formula_is_an_estimate_for_1f1b_with_an_early_bottleneck() -> None:
    # Stage 0 slowest: its three warm-up forwards cover the round trip, it never waits, and the
    # step is m w_0 = 6.0; the formula adds the other stage once more: 6.3.
    sim = simulate(schedule_order("1f1b", 2, 2), StageTimes([1.0, 0.1], [2.0, 0.2], [0.0, 0.0]))
    assert sim.makespan_s == pytest.approx(6.0) and 3.3 + 1 * 3.0 == pytest.approx(6.3)
    # Two co-bottlenecks: stage 1 runs its third forward before the second backward, stage 0
    # waits for that backward (14 -> 15): 23, where the formula says 12 + 2 x 5 = 22.
    sim = simulate(schedule_order("1f1b", 3, 3), StageTimes([1.0, 4.0, 1.0], [4.0, 1.0, 1.0], [0.0] * 3))
    assert sim.makespan_s == pytest.approx(23.0)
    assert sim.spans[ScheduleAction(0, "B", 1)] == (15.0, 19.0)


# ---------------------------------------------------------------- the published bubbles


def test_interleaved_1f1b_bubble_is_the_published_one() -> None:
    """Narayanan et al.: v chunks per device shrink the bubble to (p-1)/v of a microbatch's time,
    a fraction (p - 1) / (v m + p - 1), with m a multiple of p."""
    for p in range(2, 7):
        for v in (2, 3, 4):
            for m in (p, 2 * p, 3 * p):
                sim = simulate(schedule_order("interleaved-1f1b", p, m, v), StageTimes.uniform(p * v, 1 / v, 2 / v))
                assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-9)
                assert sim.makespan_s == pytest.approx((m + (p - 1) / v) * 3)
                # the price: device d holds (v - 1) r + 2 (p - 1 - d) + 1 chunks' activations (r = p here)
                warm = [min((v - 1) * p + 2 * (p - 1 - d) + 1, v * m) for d in range(p)]
                assert sim.peak_in_flight == tuple(warm)


def test_zero_bubble_h1_leaves_a_third_of_the_1f1b_bubble_at_its_memory() -> None:
    """Qi et al. (ZB-H1), forward = input grad = weight grad: bubble (p-1)(F+I-W) = (p-1)F
    against 1F1B's (p-1)(F+I+W), with no device holding more microbatches than 1F1B's first."""
    for p in range(2, 9):
        for m in range(p, 3 * p + 1):
            if schedule_order_ok("zero-bubble", p, m):
                times = StageTimes.uniform(p, 1.0, 2.0, weight_share=0.5, activation_bytes=10)
                zb, base = (simulate(schedule_order(n, p, m), times) for n in ("zero-bubble", "1f1b"))
                assert zb.makespan_s == pytest.approx(3 * m + p - 1)
                assert zb.bubble_s == pytest.approx(base.bubble_s / 3)
                assert max(base.peak_in_flight) == p
                assert zb.peak_in_flight == (p,) * p  # a W keeps its microbatch: later stages hold p too
                assert max(zb.peak_activation_bytes) == 10 * p


def test_zbv_idles_only_while_the_first_microbatch_reaches_the_last_device() -> None:
    for p in range(2, 7):
        for m in range(2 * p - 1, 4 * p):
            times = StageTimes.uniform(2 * p, 0.5, 1.0, activation_bytes=5)  # 2 chunks: F = I = W = 0.5
            zbv = simulate(schedule_order("zbv", p, m, 2), times)
            assert zbv.makespan_s == pytest.approx((p - 1) * 0.5 + 3 * m)
            if schedule_order_ok("zero-bubble", p, m):
                zb = simulate(schedule_order("zero-bubble", p, m), StageTimes.uniform(p, 1.0, 2.0))
                assert zbv.bubble_s < zb.bubble_s
            assert zbv.peak_activation_bytes == (10 * p,) * p  # 2p half-size chunks: 1F1B's p microbatches


def schedule_order_ok(name: str, p: int, m: int, chunks: int = 1) -> bool:
    try:
        schedule_order(name, p, m, chunks)
    except ScheduleError:
        return False
    return True


# ---------------------------------------------------------------- memory


def test_1f1b_holds_p_minus_s_microbatches_and_gpipe_all_of_them() -> None:
    for p in range(1, 7):
        for m in range(1, 13):
            times = StageTimes.uniform(p, 1.0, 2.0, activation_bytes=7)
            one = simulate(schedule_order("1f1b", p, m), times)
            assert one.peak_in_flight == tuple(min(m, p - s) for s in range(p))
            assert one.peak_activation_bytes == tuple(7 * min(m, p - s) for s in range(p))
            assert simulate(schedule_order("gpipe", p, m), times).peak_in_flight == (m,) * p


def test_template_memory_is_the_template_count_under_1f1b_and_chunks_share_a_device() -> None:
    prof = profile([1.0] * 8, [2.0] * 8, act=1000)
    t = template(prof, [(0, 2), (2, 4), (4, 6), (6, 8)], links=None)
    cost = template_cost(prof, t, "1f1b", 8)
    assert cost.memory_bytes == tuple(s.memory_bytes for s in t.stages)
    assert cost.fits(max(cost.memory_bytes)) and not cost.fits(max(cost.memory_bytes) - 1)
    # 2 chunks on 4 devices: stage s holds layer s, stages s and s + 4 share device s
    assert chunk_ranges(prof, 8) == [(i, i + 1) for i in range(8)]
    inter = template_cost(prof, t, "interleaved-1f1b", 8, chunks=2)
    static = [sum(la.static_bytes for la in prof.layers[i::4]) for i in range(4)]
    assert [m - a for m, a in zip(inter.memory_bytes, inter.activation_bytes)] == static
    assert inter.bubble_fraction < cost.bubble_fraction


def test_a_cut_between_nodes_costs_the_inter_node_link() -> None:
    prof = profile([1.0] * 4, [2.0] * 4, out=[10**9] * 4)
    cost = schedule_cost(prof, [(0, 1), (1, 2), (2, 3), (3, 4)], "gpipe", 2, links=LINKS, stages_per_node=2)
    intra, inter = LINKS.p2p_s(1e9, same_node=True), LINKS.p2p_s(1e9, same_node=False)
    # device 1 receives its input over NVLink and its output's gradient from node 1, per microbatch
    assert cost.simulation.comm_s == pytest.approx((2 * intra, 2 * (intra + inter), 2 * (inter + intra), 2 * intra))


def test_the_pipeline_schedule_is_the_fastest_that_fits_in_memory() -> None:
    prof = profile([1.0] * 8, [2.0] * 8, act=1000)
    t = template(prof, [(0, 2), (2, 4), (4, 6), (6, 8)], links=None)
    tset = TemplateSet(templates={4: t}, gpus_per_node=1, num_layers=8, profile=prof)
    options = [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1), ("zbv", 2)]
    roomy = PipelineSchedules(prof, tset, 1e12, options)
    steps = {(name, c): got.step_s for name, c, got in roomy.table(4, 8, 1) if isinstance(got, ScheduleCost)}
    assert steps == pytest.approx(
        {
            ("1f1b", 1): 66.0,
            ("gpipe", 1): 66.0,
            ("interleaved-1f1b", 2): 57.0,
            ("zero-bubble", 1): 54.0,
            ("zbv", 2): 51.0,
        }
    )
    best = roomy.cost(4, 8, 1)
    assert (best.schedule, best.step_s) == ("zbv", 51.0)
    # at 1F1B's own peak only 1F1B fits (GPipe ties it on time but holds every microbatch)
    limit = template_cost(prof, t, "1f1b", 8).peak_memory_bytes
    tight = PipelineSchedules(prof, tset, limit, options)
    assert tight.cost(4, 8, 1).schedule == "1f1b"
    refused = {f"{name}/{c}": got for name, c, got in tight.table(4, 8, 1) if isinstance(got, str)}
    assert sorted(refused) == ["gpipe/1", "interleaved-1f1b/2", "zbv/2", "zero-bubble/1"]
    assert refused["zbv/2"] == f"needs {39600 / 2**30:.2f} GiB on a device, over the limit of {limit / 2**30:.2f} GiB"
    # 9 microbatches do not divide into the interleaved rounds on 4 devices; one chunk needs none
    odd = {f"{name}/{c}": got for name, c, got in roomy.table(4, 9, 1)}
    assert [k for k, got in odd.items() if isinstance(got, str)] == ["interleaved-1f1b/2"]
    assert "2 rounds of equal size" in str(odd["interleaved-1f1b/2"])
    assert roomy.cost(4, 9, 1).schedule == "zbv"
    with pytest.raises(PlanningError, match="no schedule of planning.schedule can run 8 microbatches on the 4-node"):
        PipelineSchedules(prof, tset, 1000, options).cost(4, 8, 1)


# ---------------------------------------------------------------- orders that cannot run

EVERY = "every stage needs F and B (or I and W) for every microbatch"


@pytest.mark.parametrize(
    "lines, message",
    [
        (
            ["0B0 0F0"],
            "order 'custom' cannot run, its dependencies are violated: device 0 at 0B0 (position 0) waits for "
            "0F0, which device 0 runs later (position 1)",
        ),
        (
            ["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"],
            "order 'custom' cannot run, its dependencies are violated: device 0 at 0B0 (position 1) waits for "
            "1B0, which device 1 runs later (position 3); device 1 at 1F1 (position 0) waits for 0F1, which "
            "device 0 runs later (position 2)",
        ),
        (["0F0 0F1 0B0"], "the order never runs 0B1 (or 0I1 and 0W1): " + EVERY),
        (["0F0 0I0"], "the order never runs 0W0: " + EVERY),
        (["0W0"], "the order never runs 0F0, 0I0: " + EVERY),
        (["0F0 0B0 0F0"], "0F0 is listed twice: device 0 position 0 and device 0 position 2"),
        (["0F0 0I0 0W0 0B0"], "stage 0 microbatch 0 has both a full backward 0B0 and a split one (I/W)"),
        (["0F0 1F0", "1B0 0B0"], "stage 1 has actions on device 0 and device 1 (1B0)"),
    ],
)
def test_an_order_that_cannot_run_is_refused_with_what_blocks_it(lines: list[str], message: str) -> None:
    order = Order.parse("\n".join(lines))
    times = StageTimes([1.0] * order.num_stages, [1.0] * order.num_stages, [0.5] * order.num_stages)
    with pytest.raises(ScheduleError) as err:
        simulate(order, times)
    assert str(err.value) == message


def test_a_split_backward_feeds_the_stage_before_at_its_input_gradient() -> None:
    # 1I0 ends at 1 + 1 + 1 = 3; 0B0 starts there, not after 1W0
    order = Order.parse("0F0 0B0\n1F0 1I0 1W0")
    sim = simulate(order, StageTimes([1.0, 1.0], [1.0, 1.0], [5.0, 5.0]))
    assert sim.spans[ScheduleAction(0, "B", 0)] == (3.0, 9.0)
    assert sim.makespan_s == 9.0 and sim.busy_s == (7.0, 7.0)
    # activations are kept until the weight gradient: 0F1 runs while 0W0 still needs microbatch 0
    held = simulate(Order.parse("0F0 0I0 0F1 0W0 0I1 0W1"), StageTimes([1.0], [1.0], [1.0], [3]))
    assert held.peak_in_flight == (2,) and held.peak_activation_bytes == (6,)


def test_stage_times_use_the_measured_split_and_the_whole_backward_for_b() -> None:
    """Measured input and weight gradients are a stage's I and W; a schedule with a full
    backward runs the measured backward_s (the split costs two passes it does not make)."""
    split = [(1.0, 2.5), (2.0, 2.0), (3.0, 1.5)]  # (I, W) of layers 0-2; layer 3 split by the share
    layers = [
        LayerProfile(f"l{i}", 1.0, 3.0, 0, 0, 0, 10, input_grad_s=x, weight_grad_s=w) for i, (x, w) in enumerate(split)
    ]
    prof = ModelProfile(layers=layers + [LayerProfile("l3", 1.0, 3.0, 0, 0, 0, 10)])
    times = stage_times(prof, [(0, 2), (2, 4)], weight_share=0.25)
    assert list(times.input_grad_s) == [1.0 + 2.0, 3.0 + 2.25]
    assert list(times.weight_grad_s) == [2.5 + 2.0, 1.5 + 0.75]
    assert list(times.backward_s or []) == [6.0, 6.0]
    one = schedule_cost(prof, [(0, 2), (2, 4)], "1f1b", 4, weight_share=0.25)
    assert one.simulation.busy_s == (4 * (2.0 + 6.0),) * 2  # F + measured B per microbatch
    zb = schedule_cost(prof, [(0, 2), (2, 4)], "zero-bubble", 4, weight_share=0.25)
    assert zb.simulation.busy_s == (4 * (2.0 + 3.0 + 4.5), 4 * (2.0 + 5.25 + 2.25))  # F + I + W
    assert zb.device_compute_s == (9.5, 9.5) and one.device_compute_s == (8.0, 8.0)
    # without any measured split: the share, and B = I + W as before
    plain = stage_times(profile([1.0] * 4, [3.0] * 4), [(0, 2), (2, 4)], weight_share=0.25)
    assert plain.backward_s is None and list(plain.input_grad_s) == [4.5, 4.5]


# ---------------------------------------------------------------- the fast simulation is the reference's


def random_order(rng: random.Random, devices: int, stages: int, m: int) -> Order:
    """A runnable order no schedule builds: stages placed on devices at random (every device
    one at least), each (stage, microbatch) backward whole or split at random, every device's
    actions in the order of one random topological walk of the whole step."""
    place = list(range(devices)) + [rng.randrange(devices) for _ in range(stages - devices)]
    rng.shuffle(place)
    split = {(s, k): rng.random() < 0.5 for s in range(stages) for k in range(m)}
    todo = {ScheduleAction(s, "F", k) for s in range(stages) for k in range(m)}
    todo |= {ScheduleAction(s, kind, k) for (s, k), cut in split.items() for kind in (("I", "W") if cut else ("B",))}
    done: set[ScheduleAction] = set()
    lists: list[list[ScheduleAction]] = [[] for _ in range(devices)]

    def ready(a: ScheduleAction) -> bool:
        s, kind, k = a
        if kind == "F":
            return s == 0 or ScheduleAction(s - 1, "F", k) in done
        if kind == "W":
            return ScheduleAction(s, "I", k) in done
        grad = ScheduleAction(s + 1, "I" if split.get((s + 1, k)) else "B", k)
        return ScheduleAction(s, "F", k) in done and (s == stages - 1 or grad in done)

    while todo:
        a = rng.choice(sorted(x for x in todo if ready(x)))
        todo.remove(a)
        done.add(a)
        lists[place[a.stage]].append(a)
    return Order(name="random", devices=tuple(map(tuple, lists)), num_stages=stages, microbatches=m)


def random_times(rng: random.Random, stages: int) -> StageTimes:
    def draw() -> float:  # some exact zeros: ties between a device's free time and an input
        return 0.0 if rng.random() < 0.1 else rng.uniform(0.01, 3.0)

    return StageTimes(
        forward_s=[draw() for _ in range(stages)],
        input_grad_s=[draw() for _ in range(stages)],
        weight_grad_s=[draw() for _ in range(stages)],
        activation_bytes=[rng.randrange(0, 10**9) for _ in range(stages)],
    )


def same_simulation(order: Order, times: StageTimes, comm, *, checked: bool) -> None:
    fast = simulate(order, times, comm, checked=checked)
    plain = simulate_reference(order, times, comm, checked=checked)
    assert fast.makespan_s == plain.makespan_s  # bit for bit, not approximately
    assert fast.busy_s == plain.busy_s and fast.comm_s == plain.comm_s
    assert fast.peak_in_flight == plain.peak_in_flight
    assert fast.peak_activation_bytes == plain.peak_activation_bytes
    assert fast.spans == plain.spans


@pytest.mark.parametrize("seed", range(40))
def test_the_fast_simulation_gives_the_reference_floats_bit_for_bit(seed: int) -> None:
    rng = random.Random(seed)
    links = [rng.uniform(0.0, 0.5) for _ in range(16)]

    def comm(boundary: int, src: int, dst: int) -> float:  # a link per (boundary, src, dst)
        return links[(boundary * 7 + src * 3 + dst) % 16]

    name = rng.choice(["1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "zbv"])
    devices, m = rng.randint(1, 6), rng.randint(1, 14)
    chunks = {"1f1b": 1, "gpipe": 1, "zbv": 2}.get(name, rng.randint(1, 4))
    if schedule_order_ok(name, devices, m, chunks):
        order = schedule_order(name, devices, m, chunks)
        for c in (comm, None):
            same_simulation(order, random_times(rng, order.num_stages), c, checked=True)
    devices = rng.randint(1, 4)
    order = random_order(rng, devices, rng.randint(devices, 7), rng.randint(1, 5))
    same_simulation(order, random_times(rng, order.num_stages), comm, checked=False)


def test_a_schedule_costs_what_the_reference_simulation_says() -> None:
    """schedule_cost's figures come from the fast simulation; on a template with links they are
    the reference's, and its spans (the order rebuilt on demand) too."""
    rng = random.Random(7)
    prof = profile([rng.uniform(0.1, 1) for _ in range(12)], [rng.uniform(0.1, 2) for _ in range(12)], out=[10**9] * 12)
    for name, chunks in (("1f1b", 1), ("zero-bubble", 2), ("interleaved-1f1b", 3), ("zbv", 2)):
        ranges = chunk_ranges(prof, 4 * chunks)
        cost = schedule_cost(prof, ranges, name, 8, chunks=chunks, links=LINKS, stages_per_node=2)
        times = StageTimes(
            [sum(la.forward_s for la in prof.layers[u:v]) for u, v in ranges],
            [sum(la.backward_s for la in prof.layers[u:v]) * 0.5 for u, v in ranges],
            [sum(la.backward_s for la in prof.layers[u:v]) * 0.5 for u, v in ranges],
            [sum(la.activation_bytes for la in prof.layers[u:v]) for u, v in ranges],
        )

        def comm(boundary: int, src: int, dst: int) -> float:
            return LINKS.p2p_s(10**9, same_node=src // 2 == dst // 2)

        plain = simulate_reference(schedule_order(name, 4, 8, chunks), times, comm)
        assert cost.makespan_s == plain.makespan_s and cost.simulation.busy_s == plain.busy_s
        assert cost.simulation.spans == plain.spans
