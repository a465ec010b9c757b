"""What compiling each layer with its backward split in two costs (engine/stage/split_layer.py),
against the whole-layer compile and eager layers, in one process.

Sides, alternated within each repeat, on the same stage (layers 1 .. n-1 of the model: the
blocks and the head, so every layer has an input gradient), the same microbatch and output
gradient:

- `eager`: the layers as they are;
- `whole`: each layer through one `torch.compile`d function (one autograd node per layer: what
  `training.compile` gave before the split);
- `split`: each layer through split_layer.py's graphs (forward, input-gradient and
  weight-gradient graphs, compiled apart).

Each side is timed for a forward and a whole backward (`full`: 1F1B's passes), and for a forward,
torch's input-gradient pass and its weight-gradient pass (`zb`: `stage_backward_input`, then
`stage_backward_weight`, zero-bubble's passes; with `whole` each pass runs the layer's whole
compiled backward, compiled without donated buffers, which a kept graph needs). Reported per
(side, passes): the median seconds of a step's passes over `--steps` after `--warmup`, one JSON
line each, with `vs_eager` = eager's median / this one's and `vs_whole` the same against `whole`,
per repeat and in a summary line per pair (medians over repeats).

Run (a few minutes on 2 cores, most of it compiling):

    .venv/bin/python bench/compile_split.py [--config configs/gpt2-tiny.yaml] [--microbatch 4]
        [--seq-len 64] [--steps 20] [--warmup 3] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oobleck_elastic.config import load_config  # noqa: E402
from oobleck_elastic.engine.stage.split_layer import run_split  # noqa: E402
from oobleck_elastic.models import build_layer_model, num_layers  # noqa: E402


class _Wrapped(nn.Module):
    def __init__(self, layer: nn.Module, run: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.layer, self.run = layer, run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.layer, x)


def _call(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


def _call_kept(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`_call` again: a code object of its own, so its compiled graphs are its own (dynamo caches
    per code object)."""
    return layer(x)


def _passes(stage: nn.Module, x: torch.Tensor, grad: torch.Tensor, split: bool) -> None:
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    for p in stage.parameters():
        p.grad = None
    xi = x.detach().requires_grad_()
    out = stage(xi)
    if split:
        _, groups = stage_backward_input([out], [grad], [xi], stage.parameters())
        stage_backward_weight(stage.parameters(), groups)
    else:
        out.backward(grad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs/gpt2-tiny.yaml"))
    ap.add_argument("--microbatch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--override", nargs="*", default=[], help="config overrides (key=value)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [f"data.seq_len={args.seq_len}", *args.override])
    n = num_layers(cfg.model)
    model = build_layer_model(cfg.model, seed=1, owned=list(range(n)), device="cpu")
    layers = [model.held(i) for i in range(1, n)]
    stages = {
        "eager": nn.Sequential(*layers),
        "whole": nn.Sequential(*[_Wrapped(layer, torch.compile(_call, dynamic=False)) for layer in layers]),
        "split": nn.Sequential(*[_Wrapped(layer, run_split) for layer in layers]),
    }
    # torch's input-gradient pass keeps the graph (retain_graph), which a compiled backward with
    # donated buffers refuses: the whole-layer side of the zb passes compiles without them
    whole_zb = torch.compile(_call_kept, dynamic=False)
    stage_zb = nn.Sequential(*[_Wrapped(layer, whole_zb) for layer in layers])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.microbatch, args.seq_len, cfg.model.hidden_size, generator=gen)
    with torch.no_grad():
        grad = torch.randn_like(stages["eager"](x))
    t0 = time.perf_counter()

    def stage_for(name: str, passes: str) -> nn.Module:
        return stage_zb if (name, passes) == ("whole", "zb") else stages[name]

    for name in stages:  # compile outside the timed steps
        for passes in ("full", "zb"):
            with torch._functorch.config.patch(donated_buffer=(name, passes) != ("whole", "zb")):
                _passes(stage_for(name, passes), x, grad, passes == "zb")
    print(json.dumps({"compile_and_first_steps_s": round(time.perf_counter() - t0, 1)}), flush=True)
    results: dict[tuple[str, str], list[float]] = {}
    for repeat in range(args.repeats):
        medians: dict[tuple[str, str], float] = {}
        for passes in ("full", "zb"):
            for name in stages:
                stage = stage_for(name, passes)
                times = []
                for step in range(args.warmup + args.steps):
                    t = time.perf_counter()
                    _passes(stage, x, grad, passes == "zb")
                    if step >= args.warmup:
                        times.append(time.perf_counter() - t)
                medians[(name, passes)] = statistics.median(times)
        for (name, passes), s in medians.items():
            results.setdefault((name, passes), []).append(s)
            line = {"repeat": repeat, "side": name, "passes": passes, "step_s": round(s, 5)}
            line["vs_eager"] = round(medians[("eager", passes)] / s, 3)
            line["vs_whole"] = round(medians[("whole", passes)] / s, 3)
            print(json.dumps(line), flush=True)
    for (name, passes), runs in results.items():
        med = statistics.median(runs)
        eager = statistics.median(results[("eager", passes)])
        whole = statistics.median(results[("whole", passes)])
        summary = {"summary": True, "side": name, "passes": passes, "step_s": round(med, 5)}
        summary.update(vs_eager=round(eager / med, 3), vs_whole=round(whole / med, 3))
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
