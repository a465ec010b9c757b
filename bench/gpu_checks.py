"""The one-GPU checks, one JSON line each (`bash bench/gpu_check.sh` runs this; docs/gpu.md).

Every line carries the bench's context (commit, load, torch), `"check"`, the figures measured,
`"verdict"` ("pass" or "fail"), `"bound"` (what the figures were held to) and `"device"`. Stdout
holds these lines and nothing else (everything else goes to stderr); nothing is written to
bench/RESULTS.md. `--dry-run` runs each check's CPU half: the same code with the device swapped
and small sizes (seconds each), so CI proves the script runs before a GPU ever does. Exit status
1 when a check failed. The engine-level checks live in bench/gpu_engine.py.

    python -m bench gpu_checks                 # on one GPU: about 8 minutes (an estimate)
    python -m bench gpu_checks --dry-run       # the CPU half
    python -m bench gpu_checks --dry-run --only adamw_drift group_cycles
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

from bench import gpu_engine
from bench.gpu_engine import Ctx, Verdict
from bench.harness import Bench, context

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the checks that were the shell script's
def job_vs_reference(ctx: Ctx) -> dict[str, Any]:
    """A one-node, one-worker job under the local launcher (on the GPU a `cpu:gloo,cuda:nccl`
    world of one), fp32 and bf16, each against the single-process reference on the same device;
    in a dry run fp32 alone, 3 steps on the CPU."""
    from oobleck_elastic.checkpoint import load_model_state

    steps = 3 if ctx.dry else 30
    common = [f"training.steps={steps}", f"data.cache_dir={ctx.tmp / 'cache'}"]
    common += [f"logging.tensorboard_dir={ctx.tmp / 'tb'}", "checkpoint.interval_steps=1000"]
    if ctx.dry:
        common += ["data.seq_len=16", "training.global_batch_size=4", "training.microbatch_size=2"]
        common += ["training.device=cpu", "model.num_layers=1"]
    out: dict[str, Any] = {"steps": steps}
    worst, same_keys = 0.0, True
    for prec in ("fp32",) if ctx.dry else ("fp32", "bf16"):
        job, ref = ctx.tmp / f"job_{prec}", ctx.tmp / f"ref_{prec}"
        over = ["--config", "configs/gpt2-tiny.yaml", f"training.precision={prec}", *common]
        launcher = [sys.executable, "-m", "launcher.local", "--nodes", "1", "--log-dir", str(ctx.tmp / "runs")]
        launcher += ["--rdzv-conf", "lease_ttl=5,last_call_timeout=0.5", "--", "examples/train.py"]
        _run(ctx, f"job {prec}", [*launcher, *over, f"checkpoint.dir={job}"])
        _run(ctx, f"reference {prec}", [sys.executable, "examples/train.py", *over, f"checkpoint.dir={ref}"])
        a, b = load_model_state(job), load_model_state(ref)
        rel = max(
            float((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max().clamp_min(1e-12)) for k in b
        )
        out[f"max_rel_diff_{prec}"], out["tensors"] = rel, len(b)
        worst, same_keys = max(worst, rel), same_keys and set(a) == set(b)
    out["same_keys"] = same_keys
    out["verdict"] = Verdict(same_keys and worst <= 1e-5, "same tensors; max |job - ref| / max |ref| <= 1e-5 each")
    return out


def _run(ctx: Ctx, label: str, cmd: list[str], timeout: float = 300) -> None:
    """Run `cmd` from the repository root, its output to a log under the scratch folder; raise with
    its tail when it fails."""
    log = ctx.tmp / f"{label.replace(' ', '_')}.log"
    ctx.log(f"{label}: {' '.join(cmd)}")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(log, "w") as f:
        res = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"{label} exited {res.returncode}: {log.read_text()[-3000:]}")


def profile_on_device(ctx: Ctx) -> dict[str, Any]:
    """The planner's per-layer profile measured on the device (gpt2-small, microbatch 4 x 512, bf16
    on the GPU; a tiny model on the CPU)."""
    from oobleck_elastic.planning.profile.cache import load_or_profile

    cfg = gpu_engine.model_cfg(ctx)
    t0 = time.perf_counter()
    prof = load_or_profile(cfg, device=ctx.device, cache_dir=ctx.tmp / "profile", log=ctx.log)
    layers = [
        {
            "layer": layer.name,
            "forward_ms": round(layer.forward_s * 1e3, 3),
            "backward_ms": round(layer.backward_s * 1e3, 3),
            "activation_bytes": layer.activation_bytes,
        }
        for layer in prof.layers
    ]
    ok = all(0 < x["forward_ms"] < math.inf and 0 < x["backward_ms"] < math.inf for x in layers)
    return {
        "layers": layers[:3] + layers[-1:] if len(layers) > 4 else layers,
        "seconds": round(time.perf_counter() - t0, 2),
        "verdict": Verdict(ok, "every layer's forward and backward time > 0 and finite"),
    }


def gpu_step(ctx: Ctx) -> dict[str, Any]:
    """`python -m bench gpu_step`: the engine's worker step against a plain single-device loop,
    alternating (gpt2-small, bf16 on the GPU; gpt2-tiny fp32 on the CPU, where the ratio is not
    held to the GPU's bound: the engine's fixed costs dominate a step of milliseconds)."""
    from bench import gpu_step as bench_step

    args = ["--rounds", "3", "--steps", "5", "--warmup", "2"]
    if ctx.dry:
        args = ["--device", "cpu", "--config", str(ROOT / "configs/gpt2-tiny.yaml"), "--rounds", "1", "--steps", "2"]
        args += ["--warmup", "1", "data.seq_len=16", "training.global_batch_size=4", "model.num_layers=1"]
    args.append(f"data.cache_dir={ctx.tmp / 'cache'}")
    lines = _lines_of(lambda: bench_step.main(args))
    ratio = next(x for x in lines if "ratio_engine_over_plain" in x)
    est = next((x for x in lines if x.get("figure") == "estimated_vs_measured"), {})
    bound = 1.05
    return {
        "precision": est.get("precision"),
        "sides": {x["side"]: x["median_step_s"] for x in lines if "side" in x},
        "ratio_engine_over_plain": ratio["ratio_engine_over_plain"],
        "ratio_measured_over_estimated": est.get("ratio_measured_over_estimated"),
        "verdict": Verdict(
            math.isfinite(ratio["ratio_engine_over_plain"]) and (ctx.dry or ratio["ratio_engine_over_plain"] <= bound),
            "dry run: both sides ran (no bound on the CPU's ratio)"
            if ctx.dry
            else f"engine / plain step time <= {bound}",
        ),
    }


MFU_GOALS = {"gpt2-small": 0.35, "llama-1b": 0.40}
"""The MFU each model's engine side should reach on one GPU (bf16, compiled layers)."""


def mfu(model: str) -> Callable[[Ctx], dict[str, Any]]:
    """`python -m bench gpu_mfu --model MODEL`: tokens/s and MFU of the engine (compiled layers, the
    plan's schedule) beside a compiled plain loop and the GEMM ceiling; dry run: a tiny model of
    the family, nothing compiled, on the CPU (no MFU: the CPU's peak is unknown)."""

    def check(ctx: Ctx) -> dict[str, Any]:
        from bench import gpu_mfu

        args = ["--model", model, "--rounds", "2", "--steps", "4"]
        if ctx.dry:
            tiny = "cpu-tiny" if model.startswith("gpt2") else "cpu-tiny-llama"
            args = ["--model", tiny, "--eager", "--device", "cpu", "--rounds", "1", "--steps", "1", "--warmup", "1"]
        args.append(f"data.cache_dir={ctx.tmp / 'cache'}")
        lines = _lines_of(lambda: gpu_mfu.main(args))
        sides = {x["side"]: x for x in lines if "side" in x}
        ratios = next(x for x in lines if "figure" in x)
        engine = sides["engine"]
        goal = MFU_GOALS[model]
        passed = engine["tokens_per_s"] > 0 and (ctx.dry or (engine["mfu"] or 0) >= goal)
        return {
            "model": lines[0]["model"],
            "precision": lines[0]["precision"],
            "schedule": ratios.get("schedule"),
            "compiled": ratios.get("compiled"),
            "tokens_per_s": {k: v.get("tokens_per_s") for k, v in sides.items() if k != "ceiling"},
            "mfu": engine["mfu"],
            "fraction_of_gemm_ceiling": engine["fraction_of_gemm_ceiling"],
            "engine_over_plain": ratios["engine_over_plain"],
            "peak_memory_gb": ratios["peak_memory_gb"],
            "verdict": Verdict(
                passed,
                "dry run: every side ran (tokens/s > 0; no MFU on the CPU)" if ctx.dry else f"engine MFU >= {goal}",
            ),
        }

    return check


def _lines_of(run: Callable[[], Any]) -> list[dict[str, Any]]:
    """The JSON lines a bench's `main` prints, captured (they are not this bench's lines)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        run()
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.startswith("{")]


CHECKS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "group_cycles": gpu_engine.group_cycles,
    "abandoned_step_memory": gpu_engine.abandoned_step,
    "shadow_d2h": gpu_engine.shadow_d2h,
    "adamw_drift": gpu_engine.adamw_drift,
    "split_graphs_bf16": gpu_engine.split_graphs,
    "job_vs_reference": job_vs_reference,
    "profile_on_device": profile_on_device,
    "gpu_step": gpu_step,
    "mfu_gpt2_small": mfu("gpt2-small"),
    "mfu_llama_1b": mfu("llama-1b"),
}
"""Every check, in the order they run (the leak checks first, on a fresh process)."""


def record(name: str, ctx: Ctx, fn: Callable[[Ctx], dict[str, Any]]) -> dict[str, Any]:
    """One check's line: its figures, its verdict and bound, the device; a check that raised fails
    with its error."""
    import torch

    device = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu"
    t0 = time.perf_counter()
    try:
        figures = fn(ctx)
        verdict = figures.pop("verdict")
    except Exception as err:  # noqa: BLE001 - a failed check is a line, the others still run
        ctx.log(traceback.format_exc())
        figures, verdict = {"error": f"{type(err).__name__}: {err}"[:2000]}, Verdict(False, "the check ran")
        left = gpu_engine.close_default_group()
        if left:
            ctx.log(left)
    return {
        **context(),
        "check": name,
        **figures,
        "verdict": "pass" if verdict.passed else "fail",
        "bound": verdict.bound,
        "device": device,
        "dry_run": ctx.dry,
        "check_s": round(time.perf_counter() - t0, 2),
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the CPU half of every check, small sizes")
    ap.add_argument("--only", nargs="+", choices=list(CHECKS), metavar="CHECK", help=f"of {', '.join(CHECKS)}")
    args = ap.parse_args(argv)
    out = _json_stdout()  # from here on anything else printed goes to stderr
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("these checks need a CUDA GPU (none here); --dry-run runs their CPU half", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    if args.dry_run:  # one intra-op thread: on a shared machine a second one spins (AdamW: 25x slower)
        torch.set_num_threads(1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_checks_"))
    ctx = Ctx(device=device, dry=args.dry_run, tmp=tmp, log=lambda s: print(s, file=sys.stderr, flush=True))
    failed = 0
    try:
        for name in args.only or CHECKS:
            ctx.log(f"check {name} ...")
            line = record(name, ctx, CHECKS[name])
            failed += line["verdict"] != "pass"
            out.write(json.dumps(line) + "\n")
            out.flush()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


def _json_stdout() -> TextIO:
    """A stream on the original stdout for the JSON lines; file descriptor 1 and `sys.stdout` now
    go to stderr, so a library's print (or a C library's write) never lands among them."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


BENCH = Bench(main, quick=("--dry-run",))
