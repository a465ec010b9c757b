"""A worker's memory and start-up grow with its stage, not with the model.

Method. For each case, one world of S gloo ranks (fresh processes, `torch.set_num_threads(1)`)
enters a one-pipeline plan of S stages of the same GPT-2-like model (`Trainer(cfg, plan=...)`,
the generation entry every worker of a job runs), then trains one step. Each rank records:

- `rss_start`: its resident memory before it built anything (torch and transformers imported);
- `peak_before_step`: its peak resident memory (VmHWM) once it entered, before its first step:
  what a worker needs to start;
- `peak_after_step`: its peak after one step (AdamW moments, gradients and activations added);
- `held`: bytes of its parameters and optimizer state after the step (its stage's training state);
- `start_s`: seconds from the process's start to its first step, and `entry_s` of that in the
  generation entry (building or reading its layers, connecting); `entry_cpu_s`: the CPU seconds
  of the entry (what the start-up costs whatever else shares the cores).

Cases: `--stages 1 2 4` with random initial weights (drawn per layer from the seed) and with a
pretrained Hugging Face directory (written once with `save_pretrained`, sharded; each worker
reads only its layers' tensors). One JSON line per case, with the largest worker's figures and
the model's full parameter bytes:

    {"bench": "memory", "init": "random", "stages": 4, "model_bytes": ..., "max_held_bytes": ...,
     "max_growth_before_step_bytes": ..., "growth_minus_params_bytes": ..., "max_peak_after_step_bytes": ...,
     "max_start_s": ..., "max_entry_s": ...}

`growth_minus_params_bytes` = peak before the first step - resident at start - the worker's stage
parameters: the constant a worker adds whatever the model (the goal: it does not grow with the
stage count or the model). `--startup` runs instead a ~1 B-parameter Llama on 4 stages beside a
0.34 B one on 1 stage (about the size of the largest of those 4 stages) and the ~1 B one on 1
stage: start-up should follow the stage (the first two alike), not the model.

Run (about 3-6 minutes each on 2 cores; `--quick` for a small model):

    python -m bench memory
    python -m bench memory --startup
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from bench.harness import Bench, emit

T0 = time.monotonic()  # before torch is imported: the start of a worker's start-up
ROOT = Path(__file__).resolve().parents[1]

GPT2 = {"family": "gpt2", "blocks": 24, "hidden": 1024, "heads": 16, "vocab": 256}
QUICK = {"family": "gpt2", "blocks": 8, "hidden": 512, "heads": 8, "vocab": 256}
LLAMA_1B = {"family": "llama", "blocks": 16, "hidden": 2048, "heads": 16, "vocab": 32000, "inter": 5632}
LLAMA_QUARTER = {"family": "llama", "blocks": 4, "hidden": 2048, "heads": 16, "vocab": 32000, "inter": 5632}


def overrides(model: dict) -> list[str]:
    over = [
        f"model.family={model['family']}",
        f"model.num_layers={model['blocks']}",
        f"model.hidden_size={model['hidden']}",
        f"model.num_heads={model['heads']}",
        f"model.vocab_size={model['vocab']}",
        "data.seq_len=16",
        "training.global_batch_size=4",
        "training.microbatch_size=1",
        "fault_tolerance.comm_timeout_s=600",
    ]
    if "inter" in model:
        over.append(f"model.intermediate_size={model['inter']}")
    return over


def split(layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal layer ranges."""
    cuts = [round(i * layers / stages) for i in range(stages + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(stages)]


def worker(rank: int, world: int, tmp: str, over: list[str], out: str) -> None:
    import torch
    import torch.distributed as dist

    from oobleck_elastic.testing import RandomTokens, layout_plan
    from oobleck_elastic.config import load_config
    from oobleck_elastic.engine.telemetry import memory
    from oobleck_elastic.engine.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", over)
    layers = cfg.model.num_layers + 2
    plan = layout_plan([split(layers, world)], [4], generation=1, num_layers=layers, microbatch_size=1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    rss_start = memory.current_rss_bytes()
    t_entry, cpu_entry = time.monotonic(), time.process_time()
    trainer = Trainer(
        cfg, dataset=RandomTokens(n=16, seq_len=16, vocab=cfg.model.vocab_size), plan=plan, rank=rank, store=store
    )
    entry_s, entry_cpu_s = time.monotonic() - t_entry, time.process_time() - cpu_entry
    start_s = time.monotonic() - T0
    params = sum(p.numel() * p.element_size() for p in trainer.params)
    peak_before = memory.peak_rss_bytes()
    trainer.train_step(0)
    record = {
        "rank": rank,
        "rss_start": rss_start,
        "peak_before_step": peak_before,
        "peak_after_step": memory.peak_rss_bytes(),
        "held": trainer.state.held_bytes(),
        "params": params,
        "start_s": start_s,
        "entry_s": entry_s,
        "entry_cpu_s": entry_cpu_s,
    }
    Path(out).write_text(json.dumps(record))
    trainer.close()


def model_bytes(over: list[str]) -> int:
    from oobleck_elastic.config import load_config
    from oobleck_elastic.models.build import build_meta_layers

    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", over)
    layers = build_meta_layers(cfg.model, cfg.model.num_layers + 2, seed=0)
    seen = {id(p): p for layer in layers for p in layer.parameters()}
    return sum(p.numel() * 4 for p in seen.values())


def save_pretrained(model: dict, path: Path) -> None:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=model["vocab"],
        n_positions=64,
        n_embd=model["hidden"],
        n_layer=model["blocks"],
        n_head=model["heads"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(path, max_shard_size="200MB")


def run_case(model: dict, stages: int, init: str, pretrained: Path | None) -> dict:
    over = overrides(model) + ([f"model.pretrained_path={pretrained}"] if pretrained else [])
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.memory",
                    "--worker",
                    str(r),
                    str(stages),
                    tmp,
                    os.path.join(tmp, f"r{r}.json"),
                    *over,
                ],
                cwd=ROOT,
            )
            for r in range(stages)
        ]
        codes = [p.wait(timeout=1200) for p in procs]
        if any(codes):
            raise SystemExit(f"a worker failed ({codes}) for {stages} stages, {init}")
        recs = [json.loads(Path(tmp, f"r{r}.json").read_text()) for r in range(stages)]
    return {
        "bench": "memory",
        "init": init,
        "family": model["family"],
        "stages": stages,
        "model_bytes": model_bytes(overrides(model)),
        "max_held_bytes": max(r["held"] for r in recs),
        "max_growth_before_step_bytes": max(r["peak_before_step"] - r["rss_start"] for r in recs),
        "growth_minus_params_bytes": max(r["peak_before_step"] - r["rss_start"] - r["params"] for r in recs),
        "max_peak_after_step_bytes": max(r["peak_after_step"] for r in recs),
        "max_rss_start_bytes": max(r["rss_start"] for r in recs),
        "max_start_s": round(max(r["start_s"] for r in recs), 2),
        "max_entry_s": round(max(r["entry_s"] for r in recs), 2),
        "max_entry_cpu_s": round(max(r["entry_cpu_s"] for r in recs), 2),
    }


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--quick", action="store_true", help="a small model (smoke run)")
    ap.add_argument(
        "--startup",
        action="store_true",
        help="instead: start-up of a ~1 B Llama on 4 and 1 stages and of a 0.34 B one on 1 stage",
    )
    args = ap.parse_args(argv)
    model = QUICK if args.quick else GPT2
    if not args.startup:
        with tempfile.TemporaryDirectory() as tmp:
            pretrained = Path(tmp) / "gpt2"
            save_pretrained(model, pretrained)
            for init in ("random", "pretrained"):
                for stages in args.stages:
                    emit(run_case(model, stages, init, pretrained if init == "pretrained" else None))
    else:
        for model, stages in ((LLAMA_1B, 4), (LLAMA_QUARTER, 1), (LLAMA_1B, 1)):
            emit({**run_case(model, stages, "random", None), "bench": "startup"})


BENCH = Bench(main, quick=("--quick", "--stages", "1"))

if __name__ == "__main__":  # a worker of run_case: python -m bench.memory --worker RANK WORLD TMP OUT [key=value ...]
    rank, world, tmp, out, *over = sys.argv[2:]
    worker(int(rank), int(world), tmp, over, out)
