"""A worker that trains nothing: it shows what `--rdzv-backend=oobleck` gives each worker.

Run it like a training script to check a cluster's set-up. The story: docs/running.md.
"""

import argparse
import os
import sys
import time

import torch

from oobleck_elastic.config import load_config
from oobleck_elastic.rendezvous.worker import WorkerContext


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="job config (read by the rendezvous handler)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step-time", type=float, default=0.25)
    args, rest = ap.parse_known_args()

    ctx = WorkerContext.from_env()
    if args.config:
        ctx.share_profile(load_config(args.config, [a for a in rest if "=" in a]), torch.device("cpu"))
    ctx.report_ready()
    me = f"{ctx.node_id}/{ctx.local_rank}"
    ctx.client.put_json(
        ctx.keys.probe(ctx.node_id, ctx.local_rank, os.getpid()),
        {"restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))},
    )
    seen = 0
    last_step = time.monotonic()
    while True:
        plan = ctx.plan()
        why = ctx.should_leave(plan)
        if why:
            print(f"[{me}] exiting 0: {why}", flush=True)
            return 0
        if plan is not None and plan.generation != seen:
            seen = plan.generation
            stage = ctx.my_stage(plan)
            where = (
                (
                    f"pipeline {stage[0].index} stage {stage[1].index} layers [{stage[1].start},{stage[1].end}) "
                    f"rank {stage[1].rank}"
                )
                if stage
                else "no stage (spare)"
            )
            print(f"[{me}] generation {plan.generation}: {len(plan.nodes)} node(s); {where}", flush=True)
        stage = ctx.my_stage(plan) if plan else None
        if stage and stage[1].rank == 0 and time.monotonic() - last_step >= args.step_time:
            last_step = time.monotonic()
            progress = ctx.progress()
            step = (progress.step if progress is not None else 0) + 1
            ctx.report_progress(generation=plan.generation, step=step)
            if step >= args.steps:
                ctx.close_job(f"probe finished {step} steps")
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
