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

`--data-path` instead compares the shadows' data path before reused host buffers ("before": a
pageable `.cpu()` per parameter and `torch.cat` per layer, fresh receive buffers every step, the
keeper copying each gradient before its AdamW) and today's ("after": engine/step/shadows.py,
shadow_host.py), in one run of two gloo processes (about 1 min):

    .venv/bin/python -m bench shadows --data-path [--rounds 3] [--steps 16] [--compute-ms 100] [--threads 2]

Each process holds 4 of the 8 layers of gpt2-tiny at `--hidden` and keeps the other 4 (a plan of
one pipeline of two stages, one shadow copy: so it sends its layers' gradients and receives the
others', as every worker of a job does). Per side, alternated `--rounds` times, a fresh link each
round (a generation), its first step not timed:
- flatten: the holder's flattening of its 4 layers alone, `bytes_per_s` = their bytes / seconds;
- exchange: flattening + sends + receives of one step, timed on each process from a barrier;
  `bytes_per_s` = the bytes it sent plus received / the median seconds;
- step: a paced step (`--compute-ms` of sleep, the device's work, the host idle), then the shadow
  exchange, a barrier (the commit's stand-in) and the keeper's AdamW in the background, as the
  engine runs it; against the same step without shadows: `overhead` = step_s / step_s(off) - 1.
Then, in one process, the keeper's AdamW over its 4 layers: fused on 1 and `--threads` threads,
and foreach, each against fused on 1 thread (`bit_identical`: the holders run fused).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import tempfile
import time
import types
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from bench.harness import Bench, alternate, emit
from bench.schedules import launch

from oobleck_elastic.config import JobConfig, load_config
from oobleck_elastic.engine.entry.shadow_seeding import new_store
from oobleck_elastic.engine.step.optim import apply_update, build_optimizer
from oobleck_elastic.engine.step.shadow_host import intra_op_threads
from oobleck_elastic.engine.step.shadows import PostedShadows, ShadowLink, ShadowStore, keepers
from oobleck_elastic.logs import read_event_lines
from oobleck_elastic.models import LayerModel, build_layer_model
from oobleck_elastic.planning import Plan
from oobleck_elastic.planning.tolerance.shadows import place_shadows
from oobleck_elastic.testing import node_plan, uniform_profile

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


# ----------------------------------------------------------------------------- the path before


def before_flat(layer: nn.Module) -> torch.Tensor:
    """The flat gradients as the engine built them before: per parameter a `.cpu()` copy into
    fresh pageable memory, then one `torch.cat`."""
    parts = []
    for p in layer.parameters():
        parts.append(torch.tensor([0.0 if p.grad is None else 1.0]))
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        parts.append(grad.detach().reshape(-1).float().cpu())
    return torch.cat(parts)


class BeforeLink(ShadowLink):
    """`ShadowLink` as it was: every step new send and receive buffers, nothing copied early."""

    def begin(self, layer_model: LayerModel) -> Callable[[list[torch.Tensor]], None]:
        return lambda params: None

    def post(self, layer_model: LayerModel, store: Optional[ShadowStore]) -> PostedShadows:
        ops, got, flats, moved = [], {}, {}, 0
        for layer, keeper in self.sends:
            flats[layer] = before_flat(layer_model.held(layer))
            ops.append(dist.P2POp(dist.isend, flats[layer], keeper, self.group))
            moved += flats[layer].numel() * 4
        if store is not None:
            store.catch_up()
        for layer, src in self.receives:
            assert store is not None
            buf = torch.empty(sum(1 + p.numel() for p in store.layer_model.held(layer).parameters()))
            ops.append(dist.P2POp(dist.irecv, buf, src, self.group))
            got[layer] = buf
            moved += buf.numel() * 4
        self.bytes_per_step = moved
        return PostedShadows(works=dist.batch_isend_irecv(ops) if ops else [], grads=got, keep=flats)


def before_update(self: ShadowStore, step: int, norm2: float, cfg: JobConfig) -> None:
    """`ShadowStore._update` as it was: each gradient copied out of the received buffer."""
    assert self.pending is not None and self.optimizer is not None
    _, grads = self.pending
    for i in self.layers:
        flat, offset = grads[i], 0
        for p in self.layer_model.held(i).parameters():
            present = bool(flat[offset] > 0)
            n = p.numel()
            p.grad = flat[offset + 1 : offset + 1 + n].view_as(p).to(p.dtype).clone() if present else None
            offset += 1 + n
    apply_update(self.optimizer, self.params, step, norm2, cfg.training)
    self.pending = None
    self.host_bytes = self.count_bytes()
    self.settled_step = step


# ----------------------------------------------------------------------------- the two processes


def config(hidden: int) -> JobConfig:
    return load_config(ROOT / "configs/gpt2-tiny.yaml", ["model.num_layers=6", f"model.hidden_size={hidden}"])


def plan() -> Plan:
    two = node_plan(1, [[("n0", 0, 4), ("n1", 4, 8)]], [8], num_layers=LAYERS)
    return dataclasses.replace(two, shadows=place_shadows(two, 1, [1] * LAYERS, 100))


@dataclasses.dataclass
class Side:
    """One side's objects on one process."""

    name: str
    link: ShadowLink
    store: ShadowStore


def _side(name: str, args: dict, rank: int, layer_model: LayerModel) -> Side:
    cfg, p = config(args["hidden"]), plan()
    kept = [layer for layer, ranks in keepers(p).items() if rank in ranks]
    store = new_store(cfg, generation=1, step=-1, layers=kept, kept=None, incoming=[])
    if name == "before":
        store.threads = 1
        store._update = types.MethodType(before_update, store)  # type: ignore[method-assign]
        return Side(name, BeforeLink(p, rank, None), store)
    if args["threads"]:
        store.threads = args["threads"]
    return Side(name, ShadowLink(p, rank, None), store)


def _flatten(side: Side, layer_model: LayerModel, steps: int) -> tuple[list[float], int]:
    """Seconds of the holder's flattening alone, each step (the first not timed), and its bytes."""
    out, nbytes = [], 0
    for step in range(steps + 1):
        began = time.perf_counter()
        if isinstance(side.link, BeforeLink):
            flats = [before_flat(layer_model.held(layer)) for layer, _ in side.link.sends]
        else:
            side.link.staging.begin(layer_model, in_flight=False)
            side.link.staging.rest()
            flats = list(side.link.staging.ready().values())
            side.link.staging.end()
        if step:
            out.append(time.perf_counter() - began)
        nbytes = sum(f.numel() * 4 for f in flats)
    return out, nbytes


def _exchange(side: Side, layer_model: LayerModel, steps: int) -> list[float]:
    """Seconds of each step's exchange (the first one, which allocates, not timed)."""
    out = []
    for step in range(steps + 1):
        dist.barrier()
        began = time.perf_counter()
        side.link.begin(layer_model)
        grads = side.link.post(layer_model, side.store).wait()
        if step:
            out.append(time.perf_counter() - began)
        side.store.received(step, grads)
        side.store.discard()
    return out


def _steps(side: Optional[Side], layer_model: LayerModel, steps: int, compute_s: float, cfg: JobConfig) -> list[float]:
    """Seconds of each paced step, with this side's shadows or none (the first step not timed)."""
    out = []
    dist.barrier()
    for step in range(steps + 1):
        began = time.perf_counter()
        time.sleep(compute_s)  # the device's forward and backward
        if side is not None:
            side.link.begin(layer_model)
            grads = side.link.post(layer_model, side.store).wait()
            side.store.received(step, grads)
        dist.barrier()  # the commit
        if side is not None:
            side.store.apply(step, 1.0, cfg, background=True)
        if step:
            out.append(time.perf_counter() - began)
    if side is not None:
        side.store.settle()
    return out


def _worker(rank: int, tmp: str, args: dict) -> None:
    torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1
    dist.init_process_group(
        "gloo", store=dist.FileStore(f"{tmp}/store", 2), rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    cfg, p = config(args["hidden"]), plan()
    owned = list(p.stage_of(rank)[1].layers())
    layer_model = build_layer_model(cfg.model, seed=0, owned=owned, device="cpu")
    gen = torch.Generator().manual_seed(rank)
    for i in owned:
        for q in layer_model.held(i).parameters():
            q.grad = torch.randn(q.shape, generator=gen) * 1e-3
    records: list[dict[str, Any]] = []
    for r in range(args["rounds"]):
        for name in ("before", "after"):
            side = _side(name, args, rank, layer_model)
            seconds, nbytes = _flatten(side, layer_model, args["steps"])
            records.append({"part": "flatten", "side": name, "round": r, "seconds": seconds, "bytes": nbytes})
            seconds = _exchange(side, layer_model, args["steps"])
            records.append(
                {"part": "exchange", "side": name, "round": r, "seconds": seconds, "bytes": side.link.bytes_per_step}
            )
        for name in ("off", "before", "after"):
            side = None if name == "off" else _side(name, args, rank, layer_model)
            seconds = _steps(side, layer_model, args["steps"], args["compute_ms"] / 1e3, cfg)
            records.append({"part": "step", "side": name, "round": r, "seconds": seconds})
    torch.save(records, f"{tmp}/records-{rank}.pt")
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the keeper's AdamW


def _update_variants(args: dict) -> list[dict[str, Any]]:
    """The keeper's update over 4 layers: fused on 1 and `threads` threads, foreach on 1."""
    cfg = config(args["hidden"])
    template = build_layer_model(cfg.model, seed=0, owned=range(4), device="cpu")
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen) * 1e-3 for i in range(4) for p in template.held(i).parameters()]
    results: dict[tuple[str, int], tuple[float, list[torch.Tensor]]] = {}
    threads = max(2, args["threads"] or 2)
    for variant, n in (("fused", 1), ("fused", threads), ("foreach", 1)):
        params = [nn.Parameter(p.detach().clone()) for i in range(4) for p in template.held(i).parameters()]
        optimizer = build_optimizer(params, cfg.training)
        if variant == "foreach":  # the same groups, the multi-tensor path instead of the fused kernel
            groups = [{**g, "fused": None, "foreach": True} for g in optimizer.param_groups]
            optimizer = torch.optim.AdamW(groups, foreach=True)
        seconds = []
        for step in range(args["steps"] + 1):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            began = time.perf_counter()
            with intra_op_threads(n):
                apply_update(optimizer, params, step, 1.0, cfg.training)
            if step:
                seconds.append(time.perf_counter() - began)
        results[(variant, n)] = (statistics.median(seconds), [p.detach().clone() for p in params])
    reference = results[("fused", 1)][1]
    return [
        {
            "part": "update",
            "variant": variant,
            "threads": n,
            "update_s": s,
            "params": sum(p.numel() for p in reference),
            "bit_identical": all(torch.equal(a, b) for a, b in zip(weights, reference)),
        }
        for (variant, n), (s, weights) in results.items()
    ]


def data_path(args: dict) -> None:
    """Run both processes, then print one JSON line per result and the summary."""
    with tempfile.TemporaryDirectory(prefix="bench-shadow-path-") as tmp:
        mp.spawn(_worker, args=(tmp, args), nprocs=2, join=True)
        records = [torch.load(f"{tmp}/records-{r}.pt", weights_only=False) for r in range(2)]
    common = {"bench": "shadows", "data_path": True, "hidden": args["hidden"]}
    summary: dict[str, Any] = {**common, "summary": True, "compute_ms": args["compute_ms"]}
    parts = (("flatten", ("before", "after")), ("exchange", ("before", "after")), ("step", ("off", "before", "after")))
    for part, sides in parts:
        for name in sides:
            per_rank = []
            for rank in range(2):
                mine = [x for x in records[rank] if x["part"] == part and x["side"] == name]
                seconds = statistics.median(s for x in mine for s in x["seconds"])
                line = {**common, "part": part, "side": name, "rank": rank, "seconds": seconds}
                if part in ("flatten", "exchange"):
                    line["bytes_per_s"] = mine[0]["bytes"] / seconds
                emit(line)
                per_rank.append(line)
            slowest = max(x["seconds"] for x in per_rank)  # a step waits for the slower process
            summary[f"{part}_s_{name}"] = slowest
            if part != "step":
                summary[f"{part}_bytes_per_s_{name}"] = min(x["bytes_per_s"] for x in per_rank)
    for part in ("flatten", "exchange"):
        summary[f"{part}_speedup"] = summary[f"{part}_s_before"] / summary[f"{part}_s_after"]
    for name in ("before", "after"):
        summary[f"overhead_{name}"] = summary[f"step_s_{name}"] / summary["step_s_off"] - 1
    for line in _update_variants(args):
        emit({**common, **line})
        summary[f"update_s_{line['variant']}_{line['threads']}"] = line["update_s"]
    emit(summary)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--data-path", action="store_true", help="compare the data path before and now")
    parser.add_argument("--rounds", type=int, default=3, help="--data-path: rounds of the sides alternated")
    parser.add_argument("--compute-ms", type=float, default=100.0, help="--data-path: a paced step's compute")
    parser.add_argument("--threads", type=int, default=0, help="--data-path: the keeper's threads (0: default)")
    args = parser.parse_args(argv)
    if args.data_path:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        keys = ("hidden", "rounds", "steps", "compute_ms", "threads")
        data_path({k: getattr(args, k) for k in keys})
        return
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
