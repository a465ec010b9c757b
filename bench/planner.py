"""Planner benchmark: GPT-3-175B-like profile (96 blocks + embedding + head), 8 devices per node.

Prints one JSON line per figure:
  - templates for every node count, and instantiation on 1,024 nodes (goal: < 1 s together);
  - re-plan after one node loss, 1,024 -> 1,023 nodes, templates reused (goal: < 50 ms);
  - side by side on the same run: our knapsack instantiation against Oobleck's approach of
    enumerating every multiset of templates that covers N nodes (each then given its best batch
    split), at node counts where the enumeration still finishes; both must find the same makespan;
  - tensor parallelism: the estimated samples/s, step time and bubble fraction of the plan on
    1,024 nodes at tp = 1, 2, 4, 8 and for `auto` (communication counted with the default links),
    and how long `auto` takes to plan every degree (goal: < 2 s);
  - re-planning at scale, at tp = 1 and tp = 8, 128 to 10,000 nodes (global batch 1,536, 8,192
    from 4,096 nodes): one node of the plan lost, the survivors re-planned with the previous
    plan: instantiation, the leader's layer placement, and the whole re-plan (goal at tp = 8 and
    10,000 nodes: < 1 s), with the bytes the re-plan moves; up to 384 nodes side by side with
    the direct all-pairs placement it replaces (same placement, same bytes) and with the
    assignment that keeps the most bytes (the exact optimum); and the bytes moved without
    placement (preference order); beside it the move-aware re-plan (`planning.replan_tolerance`
    0.01: the untouched pipelines kept when that costs <= 1 % of the step), its bytes and its
    step over the fastest plan's.

  - pipeline schedules: the plan on 1,024 nodes at tp = 8 with `planning.schedule=auto` (every
    pipeline's schedule chosen by simulating 1F1B, interleaved 1F1B, zero-bubble and zbv at up to
    8 chunks), its samples/s and bubble, and the CPU seconds of plan_job (goal: < 2 s), beside the
    1F1B plan's.

  - mixed fleets (Sailor's table): planning 64 to 1,024 nodes of 1, 2 and 3 device classes
    (configs/gpt3-175b.yaml's h100, a100, v100 in 4:3:1, tp 8): the CPU seconds of the classes'
    templates and of the instantiation on them (what a re-plan costs: templates kept), with the
    plan's samples/s (goal at 1,024 nodes of 3 classes: < 2 s in all, < 0.5 s to re-plan).

    python -m bench planner [--repeats 5] [--only replan|tp|schedules|classes|...]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time

from bench.harness import Bench, emit

import numpy as np

from pathlib import Path
from typing import Optional

from oobleck_elastic.config import load_config
from oobleck_elastic.planning import (
    Links,
    build_templates,
    compare_tensor_parallel,
    instantiate,
    load_profiles,
    make_plan,
    plan_job,
)
from oobleck_elastic.planning.fleet import fleet_plan, fleet_templates
from oobleck_elastic.planning.profile.analytic import gpt3_175b_profile
from oobleck_elastic.planning.plan.placement import (
    bytes_received,
    keep_layers_in_place,
    keep_layers_in_place_pairwise,
    shard_bytes_of,
)

ROOT = Path(__file__).resolve().parents[1]

GLOBAL_MICROBATCHES = 1536  # GPT-3's 1536-sequence global batch, microbatch 1


def timed(fn, repeats: int):
    """(median wall seconds, result) of `repeats` calls."""
    wall, _, result = timed_cpu(fn, repeats)
    return wall, result


def timed_cpu(fn, repeats: int):
    """(median wall seconds, median CPU seconds of this process, result): on a shared machine the
    CPU time is what the code costs, the wall time what it cost under the load of the moment."""
    walls, cpus, result = [], [], None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus), result


def enumerate_covers(sizes: list[int], total: int, kmin: int):
    """Every multiset of template sizes adding up to `total` (Oobleck's _enumerate_instantiation_options)."""

    def rec(i: int, left: int, chosen: list[int]):
        if left == 0:
            if len(chosen) >= kmin:
                yield list(chosen)
            return
        if i == len(sizes):
            return
        s = sizes[i]
        for count in range(left // s, -1, -1):
            yield from rec(i + 1, left - count * s, chosen + [s] * count)

    yield from rec(0, total, [])


def enumeration_makespan(templates, total: int, B: int, f: int) -> tuple[float, int]:
    best, options = math.inf, 0
    for cover in enumerate_covers(templates.sizes(), total, f + 1):
        options += 1
        tpl = [templates[n] for n in cover]
        lo, hi = max(t.iteration_time(1) for t in tpl), max(t.iteration_time(B) for t in tpl)
        for _ in range(60):  # bisection on the makespan for this option's batch split
            mid = (lo + hi) / 2
            cap = sum(max(0, math.floor((mid - t.total_time_s) / t.bottleneck_s + 1e-9) + 1) for t in tpl)
            lo, hi = (lo, mid) if cap >= B else (mid, hi)
        best = min(best, hi)
    return best, options


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--only",
        choices=("basics", "tp", "replan", "schedules", "classes"),
        help="one part: templates/instantiation, tp, re-planning, pipeline schedules, or mixed fleets",
    )
    args = ap.parse_args(argv)
    common = {"bench": "planner", "model": "gpt3-175b-like", "layers": 98, "gpus_per_node": 8}
    if args.only in (None, "basics"):
        basics(common, args.repeats)
    if args.only in (None, "tp"):
        tensor_parallel(common)
    if args.only in (None, "replan"):
        replan_at_scale(common, min(args.repeats, 3))
    if args.only in (None, "schedules"):
        schedules(common, args.repeats)
    if args.only in (None, "classes"):
        classes(common, args.repeats)


def classes(common: dict, repeats: int, node_counts: tuple[int, ...] = (64, 256, 1024)) -> None:
    """A mixed fleet of 1, 2 and 3 classes: templates, then the plan on them (medians of `repeats`)."""
    cfg = load_config(ROOT / "configs/gpt3-175b.yaml", ["planning.tensor_parallel=8"])
    profiles = load_profiles(cfg)
    shares = {1: {"a100": 1}, 2: {"h100": 1, "a100": 1}, 3: {"h100": 4, "a100": 3, "v100": 1}}
    for n in node_counts:
        for k, share in shares.items():
            total = sum(share.values())
            counts = {c: n * w // total for c, w in share.items()}
            counts[next(iter(counts))] += n - sum(counts.values())
            _, templates_cpu, ft = timed_cpu(lambda c=counts: fleet_templates(cfg, c, profiles), repeats)
            ids = {c: [f"{c}-{i}" for i in range(k)] for c, k in counts.items()}
            _, plan_cpu, plan = timed_cpu(lambda i=ids, t=ft: fleet_plan(cfg, i, t), repeats)
            used = {c: sum(p.template_nodes for p in plan.pipelines if p.stages[0].device_class == c) for c in counts}
            row = {
                "figure": "mixed_fleet_tp8",
                "nodes": n,
                "classes": counts,
                "used": used,
                "pipelines": len(plan.pipelines),
                "est_samples_per_s": plan.samples_per_s,
                "templates_cpu_s": templates_cpu,
                "replan_cpu_s": plan_cpu,
                "plan_cpu_s": templates_cpu + plan_cpu,
            }
            if n == 1024 and k == 3:
                row |= {"goal_s": 2.0, "goal_replan_s": 0.5, "meets_goal": templates_cpu + plan_cpu < 2.0}
            emit(common | row)


def schedules(common: dict, repeats: int) -> None:
    """plan_job for GPT-3 on 1,024 nodes at tp 8, 1F1B and auto: CPU seconds (median of `repeats`
    calls, each from scratch: a fresh PipelineSchedules simulates every candidate again)."""
    for schedule in ("1f1b", "auto"):
        cfg = load_config(
            ROOT / "configs/gpt3-175b.yaml", ["planning.tensor_parallel=8", f"planning.schedule={schedule}"]
        )
        profiles = load_profiles(cfg)
        wall, cpu, jp = timed_cpu(lambda c=cfg, p=profiles: plan_job(c, nodes=1024, profile=p), repeats)
        row = {
            "figure": "schedules_1024_nodes_tp8",
            "schedule": schedule,
            "pipelines": len(jp.plan.pipelines),
            "chosen": sorted({f"{p.schedule}/{p.num_chunks}" for p in jp.plan.pipelines}),
            "est_samples_per_s": jp.plan.samples_per_s,
            "bubble_fraction": 1 - jp.efficiency,
            "plan_job_cpu_s": cpu,
            "plan_job_wall_s": wall,
        }
        if schedule == "auto":
            row |= {"goal_cpu_s": 2.0, "meets_goal": cpu < 2.0}
        emit(common | row)


def basics(common: dict, repeats: int) -> None:
    profile = gpt3_175b_profile().in_mode("full")  # as configs/gpt3-175b.yaml plans it

    def build():
        return build_templates(profile, gpus_per_node=8, device_memory_gb=80.0, memory_margin=0.1, links=Links())

    t_templates, templates = timed(build, repeats)
    t_inst, plan = timed(
        lambda: instantiate(templates, num_nodes=1024, num_microbatches=GLOBAL_MICROBATCHES, f=1), repeats
    )
    t_replan, replan = timed(
        lambda: instantiate(templates, num_nodes=1023, num_microbatches=GLOBAL_MICROBATCHES, f=1), repeats
    )
    emit(common | {"figure": "templates_s", "value": t_templates, "templates": templates.sizes()})
    emit(
        common
        | {
            "figure": "instantiate_1024_nodes_s",
            "value": t_inst,
            "pipelines": len(plan.pipelines),
            "nodes_used": plan.nodes_used,
        }
    )
    total = t_templates + t_inst
    emit(common | {"figure": "templates_plus_instantiate_s", "value": total, "goal": 1.0, "meets_goal": total < 1.0})
    emit(
        common
        | {
            "figure": "replan_after_one_loss_s",
            "value": t_replan,
            "goal": 0.05,
            "meets_goal": t_replan < 0.05,
            "nodes_used": replan.nodes_used,
        }
    )
    # the algorithms side by side on compute-only templates (the makespan then depends on the
    # templates alone, not on how many replicas share the gradient all-reduce)
    templates = build_templates(profile, gpus_per_node=8, device_memory_gb=80.0, memory_margin=0.1)
    for n in (24, 48, 96, 144):
        t_ours, ours = timed(
            lambda n=n: instantiate(templates, num_nodes=n, num_microbatches=GLOBAL_MICROBATCHES, f=1), repeats
        )
        t_enum, (enum_makespan, options) = timed(
            lambda n=n: enumeration_makespan(templates, n, GLOBAL_MICROBATCHES, 1), 1
        )
        emit(
            common
            | {
                "figure": "instantiate_vs_enumeration",
                "nodes": n,
                "ours_s": t_ours,
                "enumeration_s": t_enum,
                "enumeration_options": options,
                "ratio_enumeration_over_ours": t_enum / t_ours,
                "same_makespan": math.isclose(ours.makespan_s, enum_makespan, rel_tol=1e-6),
            }
        )


def tensor_parallel(common: dict) -> None:
    cfg = load_config(ROOT / "configs/gpt3-175b.yaml", ["planning.tensor_parallel=auto"])
    profiles = {d: gpt3_175b_profile(tensor_parallel=d) for d in (1, 2, 4, 8)}
    t0 = time.perf_counter()
    plans = compare_tensor_parallel(cfg, profiles, 1024)
    for d, jp in plans.items():
        p = jp.plan
        emit(
            common
            | {
                "figure": "tensor_parallel_1024_nodes",
                "tensor_parallel": d,
                "stages_per_node": 8 // d,
                "pipelines": len(p.pipelines),
                "stages_per_pipeline": sorted({len(q.stages) for q in p.pipelines}),
                "est_step_s": p.est_step_time_s,
                "est_samples_per_s": p.samples_per_s,
                "bubble_fraction": 1 - jp.efficiency,
            }
        )
    t_compare = time.perf_counter() - t0
    t_auto, cpu_auto, auto = timed_cpu(lambda: plan_job(cfg, nodes=1024, profile=profiles), 3)
    rates = {d: jp.plan.samples_per_s for d, jp in plans.items()}
    emit(
        common
        | {
            "figure": "tensor_parallel_1024_nodes",
            "tensor_parallel": "auto",
            "chose": auto.plan.tensor_parallel,
            "est_samples_per_s": auto.plan.samples_per_s,
            "bubble_fraction": 1 - auto.efficiency,
            "ratio_auto_over_tp1": auto.plan.samples_per_s / rates[1],
            "planning_all_degrees_s": t_compare,
            "auto_plan_job_s": t_auto,
            "auto_plan_job_cpu_s": cpu_auto,
            "goal": 2.0,
            "meets_goal": t_auto < 2.0,
        }
    )


REPLAN_TOLERANCE = 0.01  # planning.replan_tolerance's default


def replan_at_scale(common: dict, repeats: int) -> None:
    for tp in (1, 8):
        profile = gpt3_175b_profile(tensor_parallel=tp).in_mode("full")
        templates = build_templates(
            profile, gpus_per_node=8, device_memory_gb=80.0, memory_margin=0.1, links=Links(), tensor_parallel=tp
        )
        templates = dataclasses.replace(templates, profile=profile)  # as a job's: the re-plan prices bytes
        for n in (128, 256, 384, 1024, 4096, 10000):
            emit(common | replan_case(templates, shard_bytes_of(profile.layers), n, repeats))
        # the case that dissolves a pipeline: enough nodes of one pipeline lost that the others
        # cannot refill it (its survivors are spread over the rest)
        for n in (1024, 10000):
            row = replan_case(templates, shard_bytes_of(profile.layers), n, repeats, lost=5)
            emit(common | row)


def replan_case(templates, shards: list[int], n: int, repeats: int, lost: int = 1) -> dict:
    """`lost` nodes a third of the way in lost from a plan on n nodes; the survivors re-planned.
    One node: its pipeline is refilled (from a spare, or a node of the longest pipeline); more: a
    pipeline may be dissolved and the mix of templates change (`pipeline_sizes_before_after`)."""
    batch = GLOBAL_MICROBATCHES if n <= 1024 else 8192
    nodes = [f"node{i}" for i in range(n)]
    previous = make_plan(templates, nodes=nodes, num_microbatches=batch, microbatch_size=1, f=1)
    survivors = nodes[: n // 3] + nodes[n // 3 + lost :]

    def plan(order, prev=None, tolerance=0.0):
        return make_plan(
            templates,
            nodes=order,
            num_microbatches=batch,
            microbatch_size=1,
            f=1,
            generation=1,
            previous=prev,
            replan_tolerance=tolerance,
        )

    t_inst, a = timed(lambda: instantiate(templates, num_nodes=n - lost, num_microbatches=batch, f=1), repeats)
    t_place, order = timed(lambda: keep_layers_in_place(templates, a, list(survivors), previous), repeats)
    t_replan, cpu_replan, replan = timed_cpu(lambda: plan(list(survivors), previous), repeats)
    received = bytes_received(previous, replan, shards)
    tp = templates.tensor_parallel
    row = {
        "figure": "replan_at_scale",
        "tensor_parallel": tp,
        "nodes": n,
        "nodes_lost": lost,
        "global_batch": batch,
        "pipelines_before_after": [len(previous.pipelines), len(replan.pipelines)],
        "pipeline_sizes_before_after": [_sizes(previous), _sizes(replan)],
        "instantiate_s": t_inst,
        "placement_s": t_place,
        "replan_s": t_replan,
        "replan_cpu_s": cpu_replan,
        "bytes_moved": sum(received.values()),
        "bytes_moved_busiest_node": max(received.values(), default=0),
        "bytes_moved_without_placement": sum(bytes_received(previous, plan(list(survivors)), shards).values()),
    }
    # move-aware: the plan keeping the untouched pipelines when it costs <= 1 % of the step
    t_kept, kept = timed(lambda: plan(list(survivors), previous, REPLAN_TOLERANCE), repeats)
    moved = bytes_received(previous, kept, shards)
    row |= {
        "replan_tolerance": REPLAN_TOLERANCE,
        "kept_replan_s": t_kept,
        "kept_pipelines_after": len(kept.pipelines),
        "kept_bytes_moved": sum(moved.values()),
        "kept_bytes_moved_busiest_node": max(moved.values(), default=0),
        "kept_step_over_fastest": kept.est_step_time_s / replan.est_step_time_s,
    }
    if tp == 8 and n == 10000:
        row |= {"goal": 1.0, "meets_goal": t_replan < 1.0}
    if lost > 1:
        return row
    if n <= 384:  # the direct rule is quadratic: side by side where it finishes in seconds
        t_pair, pair = timed(lambda: keep_layers_in_place_pairwise(templates, a, list(survivors), previous), 1)
        row |= {
            "pairwise_placement_s": t_pair,
            "ratio_pairwise_over_ours": t_pair / t_place,
            "same_placement": pair == order,
            "pairwise_bytes_moved": sum(bytes_received(previous, plan(pair), shards).values()),
            "optimal_bytes_moved": sum(
                bytes_received(
                    previous, plan(fewest_bytes_order(templates, a, survivors, previous, shards)), shards
                ).values()
            ),
        }
    return row


def _sizes(plan) -> dict[str, int]:
    """Pipelines by node count ({"6": 1665, "10": 1})."""
    counts: dict[str, int] = {}
    for p in plan.pipelines:
        counts[str(len(p.nodes))] = counts.get(str(len(p.nodes)), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))


def fewest_bytes_order(templates, a, nodes: list[str], previous, shards: list[int]) -> list[str]:
    """`nodes` ordered into the slots of assignment `a` so that they keep the most layer bytes of
    `previous`: the exact optimum (an assignment problem, solved with `max_weight_assignment`),
    the yardstick for the greedy placement."""
    prefix = np.concatenate([[0], np.cumsum(shards)])
    held = previous.layers_by_worker()
    slots = []  # per node slot: [(local rank, start, end)]
    for n, _ in a.pipelines:
        per_node = [[] for _ in range(n)]
        for st in templates[n].stages:
            per_node[st.node] += [(st.local_rank + j, st.start, st.end) for j in range(templates.tensor_parallel)]
        slots.extend(per_node)
    used = nodes[: len(slots)]
    kept = np.zeros((len(used), len(slots)))
    for i, node in enumerate(used):
        for k, slot in enumerate(slots):
            for lr, start, end in slot:
                had = held.get((node, lr))
                if had is not None and max(start, had.start) < min(end, had.stop):
                    kept[i, k] += prefix[min(end, had.stop)] - prefix[max(start, had.start)]
    order = [""] * len(slots)
    for i, k in enumerate(max_weight_assignment(kept)):
        order[k] = used[i]
    return order + nodes[len(slots) :]


def max_weight_assignment(weight: np.ndarray) -> list[int]:
    """Column of each row in a maximum-weight perfect assignment of a square matrix: the
    shortest-augmenting-path Hungarian method (potentials u, v), one row added at a time, the
    scan over columns vectorised."""
    cost = weight.max() - weight
    n = cost.shape[0]
    u, v = np.zeros(n + 1), np.zeros(n + 1)
    row_of = np.zeros(n + 1, dtype=int)  # column j (1-based) -> its row (1-based); 0 = free
    for i in range(1, n + 1):
        row_of[0], col = i, 0
        best = np.full(n + 1, np.inf)
        came = np.zeros(n + 1, dtype=int)
        done = np.zeros(n + 1, dtype=bool)
        while row_of[col]:
            done[col] = True
            r = row_of[col]
            reduced = cost[r - 1] - u[r] - v[1:]
            open_ = ~done[1:]
            better = open_ & (reduced < best[1:])
            best[1:][better] = reduced[better]
            came[1:][better] = col
            nxt = int(np.where(open_, best[1:], np.inf).argmin()) + 1
            delta = best[nxt]
            u[row_of[done]] += delta
            v[done] -= delta
            best[1:][open_] -= delta
            col = nxt
        while col:
            prev = came[col]
            row_of[col] = row_of[prev]
            col = prev
    out = [0] * n
    for j in range(1, n + 1):
        out[row_of[j] - 1] = j - 1
    return out


BENCH = Bench(main, quick=("--repeats", "1", "--only", "basics"))
