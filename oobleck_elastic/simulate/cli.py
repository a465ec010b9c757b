"""`oobleck simulate`: replay a node trace through the system models (docs/simulate.md).

oobleck simulate --trace 10m --model GPT-2 [--systems oobleck,varuna] [--json] [--plot out.png]
oobleck simulate --nodes 30 --mtbf-h 12 --hours 24 [--join-delay-s 600] --model BERT-large
oobleck simulate --paper [--json] [--plot paper.png]        # the SOSP'23 comparison in one go
oobleck simulate --paper --artifact                         # as the authors' simulator computes it
oobleck simulate --paper --correct stale-timeout,run-span   # artifact vs these corrections only
oobleck simulate --scale --nodes 10000 --global-batch 8192   # this project's planner at scale
oobleck simulate --paper --shadow-copies 1,2                # what host-memory shadow copies buy
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import paper, paper_artifact
from .artifact import Corrections
from .report import plot, plot_paper, shadow_table, summary_table
from .shadows import SHADOW_STEP_OVERHEAD
from .trace import load_trace, synthetic_trace


def add_parser(sub: Any) -> None:
    s = sub.add_parser(
        "simulate",
        help="replay node failures and joins through this and other systems' models",
        description=__doc__.split("\n\n")[0],
    )
    what = s.add_mutually_exclusive_group()
    what.add_argument(
        "--trace", help="trace file (time_ms,add|remove,node) or a shipped trace's name, e.g. 10m, scale_gcp-trace"
    )
    what.add_argument("--paper", action="store_true", help="every model x trace x system of the Oobleck paper")
    what.add_argument(
        "--scale",
        action="store_true",
        help="GPT-3-175B-like model planned by this project at "
        "--nodes nodes, failures from --node-mtbf-h, against torchrun checkpoint-restart",
    )
    s.add_argument(
        "--artifact",
        action="store_true",
        help="--paper: only the published systems, as the authors' simulator (SOSP'23 artifact) computes them",
    )
    s.add_argument(
        "--correct",
        default="all",
        help="--paper: corrections to the artifact's simulator in the corrected column: all, none, or "
        f"comma-separated from {', '.join(Corrections.names())} (docs/simulate.md; default all)",
    )
    s.add_argument("--nodes", type=int, help="synthetic trace / --scale: nodes at the start")
    s.add_argument(
        "--mtbf-h", "--mtbf", type=float, help="synthetic trace: mean time between failures of one node, hours"
    )
    s.add_argument(
        "--hours", type=float, help="length of the run (synthetic and --scale: 24; a trace: until its last event)"
    )
    s.add_argument(
        "--join-delay-s",
        type=float,
        help="a failed node is replaced this many seconds later (synthetic; --scale default 600)",
    )
    s.add_argument("--seed", type=int, default=0, help="seed of the synthetic failures (0)")
    s.add_argument(
        "--model",
        default="GPT-2",
        help="model of the paper's inputs (BERT-large, GPT-2, GPT-3-medium, GPT-3-2.7B, GPT-3-6.7B; default GPT-2)",
    )
    s.add_argument("--systems", default=",".join(paper.SYSTEMS), help="comma-separated systems (default: all five)")
    s.add_argument("--inputs", default=str(paper.INPUTS), help="the paper's inputs (configs/simulate/sosp23.yaml)")
    s.add_argument("--global-batch", type=int, default=1536, help="--scale: sequences per step (1536)")
    s.add_argument(
        "--schedule",
        default="1f1b",
        help="--scale: planning.schedule of the planner: 1f1b (default; the closed form) or auto (each "
        "pipeline's schedule chosen by simulation), or one schedule's name",
    )
    s.add_argument(
        "--node-mtbf-h",
        type=float,
        help="--scale: per-node MTBF in hours (default: 1.8 h MTTF at 16,384 GPUs, 3,686 h per 8-GPU node)",
    )
    s.add_argument(
        "--shadow-copies",
        type=_copies,
        default=[],
        help="also run oobleck_elastic with this many host-memory shadow copies of every layer "
        "(fault_tolerance.shadow_copies; comma-separated for several, e.g. 1,2) and print what they buy",
    )
    s.add_argument(
        "--shadow-overhead",
        type=float,
        default=SHADOW_STEP_OVERHEAD,
        help="failure-free step-time overhead of one shadow copy of every layer, a fraction; s copies cost s "
        f"times it (default {SHADOW_STEP_OVERHEAD:g}: simulate/shadows.py SHADOW_STEP_OVERHEAD, bench/shadows.py)",
    )
    s.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    s.add_argument("--plot", help="write a PNG of throughput over time (--paper: average samples/s per run)")
    s.set_defaults(func=run)


def _copies(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = [-1]
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a count of shadow copies >= 0 (or several: 1,2)")
    return values


def run(args: argparse.Namespace) -> int:
    if args.paper:
        return _paper(args)
    if args.scale:
        return _scale(args)
    inputs = paper.load_inputs(args.inputs)
    if args.trace:
        events, label = load_trace(paper.trace_path(args.trace)), Path(args.trace).stem
    elif args.nodes and args.mtbf_h:
        events = synthetic_trace(
            args.nodes,
            mtbf_h=args.mtbf_h,
            duration_h=args.hours or 24.0,
            join_delay_s=args.join_delay_s,
            seed=args.seed,
        )
        label = f"synthetic-{args.nodes}n-mtbf{args.mtbf_h:g}h"
    else:
        raise ValueError("give --trace, --nodes with --mtbf-h, --paper or --scale")
    names = paper.with_shadows([n.strip() for n in args.systems.split(",") if n.strip()], args.shadow_copies)
    systems = paper.systems_for(inputs, args.model, names, shadow_overhead=args.shadow_overhead)
    end = args.hours * 3600.0 if args.hours else (24 * 3600.0 if not args.trace else None)
    timelines = paper.simulate(events, systems, provisioning_s=float(inputs["provisioning_s"]), end_s=end)
    named = list(zip(names, timelines))
    if args.json:
        for name, tl in named:
            print(json.dumps(paper.Run(args.model, label, name, tl).row()))
    else:
        removals = sum(e.kind == "remove" for e in events)
        print(
            f"{args.model} on {label}: {removals} removal(s), {len(events) - removals} addition(s), "
            f"{max(tl.t for tl in timelines) / 3600:.2f} h"
        )
        print(summary_table(named))
        if any(c > 0 for c in args.shadow_copies):
            print("\n" + _shadow_header(args))
            print(shadow_table([paper.Run(args.model, label, name, tl).row() for name, tl in named]))
    if args.plot:
        print(f"plot: {plot(named, args.plot, title=f'{args.model} on {label}')}", file=sys.stderr)
    return 0


def _paper(args: argparse.Namespace) -> int:
    inputs = paper.load_inputs(args.inputs)
    corrections = Corrections.parse(args.correct)
    cells = paper_artifact.compare(inputs, corrections=corrections)
    if args.artifact:
        if args.json:
            for c in cells:
                print(json.dumps(c.row(corrections) | {"samples_per_s": c.artifact}))
        else:
            print(paper_artifact.comparison_table(cells, artifact_only=True))
        return 0
    names = paper.with_shadows([n.strip() for n in args.systems.split(",") if n.strip()], args.shadow_copies)
    runs = paper.run_paper(inputs, systems=names, shadow_overhead=args.shadow_overhead)
    rows = [r.row() for r in runs]
    by_cell = {(c.model, c.trace, c.system): c for c in cells}
    for row in rows:
        cell = by_cell.get((row["model"], row["trace"], row["system"]))
        if cell is not None:
            row |= {k: v for k, v in cell.row(corrections).items() if k not in row}
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"The published systems as the authors' simulator computes them, and corrected ({corrections.label()}):")
        print(paper_artifact.comparison_table(cells))
        print("\nEvery system on this project's timeline model (docs/simulate.md):")
        print(paper.paper_table(runs))
        if any(c > 0 for c in args.shadow_copies):
            print("\n" + _shadow_header(args))
            print(shadow_table(rows))
    if args.plot:
        print(f"plot: {plot_paper(rows, args.plot)}", file=sys.stderr)
    return 0


def _scale(args: argparse.Namespace) -> int:
    from .scale import ScaleSettings, run_scale

    settings = ScaleSettings(
        nodes=args.nodes or 1024,
        hours=args.hours or 24.0,
        seed=args.seed,
        global_batch=args.global_batch,
        schedule=args.schedule,
    )
    if args.node_mtbf_h:
        settings.node_mtbf_h = args.node_mtbf_h
    if args.join_delay_s is not None:
        settings.join_delay_s = args.join_delay_s
    settings.shadow_copies = [c for c in dict.fromkeys(args.shadow_copies) if c > 0]
    settings.shadow_overhead = args.shadow_overhead
    result = run_scale(settings)
    rows = result.rows()
    if args.json:
        for row in rows:
            print(json.dumps(row | {"wall_s": round(result.wall_s, 2)}))
    else:
        print(
            f"GPT-3-175B-like, {settings.nodes} nodes x 8 devices, {settings.hours:g} h, node MTBF "
            f"{settings.node_mtbf_h:.0f} h: {result.failures} failure(s); simulated in {result.wall_s:.1f} s"
        )
        chosen = ", ".join(f"{n} x {k}" for k, n in sorted(result.chosen.items()))
        print(
            f"planning.schedule={settings.schedule}: {chosen} at the start, "
            f"{result.start_samples_per_s:.1f} samples/s before any failure"
        )
        print(summary_table(list(result.timelines.items())))
        for name, every in result.checkpoint_every.items():
            print(f"{name}: checkpoint every {every} steps")
        print("\n".join(result.cost_lines()))
        if settings.shadow_copies:
            print("\n" + _shadow_header(args))
            print(shadow_table(rows))
    if args.plot:
        print(
            f"plot: {plot(list(result.timelines.items()), args.plot, title=f'{settings.nodes} nodes')}", file=sys.stderr
        )
    return 0


def _shadow_header(args: argparse.Namespace) -> str:
    return (
        f"Shadow copies (oobleck_elastic:s=N): each slows every step by {args.shadow_overhead:.1%} "
        "(--shadow-overhead); host memory reported, not charged:"
    )
