"""Shadow copies' failure-free overhead: the same job with fault_tolerance.shadow_copies = 0 and 1.

Method. Four simulated nodes (`python -m launcher.local --nodes 4`, one worker each, its own etcd
each run), f = 1: two pipelines of two stages, every layer on two nodes' devices and, with
shadows, in the host memory of one more (engine/step/shadows.py: every step the holders send
the summed gradients of each layer to its keeper before the commit, and the keeper applies AdamW to
its copy in a thread of its own). Model: configs/gpt2-tiny.yaml widened to `--hidden` (default
256: 6 blocks, about 5 M parameters, 20 MB of fp32 weights, so 20 MB of gradients sent and 20 MB of
weights updated on the keepers each step), sequences of 64, global batch 16 in microbatches of 2.
The workers run on paced devices (`training.paced_devices` = `--factor`, engine/stage/paced.py):
every pass of a stage is padded to k x the synthetic profile's time (10 ms forward, 20 ms backward
per layer), so four workers on this machine's two cores behave like four devices and the shadows'
real work (gradients to the host, the sends, the host AdamW) is what the comparison measures. The
two settings run alternately, `--repeats` times each, one job at a time.

Reported per run: `step_s`, the median over the steps after `--warmup` of the rank-0 worker's
step time (the `seconds` of its `step` events); per setting in the summary the median over its
runs, and `overhead` = step_s(shadows) / step_s(no shadows) - 1 (goal: at most 3 %).

Run (about 1 min per job on 2 cores):

    .venv/bin/python -m bench shadows [--repeats 3] [--steps 16] [--warmup 4] [--factor 2] [--hidden 256]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
from pathlib import Path
from typing import Callable, Optional

from bench.harness import Bench, alternate, emit
from bench.schedules import launch

from oobleck_elastic.logs import read_event_lines
from oobleck_elastic.testing import uniform_profile

ROOT = Path(__file__).resolve().parents[1]

NODES = 4
LAYERS = 8  # embedding, 6 blocks, head: 4 per stage


def run(tmp: Path, *, shadows: int, args: argparse.Namespace, tag: str) -> dict:
    events = tmp / tag / "events"
    events.mkdir(parents=True)
    overrides = [
        "model.num_layers=6",
        f"model.hidden_size={args.hidden}",
        "data.seq_len=64",
        "training.global_batch_size=16",
        "training.microbatch_size=2",
        "fault_tolerance.f=1",
        f"fault_tolerance.shadow_copies={shadows}",
        "planning.device_memory_gb=1.0",
        "planning.memory_margin=0",
        "planning.host_memory_gb=64",
        f"training.paced_devices={args.factor}",
        f"training.steps={args.steps}",
        f"data.cache_dir={tmp / 'cache'}",
        f"checkpoint.dir={tmp / tag / 'ckpt'}",
        f"logging.tensorboard_dir={tmp / tag / 'runs'}",
        f"logging.events_dir={events}",
        f"planning.profile_path={tmp / 'profile.json'}",
    ]
    proc = launch(tmp, tag, overrides, nodes=NODES)
    steps = [e for e in read_event_lines(events, ["step"]) if e["event"] == "step"]
    seconds = {int(e["step"]): float(e["seconds"]) for e in steps}
    kept = [s for step, s in sorted(seconds.items()) if step > args.warmup]
    return {
        "ok": proc.returncode == 0 and max(seconds, default=0) == args.steps,
        "step_s": statistics.median(kept) if kept else None,
        "tail": (proc.stdout + proc.stderr).strip().splitlines()[-1:],
    }


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-shadows-") as d:
        tmp = Path(d)
        uniform_profile(LAYERS, gib_per_layer=0.25).save(tmp / "profile.json")

        def setting(shadows: int) -> Callable[[], list[float]]:
            repeats = itertools.count()

            def measure() -> list[float]:  # one job: its step time, none if it did not complete
                r = next(repeats)
                out = run(tmp, shadows=shadows, args=args, tag=f"s{shadows}-r{r}")
                emit({"bench": "shadows", "shadow_copies": shadows, "repeat": r, "hidden": args.hidden, **out})
                return [out["step_s"]] if out["ok"] and out["step_s"] is not None else []

            return measure

        result = alternate({"off": setting(0), "on": setting(1)}, args.repeats)
    off, on = result.medians["off"], result.medians["on"]
    if off is not None and on is not None:
        emit(
            {
                "bench": "shadows",
                "summary": True,
                "hidden": args.hidden,
                "factor": args.factor,
                "step_s_off": off,
                "step_s_on": on,
                "overhead": on / off - 1,
            }
        )


BENCH = Bench(main, quick=None)
