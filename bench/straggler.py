"""A straggler: one node computing 3x slower, with and without the batch re-split around it.

Method. The same job runs `--repeats` times with the mitigation and as often without, alternating
(with, without, with, ...), never two at once: 4 simulated nodes (`python -m launcher.local`, its
own etcd each run), configs/gpt2-tiny.yaml with seq_len 64, a global batch of 32 in microbatches
of 2, and `--layout` pipelines: `1x4` (four one-stage pipelines: planning.device_memory_gb=100) or
`2x2` (two two-stage pipelines, the tiny synthetic profile the tests use). Node 1 computes 3x
slower from step 0 (OOBLECK_STRAGGLE_AT=node1@0:3, engine/resilience/faults.py: each of its forward and
backward chunks is followed by a sleep of twice its duration). With the mitigation
(fault_tolerance.straggler_rebalance=true, the default) the workers name node1 after
straggler_steps steps and the leader re-splits the microbatches at the measured speeds; without
it (false) the job keeps the plan's equal split.

Reported per run: `samples_s`, the steady state: global batch x steps / their summed wall time
("since the last" of the rank-0 worker's progress lines) over the last `--tail` steps, which
start well after any re-split; `rebalanced`, whether a re-split plan was published. The comparison
line: `ratio` = median samples/s with ÷ without (goal >= 1.3).

Run (about 1 min per job on 2 cores):

    .venv/bin/python -m bench straggler [--repeats 2] [--steps 40] [--tail 15] [--layout 1x4|2x2]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

from bench.harness import Bench, alternate, emit


from oobleck_elastic.testing import TINY_PROFILE_OVERRIDES, tiny_profile

ROOT = Path(__file__).resolve().parents[1]

LINE = re.compile(r"gen (\d+) step (\d+)/(\d+) node \S+: .*\(([\d.]+) s since the last")
BATCH = 32


def run(tmp: Path, *, rebalance: bool, steps: int, layout: str, tag: str) -> dict:
    profile = tiny_profile(tmp / "profile.json")
    overrides = [
        f"training.steps={steps}",
        "data.seq_len=64",
        f"training.global_batch_size={BATCH}",
        "training.microbatch_size=2",
        f"data.cache_dir={tmp / 'cache'}",
        f"checkpoint.dir={tmp / tag / 'ckpt'}",
        f"logging.tensorboard_dir={tmp / tag / 'runs'}",
        f"planning.profile_path={profile}",
        *TINY_PROFILE_OVERRIDES,
        f"fault_tolerance.straggler_rebalance={str(rebalance).lower()}",
    ]
    if layout == "1x4":
        overrides.append("planning.device_memory_gb=100")
    cmd = [
        sys.executable,
        "-m",
        "launcher.local",
        "-v",  # every node line: this reads them
        "--nodes",
        "4",
        "--rdzv-conf",
        "lease_ttl=2,settle=0.2,last_call_timeout=1",
        "--",
        "examples/train.py",
        "--config",
        "configs/gpt2-tiny.yaml",
        *overrides,
    ]
    env = {**os.environ, "OOBLECK_STRAGGLE_AT": "node1@0:3", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900).stdout
    (tmp / f"{tag}.log").write_text(out)
    times = {int(m.group(2)): float(m.group(4)) for m in LINE.finditer(out)}
    return {"times": times, "rebalanced": "(rebalance)" in out, "ok": f"step {steps}/{steps}" in out}


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--tail", type=int, default=15, help="steady-state steps at the end of each run")
    ap.add_argument("--layout", choices=["1x4", "2x2"], default="1x4")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="oobleck-straggler-"))
    print(f"logs in {tmp}", file=sys.stderr)

    def side(rebalance: bool) -> Callable[[], float]:
        repeats = itertools.count()

        def measure() -> float:  # one job: samples/s over its last --tail steps
            tag = f"{'with' if rebalance else 'without'}-{next(repeats)}"
            got = run(tmp, rebalance=rebalance, steps=args.steps, layout=args.layout, tag=tag)
            tail = [got["times"][s] for s in range(args.steps - args.tail + 1, args.steps + 1) if s in got["times"]]
            samples_s = BATCH * len(tail) / sum(tail) if tail else 0.0
            emit(
                {
                    "bench": "straggler",
                    "run": tag,
                    "layout": args.layout,
                    "slowed": "node1 3x",
                    "mitigation": rebalance,
                    "samples_s": round(samples_s, 2),
                    "rebalanced": got["rebalanced"],
                    "completed": got["ok"],
                    "tail_steps": len(tail),
                }
            )
            return samples_s

        return measure

    result = alternate({"with": side(True), "without": side(False)}, args.repeats)
    with_, without = result.medians["with"] or 0.0, result.medians["without"] or 0.0
    emit(
        {
            "bench": "straggler",
            "compare": "with / without mitigation",
            "layout": args.layout,
            "samples_s_with": round(with_, 2),
            "samples_s_without": round(without, 2),
            "ratio": round(result.ratio, 3) if result.ratio is not None else None,
            "goal": 1.3,
        }
    )


BENCH = Bench(main, quick=None)
