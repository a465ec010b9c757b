"""One-GPU step time: the engine's worker step against a plain training loop, side by side.

Goal: on one GPU the engine's step (`Trainer.train_step` of a one-worker plan, run the way a
worker runs it: in an abandonable thread, with the gloo control all-reduces for norm, loss and
commit) is within 5 % of a plain PyTorch loop over the same model.

Both sides build the same layers from the same seed on `cuda:0` (the engine through a
generation of one worker: a `cpu:gloo,cuda:nccl` group of world size 1; the plain loop as one
`nn.Sequential` of the same layers) and read the same global batches. The plain loop is what a
user writes: for each microbatch forward (autocast under bf16), token-sum loss, backward; then
`clip_grad_norm_`, AdamW (`foreach`, the default), `zero_grad(set_to_none=True)`. After warm-up,
R rounds alternate a block of S engine steps with a block of S plain steps (the first side
alternates), each step timed from a `cuda.synchronize()` to the next. Printed: one JSON line per
side (median step time, samples/s, tokens/s) and one with the ratio engine/plain.

    python -m bench gpu_step                                  # gpt2-small, bf16
    python -m bench gpu_step training.precision=fp32 --rounds 3 --steps 10
    python -m bench gpu_step --device cpu --config configs/gpt2-tiny.yaml   # the path on a CPU (a dry run)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

from bench.harness import Bench, alternate, emit

import torch
import torch.distributed as dist


from oobleck_elastic.config import load_config
from oobleck_elastic.engine.control import one_worker_plan
from oobleck_elastic.data.dataset import build_dataset
from oobleck_elastic.data.sampler import collate
from oobleck_elastic.engine.step.optim import build_optimizer, set_lr, token_sum_loss
from oobleck_elastic.engine.runner import StepRunner
from oobleck_elastic.engine.trainer import Trainer
from oobleck_elastic.models import build_layer_model

ROOT = Path(__file__).resolve().parents[1]


class PlainLoop:
    """What a user writes for one GPU (see the module docstring)."""

    def __init__(self, cfg, dataset, device: torch.device) -> None:
        t = cfg.training
        self.cfg, self.dataset, self.device = cfg, dataset, device
        self.model = build_layer_model(cfg.model, seed=t.seed, device=device).stage(0, cfg.model.num_layers + 2)
        self.opt = build_optimizer(self.model.parameters(), t)
        self.loss_fn = token_sum_loss(t.global_batch_size * dataset[0][0].shape[-1])
        self.dtype = torch.bfloat16 if t.precision == "bf16" else None

    def step(self, step: int, indices: list[int]) -> float:
        x, y = collate(self.dataset, indices)
        if self.device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        mbs, total = self.cfg.training.microbatch_size, 0.0
        for i in range(0, x.shape[0], mbs):
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                out = self.model(x[i : i + mbs])
            loss = self.loss_fn(out.float(), y[i : i + mbs])
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.training.optimizer.grad_clip)
        set_lr(self.opt, step, self.cfg.training)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/gpt2-small.yaml"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the path alone (a dry run)")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("python -m bench gpu_step needs a CUDA device (--device cpu runs the path on the CPU)")
    cfg = load_config(
        args.config, ["data.source=stdlib", "data.tokenizer=bytes", "model.vocab_size=256", *args.overrides]
    )
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dataset = build_dataset(cfg, log=lambda *_: None)
    t = cfg.training
    plan = one_worker_plan(cfg, cfg.model.num_layers + 2)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store_path = tempfile.mktemp(prefix="gpu_step_store_")
    store = dist.FileStore(store_path, 1)
    engine = Trainer(cfg, dataset=dataset, plan=plan, rank=0, store=store, device=device, timeout=timedelta(seconds=60))
    plain = PlainLoop(cfg, dataset, device)

    def never() -> str | None:
        return None

    runner = StepRunner(device)

    def engine_step(step: int) -> None:
        runner.run(lambda: engine.train_step(step), should_abandon=never, interval_s=0.1)

    def plain_step(step: int) -> None:
        plain.step(step, engine.sampler.indices(step))

    sides = {"engine": engine_step, "plain": plain_step}
    step = 0
    for fn in sides.values():
        for _ in range(args.warmup):
            fn(step)
            step += 1

    def block(fn: Callable[[int], None]) -> Callable[[], list[float]]:
        def measure() -> list[float]:  # a block of S steps
            nonlocal step
            out = []
            for _ in range(args.steps):
                out.append(timed(lambda s=step: fn(s), device))
                step += 1
            return out

        return measure

    result = alternate({name: block(fn) for name, fn in sides.items()}, args.rounds, swap=True)
    times = result.samples
    tokens = t.global_batch_size * dataset[0][0].shape[-1]
    med = {k: statistics.median(v) for k, v in times.items()}
    for name in sides:
        emit(
            {
                "bench": "gpu_step",
                "side": name,
                "config": Path(args.config).stem,
                "precision": t.precision,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "median_step_s": round(med[name], 5),
                "samples_per_s": round(t.global_batch_size / med[name], 1),
                "tokens_per_s": round(tokens / med[name]),
                "steps": len(times[name]),
            }
        )
    emit(
        {
            "bench": "gpu_step",
            "ratio_engine_over_plain": round(result.ratio, 4),
            "overhead_pct": round(100 * (med["engine"] / med["plain"] - 1), 2),
            "p25_ratio": round(
                statistics.quantiles(times["engine"], n=4)[0] / statistics.quantiles(times["plain"], n=4)[0], 4
            ),
        }
    )
    engine.close()
    del store
    if os.path.exists(store_path):
        os.unlink(store_path)
    # the planner's estimate of the same step (one worker, one stage) from the profile measured on this GPU
    from oobleck_elastic.planning import plan_job
    from oobleck_elastic.planning.profile.cache import load_or_profile

    profile = load_or_profile(cfg, device=device, log=lambda *_: None)  # cached under data.cache_dir
    est = plan_job(cfg, nodes=1, profile=profile).plan.est_step_time_s
    emit(
        {
            "bench": "gpu_step",
            "figure": "estimated_vs_measured",
            "precision": t.precision,
            "planner_est_step_s": round(est, 5),
            "engine_measured_step_s": round(med["engine"], 5),
            "ratio_measured_over_estimated": round(med["engine"] / est, 3),
        }
    )


BENCH = Bench(main, quick=("--rounds", "1", "--steps", "2", "--warmup", "1"))
