"""Simulator benchmark: the paper's whole comparison, and 24 h of this project's planner at 1,024
and 10,000 nodes against torchrun checkpoint-restart (goal: 10,000 nodes in < 60 s).

Prints one JSON line per figure (the scale rows carry both systems side by side):

    python bench/simulate.py [--hours 24] [--seeds 1]
"""

from __future__ import annotations

import argparse
import json
import time

from oobleck_elastic.simulate.paper import run_paper
from oobleck_elastic.simulate.scale import ScaleSettings, node_mtbf_h, run_scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--seeds", type=int, default=1)
    args = ap.parse_args()
    t0 = time.perf_counter()
    runs = run_paper()
    print(
        json.dumps(
            {
                "bench": "simulate",
                "figure": "paper_all_runs_s",
                "runs": len(runs),
                "value": round(time.perf_counter() - t0, 3),
            }
        )
    )
    for nodes, batch in ((1024, 1536), (10000, 8192)):
        for rate, mtbf in (("1.8h@16384gpus", node_mtbf_h(1.8, 16384)), ("7.9h@1024gpus", node_mtbf_h(7.9, 1024))):
            for seed in range(args.seeds):
                r = run_scale(
                    ScaleSettings(nodes=nodes, hours=args.hours, node_mtbf_h=mtbf, seed=seed, global_batch=batch)
                )
                rows = {x["system"]: x for x in r.rows()}
                ours, base = rows["oobleck_elastic"], rows["checkpoint_restart"]
                print(
                    json.dumps(
                        {
                            "bench": "simulate",
                            "figure": "scale",
                            "nodes": nodes,
                            "hours": args.hours,
                            "global_batch": batch,
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
                )


if __name__ == "__main__":
    main()
