"""Peak host memory of profiling a model: the whole model built at once vs one layer at a time.

Each case runs in its own subprocess (so peaks do not mix) on the CPU and prints one JSON line:

- `old`:        what the profiler did before: `build_layer_model` with every layer, then
                `profile_layers` over the built list;
- `one_layer`:  `profiler.profile_model` with `planning.profile_identical_blocks_once=false`:
                every layer built, measured and freed in turn;
- `once`:       `profiler.profile_model` as shipped: identical blocks measured once.

Fields: `peak_rss_mib` (the process's VmHWM from /proc/self/status, its resident high-water mark),
`import_rss_mib` (VmRSS after importing torch and transformers, before any layer is built: the
floor every case shares), `peak_over_import_mib` (the difference: what profiling cost),
`model_param_mib` (bytes of the whole model's parameters, a tied weight counted once),
`largest_layer_mib` (the largest single layer's parameters), `seconds` (wall time of the
profile) and `layers_built` (calls that built a layer).

Models: configs/gpt2-tiny.yaml as shipped, and a larger GPT-2 (24 blocks of width 1024, the
GPT-2 vocabulary, 354M parameters, 1.3 GiB in fp32) at microbatch 1 x 128 tokens. One warm-up-free
timed iteration per layer: memory is the point. About a minute on 2 cores:

    python bench/profile_memory.py            # all cases
    python bench/profile_memory.py --case gpt2-24x1024:once
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "gpt2-tiny": [],
    "gpt2-24x1024": [
        "model.num_layers=24",
        "model.hidden_size=1024",
        "model.num_heads=16",
        "model.vocab_size=50257",
        "model.max_seq_len=128",
        "data.seq_len=128",
        "training.microbatch_size=1",
        "training.global_batch_size=8",
    ],
}
MODES = ("old", "one_layer", "once")
MIB = 1024**2


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}: this benchmark needs Linux")


def run_case(model: str, mode: str) -> dict:
    """Profile `model` in `mode` in this process and report its memory (see the module docstring)."""
    import torch

    sys.path.insert(0, str(ROOT))
    import transformers  # noqa: F401 - imported before the floor is read, as the profiler needs it

    from oobleck_elastic import models
    from oobleck_elastic.config import load_config
    from oobleck_elastic.models.build import build_meta_layers
    from oobleck_elastic.planning.profile import profiler

    cfg = load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        MODELS[model]
        + [
            "planning.profile_warmup=0",
            "planning.profile_repeats=1",
            f"planning.profile_identical_blocks_once={mode == 'once'}",
        ],
    )
    metas = build_meta_layers(cfg.model, cfg.model.num_layers + 2, seed=0)
    sizes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in metas]
    tied = metas[0].wte.weight.numel() * metas[0].wte.weight.element_size()  # GPT-2: wte is lm_head
    model_bytes, largest = sum(sizes) - tied, max(sizes)
    del metas
    import_rss = _status_mib("VmRSS")
    built = 0
    real_build = models.build_layer_model

    def counting_build(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        nonlocal built
        lm = real_build(*args, **kwargs)
        built += sum(layer is not None for layer in lm.layers)
        return lm

    models.build_layer_model = counting_build
    t0 = time.perf_counter()
    if mode == "old":
        lm = models.build_layer_model(cfg.model, seed=cfg.training.seed)
        shape = (cfg.training.microbatch_size, cfg.data.seq_len)
        ids = torch.randint(0, cfg.model.vocab_size, shape)
        profiler.profile_layers(lm.layers, ids, ids, lm.loss_fn, warmup=0, repeats=1, names=lm.names)
    else:
        profiler.profile_model(cfg, device="cpu")
    seconds = time.perf_counter() - t0
    peak = _status_mib("VmHWM")
    return {
        "model": model,
        "mode": mode,
        "peak_rss_mib": round(peak, 1),
        "import_rss_mib": round(import_rss, 1),
        "peak_over_import_mib": round(peak - import_rss, 1),
        "model_param_mib": round(model_bytes / MIB, 1),
        "largest_layer_mib": round(largest / MIB, 1),
        "seconds": round(seconds, 2),
        "layers_built": built,
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", help="MODEL:MODE, run in this process (default: every case, each in a subprocess)")
    args = ap.parse_args(argv)
    if args.case:
        model, _, mode = args.case.partition(":")
        if model not in MODELS or mode not in MODES:
            ap.error(
                f"--case {args.case}: choose MODEL:MODE with MODEL in {', '.join(MODELS)} and MODE in "
                f"{', '.join(MODES)}"
            )
        print(json.dumps(run_case(model, mode)), flush=True)
        return 0
    for model in MODELS:
        for mode in MODES:
            out = subprocess.run(
                [sys.executable, __file__, "--case", f"{model}:{mode}"],
                capture_output=True,
                text=True,
                check=False,
                cwd=ROOT,
            )
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                return out.returncode
            print(out.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
