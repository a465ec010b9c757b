"""The cost of one replica check (engine/resilience/fingerprint.py) beside the cost of one step.

Method. One process builds a model's layers (`configs/<model>.yaml`), trains `--steps` steps of
the single-process reference (so every parameter has its AdamW moments), then times
`fingerprints()` over every layer's parameters and optimizer state, `--repeats` times (the
median), against the median time of those steps. The all-gather that shares the table is
num_layers x 3 int64 per worker and is not counted. A job checks every
fault_tolerance.fingerprint_interval_steps steps, and each worker fingerprints only its stage, so
per step a worker pays about check_s x stage share / interval.

One JSON line per model:

    {"bench": "fingerprint", "model": "gpt2-tiny", "bytes": ..., "check_s": ..., "gb_per_s": ...,
     "step_s": ..., "check_over_step": ...}

Run (a minute on 2 cores): .venv/bin/python -m bench fingerprint [--models gpt2-tiny gpt2-small]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Optional

from bench.harness import Bench, emit


from oobleck_elastic.config import load_config
from oobleck_elastic.engine.resilience.fingerprint import fingerprints, layer_tensors
from oobleck_elastic.engine.reference import single_process
from oobleck_elastic.testing import RandomTokens

ROOT = Path(__file__).resolve().parents[1]


def measure(model: str, *, steps: int, repeats: int, seq_len: int) -> dict:
    cfg = load_config(
        ROOT / f"configs/{model}.yaml",
        [
            f"data.seq_len={seq_len}",
            "training.global_batch_size=4",
            "training.microbatch_size=2",
            "training.compile=false",
        ],
    )
    trainer = single_process(cfg, dataset=RandomTokens(n=64, seq_len=seq_len, vocab=cfg.model.vocab_size))
    try:
        step_s = []
        for step in range(steps):
            step_s.append(trainer.train_step(step).seconds)
        tensors = {i: layer_tensors(trainer.layer_model.layers[i], trainer.optimizer) for i in trainer.owned}
        size = sum(t.numel() * t.element_size() for ts in tensors.values() for t in ts)
        check_s = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fingerprints(tensors)
            check_s.append(time.perf_counter() - t0)
    finally:
        trainer.close()
    check, step = statistics.median(check_s), statistics.median(step_s[1:] or step_s)
    return {
        "bench": "fingerprint",
        "model": model,
        "seq_len": seq_len,
        "bytes": size,
        "check_s": round(check, 4),
        "gb_per_s": round(size / check / 1e9, 2),
        "step_s": round(step, 4),
        "check_over_step": round(check / step, 3),
    }


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2-tiny", "gpt2-small"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=64)
    args = ap.parse_args(argv)
    for model in args.models:
        emit(measure(model, steps=args.steps, repeats=args.repeats, seq_len=args.seq_len))


BENCH = Bench(main, quick=("--models", "gpt2-tiny", "--steps", "2", "--repeats", "1"))
