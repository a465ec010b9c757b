"""A mixed fleet on paced devices: the class-aware plan against a class-blind one and the fast class alone.

Method. 4 simulated nodes (`python -m launcher.local`, its own etcd each run) of
configs/gpt2-tiny.yaml on the tests' synthetic profile (n0 = 2: two-stage pipelines), paced
devices (`training.paced_devices`, k = `--factor`): nodes 0 and 1 run at speed 1, nodes 2 and 3 at
`--slow` (`--paced-speeds`: each pads its passes to k x the profile's time / its own speed, however
the plan saw it, engine/stage/paced.py `node_factor`). Three sides, alternated, never two at once:

- `mixed`: the config declares classes fast (speed 1) and slow (`--slow`), each node its own
  (`--device-classes`): the planner gives each class its pipelines and each pipeline its share;
- `blind`: no classes: the planner takes all four nodes alike (equal shares, and a pipeline may
  pair a fast node with a slow one);
- `fast`: the two fast nodes alone (one pipeline: the plan warns it is below f + 1).

Reported per run: `samples_s` (global batch x steps / their summed wall time over the last
`--tail` steps, from the rank-0 worker's progress lines) and `est_samples_s` (the same from its
`plan est.`, the plan's step time x k). The comparison: mixed ÷ blind (goal >= 1.2), mixed ÷ fast
(goal >= 1.0), and measured ÷ estimated for mixed (goal within 10 %). The blind plan's estimate
assumes every device at speed 1, so its measured ÷ estimated shows what ignoring classes costs.

    .venv/bin/python -m bench mixed [--repeats 2] [--steps 24] [--tail 12] [--factor 2] [--slow 0.5]
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

LINE = re.compile(r"gen (\d+) step (\d+)/(\d+) node \S+: .*\(([\d.]+) s since the last(?:, plan est\. ([\d.]+) s)?")
BATCH = 16


def run(tmp: Path, side: str, *, steps: int, factor: float, slow: float, tag: str) -> dict:
    """One job of `side` (mixed, blind, fast); its step times and estimates by step."""
    profile = tiny_profile(tmp / "profile.json")
    overrides = [
        f"training.steps={steps}",
        "data.seq_len=32",
        f"training.global_batch_size={BATCH}",
        "training.microbatch_size=2",
        f"training.paced_devices={factor:g}",
        f"data.cache_dir={tmp / 'cache'}",
        f"checkpoint.dir={tmp / tag / 'ckpt'}",
        f"logging.tensorboard_dir={tmp / tag / 'runs'}",
        f"planning.profile_path={profile}",
        *TINY_PROFILE_OVERRIDES,
    ]
    nodes, speeds, launcher = 4, f"1,1,{slow:g},{slow:g}", []
    if side == "mixed":
        overrides += [
            "planning.profiled_class=fast",
            "planning.classes.fast.speed=1",
            f"planning.classes.slow.speed={slow:g}",
        ]
        launcher = ["--device-classes", "fast,fast,slow,slow"]
    elif side == "fast":
        nodes, speeds = 2, "1"
    cmd = [sys.executable, "-m", "launcher.local", "-v", "--nodes", str(nodes), "--paced-speeds", speeds]
    cmd += [*launcher, "--rdzv-conf", "lease_ttl=2,settle=0.2,last_call_timeout=1", "--"]
    cmd += ["examples/train.py", "--config", "configs/gpt2-tiny.yaml", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900).stdout
    (tmp / f"{tag}.log").write_text(out)
    times, ests = {}, {}
    for m in LINE.finditer(out):
        times[int(m.group(2))] = float(m.group(4))
        if m.group(5):
            ests[int(m.group(2))] = float(m.group(5))
    return {"times": times, "ests": ests, "ok": f"step {steps}/{steps}" in out}


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--tail", type=int, default=12, help="steady-state steps at the end of each run")
    ap.add_argument("--factor", type=float, default=2.0, help="training.paced_devices (k)")
    ap.add_argument("--slow", type=float, default=0.5, help="the slow nodes' speed (the fast ones': 1)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="oobleck-mixed-"))
    print(f"logs in {tmp}", file=sys.stderr)
    estimates: dict[str, list[float]] = {"mixed": [], "blind": [], "fast": []}

    def side(name: str) -> Callable[[], float]:
        repeats = itertools.count()

        def measure() -> float:
            tag = f"{name}-{next(repeats)}"
            got = run(tmp, name, steps=args.steps, factor=args.factor, slow=args.slow, tag=tag)
            tail = [s for s in range(args.steps - args.tail + 1, args.steps + 1) if s in got["times"]]
            samples_s = BATCH * len(tail) / sum(got["times"][s] for s in tail) if tail else 0.0
            est = [got["ests"][s] for s in tail if s in got["ests"]]
            est_samples_s = BATCH * len(est) / sum(est) if est else 0.0
            estimates[name].append(est_samples_s)
            emit(
                {
                    "bench": "mixed",
                    "run": tag,
                    "side": name,
                    "factor": args.factor,
                    "slow_speed": args.slow,
                    "samples_s": round(samples_s, 3),
                    "est_samples_s": round(est_samples_s, 3),
                    "measured_over_estimated": round(samples_s / est_samples_s, 3) if est_samples_s else None,
                    "completed": got["ok"],
                    "tail_steps": len(tail),
                }
            )
            return samples_s

        return measure

    result = alternate({n: side(n) for n in ("mixed", "blind", "fast")}, args.repeats)
    m = {n: result.medians[n] or 0.0 for n in ("mixed", "blind", "fast")}
    est = sorted(estimates["mixed"])[len(estimates["mixed"]) // 2] if estimates["mixed"] else 0.0
    emit(
        {
            "bench": "mixed",
            "compare": "mixed / blind, mixed / fast",
            "samples_s": {n: round(v, 3) for n, v in m.items()},
            "mixed_over_blind": round(m["mixed"] / m["blind"], 3) if m["blind"] else None,
            "mixed_over_fast": round(m["mixed"] / m["fast"], 3) if m["fast"] else None,
            "mixed_measured_over_estimated": round(m["mixed"] / est, 3) if est else None,
            "goals": {"mixed_over_blind": 1.2, "mixed_over_fast": 1.0, "estimate_within": 0.1},
        }
    )


BENCH = Bench(main, quick=None)
