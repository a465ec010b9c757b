"""Planner benchmark: GPT-3-175B-like profile (96 blocks + embedding + head), 8 devices per node.

Prints one JSON line per figure:
  - templates for every node count, and instantiation on 1,024 nodes (goal: < 1 s together);
  - re-plan after one node loss, 1,024 -> 1,023 nodes, templates reused (goal: < 50 ms);
  - side by side on the same run: our knapsack instantiation against Oobleck's approach of
    enumerating every multiset of templates that covers N nodes (each then given its best batch
    split), at node counts where the enumeration still finishes; both must find the same makespan;
  - tensor parallelism: the estimated samples/s, step time and bubble fraction of the plan on
    1,024 nodes at tp = 1, 2, 4, 8 and for `auto` (communication counted with the default links).

    python bench/planner.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

from pathlib import Path

from oobleck_elastic.config import load_config
from oobleck_elastic.planning import Links, build_templates, compare_tensor_parallel, instantiate, plan_job
from oobleck_elastic.planning.analytic import gpt3_175b_profile

ROOT = Path(__file__).resolve().parents[1]

GLOBAL_MICROBATCHES = 1536  # GPT-3's 1536-sequence global batch, microbatch 1


def timed(fn, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    profile = gpt3_175b_profile()

    def build():
        return build_templates(profile, gpus_per_node=8, device_memory_gb=80.0, memory_margin=0.1, links=Links())

    t_templates, templates = timed(build, args.repeats)
    t_inst, plan = timed(
        lambda: instantiate(templates, num_nodes=1024, num_microbatches=GLOBAL_MICROBATCHES, f=1), args.repeats
    )
    t_replan, replan = timed(
        lambda: instantiate(templates, num_nodes=1023, num_microbatches=GLOBAL_MICROBATCHES, f=1), args.repeats
    )
    common = {"bench": "planner", "model": "gpt3-175b-like", "layers": profile.num_layers, "gpus_per_node": 8}
    print(json.dumps(common | {"figure": "templates_s", "value": t_templates, "templates": templates.sizes()}))
    print(
        json.dumps(
            common
            | {
                "figure": "instantiate_1024_nodes_s",
                "value": t_inst,
                "pipelines": len(plan.pipelines),
                "nodes_used": plan.nodes_used,
            }
        )
    )
    total = t_templates + t_inst
    print(
        json.dumps(
            common | {"figure": "templates_plus_instantiate_s", "value": total, "goal": 1.0, "meets_goal": total < 1.0}
        )
    )
    print(
        json.dumps(
            common
            | {
                "figure": "replan_after_one_loss_s",
                "value": t_replan,
                "goal": 0.05,
                "meets_goal": t_replan < 0.05,
                "nodes_used": replan.nodes_used,
            }
        )
    )
    # the algorithms side by side on compute-only templates (the makespan then depends on the
    # templates alone, not on how many replicas share the gradient all-reduce)
    templates = build_templates(profile, gpus_per_node=8, device_memory_gb=80.0, memory_margin=0.1)
    for n in (24, 48, 96, 144):
        t_ours, ours = timed(
            lambda n=n: instantiate(templates, num_nodes=n, num_microbatches=GLOBAL_MICROBATCHES, f=1), args.repeats
        )
        t_enum, (enum_makespan, options) = timed(
            lambda n=n: enumeration_makespan(templates, n, GLOBAL_MICROBATCHES, 1), 1
        )
        print(
            json.dumps(
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
        )

    tensor_parallel(common)


def tensor_parallel(common: dict) -> None:
    cfg = load_config(ROOT / "configs/gpt3-175b.yaml", ["planning.tensor_parallel=auto"])
    profiles = {d: gpt3_175b_profile(tensor_parallel=d) for d in (1, 2, 4, 8)}
    t0 = time.perf_counter()
    plans = compare_tensor_parallel(cfg, profiles, 1024)
    for d, jp in plans.items():
        p = jp.plan
        print(
            json.dumps(
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
        )
    auto = plan_job(cfg, nodes=1024, profile=profiles)
    rates = {d: jp.plan.samples_per_s for d, jp in plans.items()}
    print(
        json.dumps(
            common
            | {
                "figure": "tensor_parallel_1024_nodes",
                "tensor_parallel": "auto",
                "chose": auto.plan.tensor_parallel,
                "est_samples_per_s": auto.plan.samples_per_s,
                "bubble_fraction": 1 - auto.efficiency,
                "ratio_auto_over_tp1": auto.plan.samples_per_s / rates[1],
                "planning_all_degrees_s": time.perf_counter() - t0,
            }
        )
    )


if __name__ == "__main__":
    main()
