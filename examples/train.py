"""Train a causal LM with oobleck_elastic.

    python examples/train.py --config configs/gpt2-tiny.yaml [key=value ...]
        one process, no etcd: the reference run
    torchrun --rdzv-backend=oobleck --rdzv-endpoint=HOST:2379 --rdzv-id=JOB --nnodes=2:4 \\
             --nproc-per-node=1 examples/train.py --config configs/gpt2-tiny.yaml
        one worker of a job: pipelines and replicas come from the plan in etcd
    python -m launcher.local --nodes 4 -- examples/train.py --config configs/gpt2-tiny.yaml
        a local multi-node simulation with an embedded etcd

The story: docs/training.md.
"""

import argparse
import os
import sys
import traceback

from oobleck_elastic.config import ConfigError, JobConfig, load_config
from oobleck_elastic.engine.run import train
from oobleck_elastic.engine.startup import KNOWN_ERRORS, exit_code, one_line
from oobleck_elastic.engine.runner import exit_now_if_abandoned
from oobleck_elastic.rendezvous.worker import WorkerContext, under_oobleck


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="job YAML (see configs/)")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. training.steps=10")
    args = ap.parse_args()
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    world = os.environ.get("WORLD_SIZE", "1")
    if not under_oobleck() and world != "1":  # torchrun's world without the in-place backend: not ours to train in
        print(
            f"train.py: error: started in a torchrun world of {world} processes, not by --rdzv-backend=oobleck "
            "in place: give torchrun --rdzv-backend=oobleck (and this --config), or run one process",
            file=sys.stderr,
        )
        return 2
    try:
        return run(cfg)
    except KNOWN_ERRORS as err:  # a setting, a file, a plan, a checkpoint: one line says what to change
        print(f"train.py: error: {one_line(err)}", file=sys.stderr, flush=True)
        return exit_code(err)


def run(cfg: JobConfig) -> int:
    if under_oobleck():  # a worker of a job: the control plane is etcd
        control = WorkerContext.from_env()
        try:
            summary = train(cfg, control)
        finally:
            control.close()
    else:  # one process: the single-process reference
        summary = train(cfg)
    if summary.tensorboard or not under_oobleck():
        print("\n".join(summary.lines()), flush=True)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except Exception:
        traceback.print_exc()
        exit_now_if_abandoned(1)
        sys.exit(1)
    exit_now_if_abandoned(code)  # a step abandoned on a hung peer may still be blocked: see its docstring
    sys.exit(code)
