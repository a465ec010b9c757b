"""Pipeline schedules on paced devices: each schedule's measured step against the planner's estimate.

Four workers on this machine's cores share them, so a pipeline bubble is filled by another
worker's arithmetic and no schedule can be told from another by its speed. On paced devices
(`training.paced_devices` = k, engine/stage/paced.py) every forward and backward (input and weight
gradient, when split) of one microbatch on a stage is padded by a sleep to k x the plan's time
for that stage's layers, so each worker behaves like a device of its own and a schedule's bubble
shows in the step time.

Method. One 4-stage pipeline on 4 simulated nodes (`python -m launcher.local --nodes 4`, one
worker each, its own etcd each run), m = p = 4 microbatches of 2 (global batch 8), f = 0,
`--steps` steps. Model: configs/gpt2-tiny.yaml with 6 blocks (8 layers). Profile: the synthetic
one the tests use (`oobleck_elastic.testing.uniform_profile`: 10 ms forward, 20 ms backward per
layer, no activations; 0.5 GiB of state per layer on 1 GiB devices, so 2 layers per device and
exactly one 4-stage pipeline of 2 layers per stage; `--profile uneven`: the same with
`UNEVEN_FORWARD_S`, whose slowest stage is the second, where the closed form of 1F1B and the
simulation differ), given to the job as
`planning.profile_path`, so the job's plan and the pace are made of these numbers. The real
arithmetic of two tiny blocks on a microbatch is a few ms, stretched by the sharing; at the
default k = 2 a stage's forward is paced to 40 ms and its backward to 80 ms, so the real part is
a small share of every pass (a pass that overruns its target logs `paced_overrun`, counted here).
The schedules given (`--schedules`, default 1f1b and gpipe; `name/chunks` for a chunk count,
e.g. `zero-bubble/2`; interleaved-1f1b and zbv run 2 chunks, the others 1; one the engine refuses,
planning/schedules/choice.py's ENGINE_RUNS, is skipped with a line) run alternately, `--repeats`
times each, one job at a time.

The estimate, and what is honest about it. The job's plan is made from the unscaled profile, and
its workers pace to k x its stage times. The estimate comparable with the paced run is the plan
`plan_job` makes for the same config from the profile with every layer's time x k (the paced
devices' profile), communication counted as configured (planning.count_communication and the
links; the synthetic profile has no activation bytes, so a send costs the link latency only);
the bench checks that this plan cuts the stages as the job's does (`same_stages`). What the
estimate leaves out, and the measurement includes: the real sends between the workers (gloo over
loopback, unpaced), the last stage's loss, the step's collectives (tied-weight gradient sum, norm,
commit) and the optimizer step, none of them paced.

Reported per run: `step_s`, the median over the steps after `--warmup` of the rank-0 worker's
step time (`train_step`, first forward to applied update: the `seconds` of its `step` event
lines, logging.events_dir); `wall_s`, the median time between consecutive step lines; `est_s`,
the plan's estimate (1f1b and gpipe: templates.py's closed form; the others simulated); `ratio` =
step_s / est_s (goal: within 10 %, 0.9 .. 1.1); `sim_s`, the simulator's step for the same stages
(planning/schedules/cost.py), and in the summary `sim_ratio` = step_s / sim_s; `samples_s` = global
batch / step_s; `vs_1f1b` = samples_s / that of the same repeat's 1f1b run; `overruns`: the
stages in which some paced pass took longer than its target (each logs `paced_overrun` once;
should be 0). A summary line per schedule gives the medians (`vs_1f1b` of the medians).

`--compile`: the same with compiled layers (`training.compile=true`, in the jobs and in the
estimates), by default zero-bubble against 1F1B. Compiled layers run zero-bubble's split backward
through separate input- and weight-gradient graphs (engine/stage/split_layer.py); on paced devices
each pass is padded to the plan's time, so the schedule's bubble shows and the compiled arithmetic
(a few ms on these tiny layers) is a small share of each pass. The workers share one inductor
cache (the run's `data.cache_dir`), so only the first job compiles cold.

Run (about 1 min per job on 2 cores, 1-2 min compiled):

    python -m bench schedules [--schedules 1f1b gpipe zero-bubble/2 zbv] [--repeats 3] [--steps 20]
        [--warmup 5] [--factor 2] [--profile uniform|uneven] [--compile]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from bench.harness import Bench, emit


from oobleck_elastic.config import load_config
from oobleck_elastic.logs import read_event_lines
from oobleck_elastic.planning import ModelProfile, plan_job
from oobleck_elastic.planning.job import links_for
from oobleck_elastic.planning.schedules.choice import ENGINE_RUNS
from oobleck_elastic.planning.schedules.cost import schedule_cost
from oobleck_elastic.testing import uniform_profile

ROOT = Path(__file__).resolve().parents[1]

NODES = 4
MICROBATCH = 2
BATCH = NODES * MICROBATCH  # m = p microbatches
OVERRIDES = [
    "model.num_layers=6",  # 8 layers: 2 per stage
    "data.seq_len=64",
    f"training.global_batch_size={BATCH}",
    f"training.microbatch_size={MICROBATCH}",
    "fault_tolerance.f=0",
    "planning.device_memory_gb=1.0",
    "planning.memory_margin=0",
]
CHUNKS = {"interleaved-1f1b": 2, "zbv": 2}
"""Chunks per device a schedule runs here unless its name says (`zero-bubble/2`; the others: 1);
2 chunks put one layer in each of 8 virtual stages."""


def parse(spec: str) -> tuple[str, int]:
    """`zero-bubble/2` -> ("zero-bubble", 2); a bare name runs CHUNKS' count, else 1."""
    name, _, chunks = spec.partition("/")
    return name, int(chunks) if chunks else CHUNKS.get(name, 1)


def schedule_overrides(spec: str) -> list[str]:
    name, chunks = parse(spec)
    return [f"planning.schedule={name}", f"planning.chunks_per_device={chunks}"]


def scaled(profile: ModelProfile, factor: float) -> ModelProfile:
    """The paced devices' profile: every layer's times x `factor`, bytes unchanged."""
    layers = [
        dataclasses.replace(la, forward_s=la.forward_s * factor, backward_s=la.backward_s * factor)
        for la in profile.layers
    ]
    return dataclasses.replace(profile, layers=layers)


UNEVEN_FORWARD_S = (0.004, 0.010, 0.010, 0.016, 0.010, 0.010, 0.010, 0.010)
"""`--profile uneven`: per layer forward (backward twice it); stage 1 (layers 2-3) the slowest."""


def bench_profile(kind: str) -> ModelProfile:
    """The synthetic profile: 8 layers of 0.5 GiB state, no activations; `uniform`: 10 ms forward,
    20 ms backward each; `uneven`: UNEVEN_FORWARD_S."""
    profile = uniform_profile(NODES * 2, gib_per_layer=0.5)
    if kind == "uniform":
        return profile
    layers = [dataclasses.replace(la, forward_s=f, backward_s=2 * f) for la, f in zip(profile.layers, UNEVEN_FORWARD_S)]
    return dataclasses.replace(profile, layers=layers)


def estimate(schedule: str, profile: ModelProfile, factor: float, extra: list[str]) -> tuple[float, float, bool]:
    """The planner's step estimate on the paced devices (its plan's), the simulator's for the same
    stages (planning/schedules/cost.py), and whether the plan's stages are the job's (`extra`: the
    run's further overrides)."""
    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", [*OVERRIDES, *extra, *schedule_overrides(schedule)])
    paced_profile = scaled(profile, factor)
    paced = plan_job(cfg, nodes=NODES, profile=paced_profile, engine_only=False).plan
    job = plan_job(cfg, nodes=NODES, profile=profile, engine_only=False).plan

    def cut(plan):
        return [[s.layer_ranges() for s in p.stages] for p in plan.pipelines]

    assert len(paced.pipelines) == 1 and len(paced.pipelines[0].stages) == NODES, cut(paced)
    pipe = paced.pipelines[0]
    if pipe.num_chunks > 1:  # the plan's estimate is the simulation of its virtual stages already
        return paced.est_step_time_s, pipe.est_time_s, cut(paced) == cut(job)
    ranges = [r for device in cut(paced)[0] for r in device]
    sim = schedule_cost(paced_profile, ranges, parse(schedule)[0], pipe.microbatches, links=links_for(cfg))
    return paced.est_step_time_s, sim.step_s, cut(paced) == cut(job)


def launch(tmp: Path, tag: str, overrides: list[str], nodes: int = NODES) -> subprocess.CompletedProcess:
    """One job of gpt2-tiny with `overrides` on `nodes` simulated nodes (`python -m launcher.local`,
    one worker each, one intra-op thread each, its own etcd), to its end; its output goes to
    `<tmp>/<tag>.log`."""
    cmd = [
        sys.executable,
        "-m",
        "launcher.local",
        "-v",  # every node line: this reads them
        "--nodes",
        str(nodes),
        "--rdzv-conf",
        "lease_ttl=2,settle=0.2,last_call_timeout=1",
        "--",
        "examples/train.py",
        "--config",
        "configs/gpt2-tiny.yaml",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    (tmp / f"{tag}.log").write_text(proc.stdout + proc.stderr)
    return proc


def run(tmp: Path, *, schedule: str, factor: float, steps: int, tag: str, extra: list[str]) -> dict:
    profile = tmp / "profile.json"
    events = tmp / tag / "events"
    events.mkdir(parents=True)
    overrides = [
        *OVERRIDES,
        *extra,
        *schedule_overrides(schedule),
        f"training.paced_devices={factor}",
        f"training.steps={steps}",
        f"data.cache_dir={tmp / 'cache'}",
        f"checkpoint.dir={tmp / tag / 'ckpt'}",
        f"logging.tensorboard_dir={tmp / tag / 'runs'}",
        f"logging.events_dir={events}",
        f"planning.profile_path={profile}",
    ]
    proc = launch(tmp, tag, overrides)
    lines = read_event_lines(events, ["step", "paced_overrun"])
    steps_seen = [e for e in lines if e["event"] == "step"]
    return {
        "ok": proc.returncode == 0 and any(e.get("step") == steps for e in steps_seen),
        "seconds": {int(e["step"]): float(e["seconds"]) for e in steps_seen},
        "t": {int(e["step"]): float(e["t"]) for e in steps_seen},
        "overruns": sum(1 for e in lines if e["event"] == "paced_overrun"),
        "tail": (proc.stdout + proc.stderr).strip().splitlines()[-1:],
    }


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedules", nargs="+", help="default: 1f1b gpipe; with --compile 1f1b zero-bubble")
    ap.add_argument("--compile", action="store_true", help="compiled layers (training.compile=true)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out at the start of each run")
    ap.add_argument("--factor", type=float, default=2.0, help="training.paced_devices")
    ap.add_argument("--profile", choices=["uniform", "uneven"], default="uniform")
    args = ap.parse_args(argv)
    args.schedules = args.schedules or (["1f1b", "zero-bubble"] if args.compile else ["1f1b", "gpipe"])
    extra = ["training.compile=true"] if args.compile else []  # read by its jobs and its estimates
    tmp = Path(tempfile.mkdtemp(prefix="oobleck-schedules-"))
    print(f"logs in {tmp}", file=sys.stderr)
    profile = bench_profile(args.profile)
    profile.save(tmp / "profile.json")
    runnable = []
    for schedule in args.schedules:
        if parse(schedule) not in ENGINE_RUNS:
            emit({"bench": "schedules", "schedule": schedule, "skipped": "the engine does not run it yet"})
        else:
            runnable.append(schedule)
    est = {s: estimate(s, profile, args.factor, extra) for s in runnable}
    results: dict[str, list[dict]] = {s: [] for s in runnable}
    for i in range(args.repeats):
        for schedule in runnable:
            tag = f"{schedule.replace('/', '-')}-{i}"
            got = run(tmp, schedule=schedule, factor=args.factor, steps=args.steps, tag=tag, extra=extra)
            kept = [s for s in range(args.warmup + 1, args.steps + 1) if s in got["seconds"]]
            step_s = statistics.median(got["seconds"][s] for s in kept) if kept else float("nan")
            walls = [got["t"][s] - got["t"][s - 1] for s in kept if s - 1 in got["t"]]
            results[schedule].append({"step_s": step_s, "overruns": got["overruns"]})
            ref = results["1f1b"][i]["step_s"] if len(results.get("1f1b", [])) > i else None
            emit(
                {
                    "bench": "schedules",
                    "run": f"{schedule}-{i}",
                    "schedule": schedule,
                    "compile": args.compile,
                    "factor": args.factor,
                    "profile": args.profile,
                    "step_s": round(step_s, 4),
                    "wall_s": round(statistics.median(walls), 4) if walls else None,
                    "est_s": round(est[schedule][0], 4),
                    "ratio": round(step_s / est[schedule][0], 3),
                    "sim_s": round(est[schedule][1], 4),
                    "samples_s": round(BATCH / step_s, 2),
                    "vs_1f1b": round(ref / step_s, 3) if ref else None,  # this repeat's 1f1b run
                    "overruns": got["overruns"],
                    "steps_kept": len(kept),
                    "completed": got["ok"],
                    "same_stages": est[schedule][2],
                    **({} if got["ok"] else {"last_line": got["tail"]}),
                }
            )
    base = statistics.median(BATCH / r["step_s"] for r in results["1f1b"]) if results.get("1f1b") else None
    for schedule, runs in results.items():
        step_s = statistics.median(r["step_s"] for r in runs)
        sps = BATCH / step_s
        emit(
            {
                "bench": "schedules",
                "summary": schedule,
                "compile": args.compile,
                "factor": args.factor,
                "runs": len(runs),
                "step_s": round(step_s, 4),
                "profile": args.profile,
                "est_s": round(est[schedule][0], 4),
                "ratio": round(step_s / est[schedule][0], 3),
                "sim_s": round(est[schedule][1], 4),
                "sim_ratio": round(step_s / est[schedule][1], 3),
                "samples_s": round(sps, 2),
                "vs_1f1b": round(sps / base, 3) if base else None,
                "overruns": sum(r["overruns"] for r in runs),
                "goal": "ratio within 0.9 .. 1.1",
            }
        )


BENCH = Bench(main, quick=None)
