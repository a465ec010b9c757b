"""Tokens per second and MFU, side by side in one run: the engine against a compiled plain loop,
a nanoGPT-style model and the matrix-multiply ceiling of the same device.

Sides (each prints one JSON line: tokens/s, TFLOP/s per device, MFU when the device's peak is
known (engine/telemetry/mfu.py), peak memory, compile time = first steps' excess over the median):

- `ceiling`: the device's matrix-multiply throughput, measured here: a (tokens × H) @ (H × 4H)
  product, the MLP's shape, in the training precision. tokens/s of a side ÷ (ceiling TFLOP/s ÷
  FLOPs per token) is the fraction of the GEMM ceiling it reaches.
- `engine_eager`: the engine's worker step (`Trainer.train_step` of a one-worker plan, loss and
  norm read once at the commit, fused AdamW), layers eager (`training.compile=false`).
- `engine`: the same with compiled layers (`training.compile=true`: one graph per kind of layer).
- `plain`: what a user writes for one device: the same layers as one `nn.Sequential`, the whole
  model compiled (`torch.compile(model)`), fused AdamW, `clip_grad_norm_`, the loss read at the end.
- `nanogpt`: a nanoGPT-style GPT-2 written here (fused QKV, `scaled_dot_product_attention`,
  tied head), compiled, same batch, same optimizer (GPT-2 family only).

The engine cannot hold two single-process trainers at once, so the two engine sides run one after
the other; `plain` and `nanogpt` alternate with the engine in rounds (`--rounds`, the first side
alternating). Ratios printed: engine ÷ plain, engine ÷ engine_eager, each side ÷ ceiling.

    python -m bench gpu_mfu                       # CUDA: gpt2-small (vocab 50304, seq 1024), bf16
    python -m bench gpu_mfu --model llama-1b      # CUDA: a ~1 B Llama at seq 2048
    python -m bench gpu_mfu                       # CPU: a small GPT-2 (what CI machines can show)
    python -m bench gpu_mfu --model cpu-tiny --eager   # the path alone, in seconds (gpu_checks' dry run)

`--eager` compiles no side (the engine's two sides both eager, `plain` and `nanogpt` not wrapped in
`torch.compile`): a dry run of the bench's path on a CPU, whose ratios say nothing of compilation.
The last line also names the schedule of the engine's plan (one stage on one device: `1f1b`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

from bench.harness import Bench, emit

import torch
import torch.nn.functional as F
from torch import nn


from oobleck_elastic.config import load_config
from oobleck_elastic.engine.step.loss import token_sum_loss
from oobleck_elastic.engine.telemetry.memory import peak_device_bytes, peak_rss_bytes
from oobleck_elastic.engine.telemetry.mfu import device_peak_tflops, flops_per_token
from oobleck_elastic.engine.step.optim import build_optimizer, set_lr
from oobleck_elastic.engine.reference import single_process
from oobleck_elastic.models import build_layer_model, num_layers

ROOT = Path(__file__).resolve().parents[1]

MODELS = {
    "gpt2-small": [
        "model.family=gpt2",
        "model.vocab_size=50304",
        "model.hidden_size=768",
        "model.num_layers=12",
        "model.num_heads=12",
        "model.max_seq_len=1024",
        "data.seq_len=1024",
        "training.global_batch_size=64",
        "training.microbatch_size=16",
    ],
    "llama-1b": [
        "model.family=llama",
        "model.vocab_size=32000",
        "model.hidden_size=2048",
        "model.num_layers=16",
        "model.num_heads=32",
        "model.num_kv_heads=8",
        "model.intermediate_size=5632",
        "model.tie_embeddings=false",
        "model.max_seq_len=2048",
        "data.seq_len=2048",
        "training.global_batch_size=16",
        "training.microbatch_size=4",
    ],
    "cpu-tiny": [
        "model.family=gpt2",
        "model.vocab_size=256",
        "model.hidden_size=64",
        "model.num_layers=1",
        "model.num_heads=2",
        "model.max_seq_len=32",
        "data.seq_len=32",
        "training.global_batch_size=4",
        "training.microbatch_size=2",
    ],
    "cpu-tiny-llama": [
        "model.family=llama",
        "model.vocab_size=256",
        "model.hidden_size=64",
        "model.num_layers=1",
        "model.num_heads=2",
        "model.num_kv_heads=1",
        "model.intermediate_size=128",
        "model.tie_embeddings=false",
        "model.max_seq_len=32",
        "data.seq_len=32",
        "training.global_batch_size=4",
        "training.microbatch_size=2",
    ],
    "cpu-gpt2": [
        "model.family=gpt2",
        "model.vocab_size=4096",
        "model.hidden_size=256",
        "model.num_layers=4",
        "model.num_heads=4",
        "model.max_seq_len=256",
        "data.seq_len=256",
        "training.global_batch_size=16",
        "training.microbatch_size=4",
    ],
}


class Tokens(torch.utils.data.Dataset):
    """Random token windows (data cost kept out of the comparison; the prefetcher hides it anyway)."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (n, seq_len + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i, :-1], self.data[i, 1:]


class NanoGPT(nn.Module):
    """nanoGPT's GPT-2, as compact as it is there."""

    def __init__(self, vocab: int, h: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    ln1=nn.LayerNorm(h),
                    qkv=nn.Linear(h, 3 * h),
                    proj=nn.Linear(h, h),
                    ln2=nn.LayerNorm(h),
                    fc=nn.Linear(h, 4 * h),
                    out=nn.Linear(4 * h, h),
                )
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)
        self.head.weight = self.wte.weight
        for p in self.parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).split(x.shape[-1], dim=2)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
            x = x + blk["proj"](y)
            x = x + blk["out"](F.gelu(blk["fc"](blk["ln2"](x)), approximate="tanh"))
        return self.head(self.ln_f(x))


class Loop:
    """A compiled single-device loop over `model` (the `plain` and `nanogpt` sides)."""

    def __init__(self, cfg, model: nn.Module, dataset, device: torch.device, *, eager: bool = False) -> None:
        self.cfg, self.dataset, self.device = cfg, dataset, device
        self.model = model if eager else torch.compile(model)
        self.opt = build_optimizer(model.parameters(), cfg.training)
        t = cfg.training
        self.loss_fn = token_sum_loss(
            t.global_batch_size * dataset[0][0].shape[-1],
            lean_bf16=t.precision == "bf16",
            vocab_size=cfg.model.vocab_size,
        )
        self.dtype = torch.bfloat16 if t.precision == "bf16" else None

    def step(self, step: int) -> float:
        t = self.cfg.training
        idx = torch.arange(step * t.global_batch_size, (step + 1) * t.global_batch_size) % len(self.dataset)
        x = self.dataset.data[idx, :-1].to(self.device, non_blocking=True)
        y = self.dataset.data[idx, 1:].to(self.device, non_blocking=True)
        total = torch.zeros((), device=self.device)
        with torch.autocast(self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None):
            for i in range(0, x.shape[0], t.microbatch_size):
                loss = self.loss_fn(self.model(x[i : i + t.microbatch_size]), y[i : i + t.microbatch_size])
                loss.backward()
                total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.optimizer.grad_clip, foreach=True)
        set_lr(self.opt, step, t)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(total)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], object]) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def gemm_ceiling(device: torch.device, tokens: int, h: int, dtype: torch.dtype, repeats: int) -> float:
    """TFLOP/s of a (tokens × h) @ (h × 4h) matrix multiply, the median of `repeats`."""
    a = torch.randn(tokens, h, device=device, dtype=dtype)
    b = torch.randn(h, 4 * h, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    times = [timed(device, lambda: a @ b) for _ in range(repeats)]
    return 2 * tokens * h * 4 * h / statistics.median(times) / 1e12


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", choices=sorted(MODELS), default=None, help="gpt2-small on CUDA, cpu-gpt2 on the CPU by default"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per side per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side first (compilation)")
    ap.add_argument("--eager", action="store_true", help="compile no side (a dry run of the path: docstring)")
    ap.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu: the CPU even where CUDA is")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and args.device == "auto"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    name = args.model or ("gpt2-small" if device.type == "cuda" else "cpu-gpt2")
    precision = "bf16" if device.type == "cuda" else "fp32"
    cfg = load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [*MODELS[name], f"training.precision={precision}", "data.cache_dir=/tmp/gpu_mfu_cache", *args.overrides],
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    t = cfg.training
    seq = cfg.data.seq_len
    dataset = Tokens(64 * t.global_batch_size, seq, cfg.model.vocab_size)
    tokens = t.global_batch_size * seq
    fpt = flops_per_token(cfg)
    peak = device_peak_tflops(device, precision, t.peak_tflops)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    ceiling = gemm_ceiling(device, t.microbatch_size * seq, cfg.model.hidden_size, dtype, 10)
    base = {
        "bench": "gpu_mfu",
        "model": name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": precision,
        "tokens_per_step": tokens,
        "flops_per_token": fpt,
        "peak_tflops": peak,
    }
    emit(
        {
            **base,
            "side": "ceiling",
            "gemm_tflops": round(ceiling, 3),
            "tokens_per_s_at_ceiling": round(ceiling * 1e12 / fpt),
        }
    )

    results: dict[str, list[float]] = {}
    first: dict[str, list[float]] = {}

    def engine_side(compile_on: bool) -> Callable[[int], object]:
        c = load_config(
            ROOT / "configs/gpt2-tiny.yaml",
            [
                *MODELS[name],
                f"training.precision={precision}",
                f"training.compile={str(compile_on and not args.eager).lower()}",
                "data.cache_dir=/tmp/gpu_mfu_cache",
                *args.overrides,
            ],
        )
        trainer = single_process(c, dataset=dataset, device=device)
        assert trainer.plan is not None
        schedules.update(p.schedule for p in trainer.plan.pipelines)
        sides_open.append(trainer)
        return lambda s: trainer.train_step(s)

    def plain_side() -> Callable[[int], object]:
        layers = build_layer_model(cfg.model, seed=t.seed, device=device).stage(0, num_layers(cfg.model))
        loop = Loop(cfg, layers, dataset, device, eager=args.eager)
        return loop.step

    def nano_side() -> Callable[[int], object]:
        m = cfg.model
        with torch.device(device):
            model = NanoGPT(m.vocab_size, m.hidden_size, m.num_layers, m.num_heads, seq)
        return Loop(cfg, model, dataset, device, eager=args.eager).step

    def run(sides: dict[str, Callable[[int], object]]) -> None:
        for label, fn in sides.items():
            first[label] = [timed(device, lambda s=s, f=fn: f(s)) for s in range(args.warmup)]
            results.setdefault(label, [])
        step = args.warmup
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for label in order:
                for _ in range(args.steps):
                    results[label].append(timed(device, lambda s=step, f=sides[label]: f(s)))
                    step += 1

    sides_open: list = []
    schedules: set[str] = set()
    for compile_on in (False, True):  # one engine at a time (a single process holds one)
        label = "engine" if compile_on else "engine_eager"
        sides = {label: engine_side(compile_on)}
        if compile_on:
            sides["plain"] = plain_side()
            if cfg.model.family == "gpt2":
                sides["nanogpt"] = nano_side()
        run(sides)
        sides_open.pop().close()
    med = {k: statistics.median(v) for k, v in results.items()}
    for label, m in med.items():
        tps = tokens / m
        achieved = tps * fpt / 1e12
        emit(
            {
                **base,
                "side": label,
                "median_step_s": round(m, 5),
                "tokens_per_s": round(tps),
                "tflops": round(achieved, 4),
                "mfu": round(achieved / peak, 4) if peak else None,
                "fraction_of_gemm_ceiling": round(achieved / ceiling, 4),
                "compile_s": round(max(0.0, sum(first[label]) - len(first[label]) * m), 2),
                "steps": len(results[label]),
            }
        )
    ratios = {
        "engine_over_plain": med["engine"] and med["plain"] / med["engine"],
        "engine_over_engine_eager": med["engine_eager"] / med["engine"],
    }
    if "nanogpt" in med:
        ratios["engine_over_nanogpt"] = med["nanogpt"] / med["engine"]
    emit(
        {
            **base,
            "figure": "ratios (throughput, > 1 = the engine is faster)",
            **{k: round(v, 4) for k, v in ratios.items()},
            "peak_memory_gb": round((peak_device_bytes(device) or peak_rss_bytes()) / 2**30, 3),
            "schedule": ",".join(sorted(schedules)),
            "compiled": not args.eager,
        }
    )
    assert math.isfinite(ratios["engine_over_plain"])


BENCH = Bench(main, quick=("--rounds", "1", "--steps", "2", "--warmup", "1"))
