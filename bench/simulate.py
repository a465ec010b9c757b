"""Simulator benchmark: the paper's whole comparison, and 24 h of this project's planner at 1,024
and 10,000 nodes against torchrun checkpoint-restart (goal: 10,000 nodes in < 60 s).

Prints one JSON line per figure (the scale rows carry both systems side by side):

    python -m bench simulate [--hours 24] [--seeds 1] [--schedule auto]
    python -m bench simulate --artifact-dir /tmp/Oobleck/tools/simulator   # ours vs the authors' simulator

With `--artifact-dir` (a checkout of the authors' simulator, SymbioticLab/Oobleck `tools/simulator`,
not part of this repository) it runs their simulator the way their eval scripts do and this
project's artifact-faithful mode on every model x trace x system, one line per cell with both
figures and the deviation, then the largest deviation (goal: within 5 % per cell).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import sys
import time
from pathlib import Path
from typing import Optional

from bench.harness import Bench, emit

from oobleck_elastic.simulate.paper import load_inputs, run_paper
from oobleck_elastic.simulate.paper_artifact import compare
from oobleck_elastic.simulate.scale import ScaleSettings, node_mtbf_h, run_scale


ARTIFACT_MODELS = {
    "BERT-large": "BERT-large",
    "GPT-2": "GPT-2-ours",
    "GPT-3-medium": "GPT-3-medium",
    "GPT-3-2.7B": "GPT-3-2_7b",
    "GPT-3-6.7B": "GPT-3-6_7b",
}


def theirs(directory: Path, model: str, trace: str, system: str, spot: bool) -> float:
    """One cell of the authors' simulator, called as its eval_tput_vs_freq.py (synthetic traces) and
    eval_gcp_ec2.py (spot traces) call it."""
    sys.path.insert(0, str(directory))
    module = importlib.import_module(f"{system}_simulator")
    kw: dict = dict(seed=None, start_hour=0, model=ARTIFACT_MODELS[model], time_hard_stop=True)
    if not spot:
        kw["steps_per_run"] = 200000
    elif system != "bamboo":
        kw["steps_per_run"] = 2000000000
    if system == "varuna":
        kw["no_small_model_fallback"] = spot
    path = directory / "traces" / ("scaled/" if spot else "") / f"{trace}.csv"
    logging.disable(logging.CRITICAL)
    with path.open() as f, contextlib.redirect_stdout(io.StringIO()):
        return float(module.Simulator(spot_instance_trace=f, **kw).simulate().average_performance)


def against_artifact(directory: Path) -> None:
    inputs = load_inputs()
    worst = 0.0
    for c in compare(inputs):
        spot = c.trace in inputs["artifact"]["spot_traces"]
        t = theirs(directory, c.model, c.trace, c.system, spot)
        dev = abs(c.artifact / t - 1) if t else (0.0 if c.artifact == 0 else float("inf"))
        worst = max(worst, dev)
        row = {"bench": "simulate", "figure": "artifact_cell", "model": c.model, "trace": c.trace}
        row |= {"system": c.system, "ours": round(c.artifact, 3), "theirs": round(t, 3), "deviation": round(dev, 5)}
        emit(row | {"corrected": round(c.corrected, 3)})
    emit({"bench": "simulate", "figure": "artifact_max_deviation", "value": round(worst, 5), "goal": 0.05})


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--schedule", default="1f1b", help="the scale rows' planning.schedule: 1f1b (default) or auto")
    ap.add_argument("--artifact-dir", type=Path, help="the authors' tools/simulator: compare every cell, then stop")
    args = ap.parse_args(argv)
    if args.artifact_dir:
        against_artifact(args.artifact_dir)
        return
    t0 = time.perf_counter()
    runs = run_paper()
    emit(
        {
            "bench": "simulate",
            "figure": "paper_all_runs_s",
            "runs": len(runs),
            "value": round(time.perf_counter() - t0, 3),
        }
    )
    for nodes, batch in ((1024, 1536), (10000, 8192)):
        for rate, mtbf in (("1.8h@16384gpus", node_mtbf_h(1.8, 16384)), ("7.9h@1024gpus", node_mtbf_h(7.9, 1024))):
            for seed in range(args.seeds):
                r = run_scale(
                    ScaleSettings(
                        nodes=nodes,
                        hours=args.hours,
                        node_mtbf_h=mtbf,
                        seed=seed,
                        global_batch=batch,
                        schedule=args.schedule,
                    )
                )
                rows = {x["system"]: x for x in r.rows()}
                ours, base = rows["oobleck_elastic"], rows["checkpoint_restart"]
                emit(
                    {
                        "bench": "simulate",
                        "figure": "scale",
                        "nodes": nodes,
                        "hours": args.hours,
                        "global_batch": batch,
                        "schedule": args.schedule,
                        "schedules_at_start": r.chosen,
                        "mttf_source": rate,
                        "node_mtbf_h": round(mtbf),
                        "seed": seed,
                        "failures": r.failures,
                        "oobleck_elastic_samples_per_s": round(ours["samples_per_s"], 2),
                        "checkpoint_restart_samples_per_s": round(base["samples_per_s"], 2),
                        "ratio": round(ours["samples_per_s"] / base["samples_per_s"], 3),
                        "oobleck_elastic_useful": round(ours["useful_fraction"], 4),
                        "checkpoint_restart_useful": round(base["useful_fraction"], 4),
                        "checkpoint_every_steps": [ours["checkpoint_every_steps"], base["checkpoint_every_steps"]],
                        "oobleck_elastic_costs": ours["costs"],
                        "wall_s": round(r.wall_s, 2),
                        "goal_s": 60.0 if nodes >= 10000 else None,
                    }
                )


BENCH = Bench(main, quick=("--hours", "1"))
