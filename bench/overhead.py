"""Failure-free throughput of the engine against hand-written torch.distributed.pipelining, side by side.

Goal (from the issue): the fault-tolerance machinery of `Trainer.train_step` costs at most 3 % of
samples/s when nothing fails.

Method. One process world of W gloo ranks (spawned once, `torch.set_num_threads(1)` per rank) holds
two independent copies of the same model, built from the same seed with the same plan:

- engine:   `Trainer(cfg, dataset=..., plan=plan, rank=rank, store=...)` and `train_step(step)`;
- baseline: what a torch user writes by hand for the same plan: the same stage modules
  (`build_layer_model(...).stage(start, end)`), `PipelineStage(..., group=pp_group)`,
  `Schedule1F1B(stage, n_microbatches, loss_fn, scale_grads=False)` with the same token-sum loss,
  then one flat all-reduce of the stage's gradients over its replicas (plus one for the tied
  wte/lm_head over all its holders, as the engine does), clipping to the same max norm as
  `clip_grad_norm_` does it for a pipeline (local squared norm, one all-reduce over the pipeline,
  `_foreach_mul_`), the same LR schedule and a default `torch.optim.AdamW`. No commit all-reduce,
  no loss all-reduce, no `.item()`, no clone of the gradients.

Model: configs/gpt2-tiny.yaml with DEFAULT_OVERRIDES (GPT-2-like, 6 blocks of width 128 + embedding +
head = 8 layers, cut 4 + 4; seq_len 64; global batch 32 = 8 microbatches of 4, so 4 per pipeline on 2x2,
8 on 1x2); extra `key=value` arguments override further.

Both read the same global batches (same sampler, same collation) and the same microbatches. After
warm-up steps of each, R rounds alternate a block of S engine steps with a block of S baseline
steps (which one goes first alternates between rounds, so drift of the shared, noisy machine
cancels). Before every step the ranks meet at a barrier; a step's time is the MAX over ranks of the
time from that barrier to the end of the rank's step (gathered with an all-reduce MAX after each
block, outside the timed region). Reported: samples/s = global batch / median step time for each,
and overhead = median engine time / median baseline time - 1. Also listed: the overhead of each
round (from the medians of its two blocks; the spread shows how noisy the run was), the overhead
from the 25th percentiles (less sensitive to steps slowed by other processes), and the 1-minute
load average at the end. With a load well above the core count expect +-10 % swings between runs:
repeat on a quiet machine. As a check that both do the same math, the largest difference between
the two copies' weights after the run is reported too.

Run (1-3 minutes on 2 cores):

    python -m bench overhead                    # 2 pipelines x 2 stages on 4 ranks, then 1 x 2 on 2
    python -m bench overhead --world 4 --rounds 7 --steps 10
    python -m bench overhead --quick            # short smoke run
    python -m bench overhead --layout 4x1       # 4 one-stage pipelines: pure data parallelism

Prints one JSON line per world:
    {"bench": "overhead", "world": 4, "plan": "2x2", "engine_samples_s": ..., "baseline_samples_s": ...,
     "overhead_pct": ..., "goal_pct": 3, "meets_goal": ..., "steps": ..., "rounds": ...}
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

from bench.harness import Bench, emit

ROOT = Path(__file__).resolve().parents[1]
GOAL_PCT = 3.0
DEFAULT_OVERRIDES = [
    "model.hidden_size=128",
    "model.num_layers=6",
    "model.max_seq_len=64",
    "data.seq_len=64",
    "training.global_batch_size=32",
    "training.microbatch_size=4",
    "training.steps=1000",
]


def make_plan(pipelines: int, stages: int, num_layers: int, microbatch_size: int, microbatches: int):
    """`pipelines` identical pipelines of `stages` contiguous, near-equal layer ranges; the global
    batch's microbatches are split as evenly as possible between the pipelines."""
    from oobleck_elastic.testing import layout_plan

    cuts = [round(k * num_layers / stages) for k in range(stages + 1)]
    mbs = [microbatches // pipelines + (1 if i < microbatches % pipelines else 0) for i in range(pipelines)]
    ranges = [(cuts[s], cuts[s + 1]) for s in range(stages)]
    return layout_plan([ranges] * pipelines, mbs, generation=1, num_layers=num_layers, microbatch_size=microbatch_size)


class Baseline:
    """Plain torch.distributed.pipelining + data parallelism, no fault-tolerance machinery."""

    def __init__(self, cfg, plan, rank: int, dataset) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        from oobleck_elastic.data.sampler import GlobalBatchSampler
        from oobleck_elastic.engine.step.optim import token_sum_loss
        from oobleck_elastic.models import build_layer_model

        t = cfg.training
        self.cfg, self.dataset, self.rank = cfg, dataset, rank
        self.sampler = GlobalBatchSampler(len(dataset), t.global_batch_size, t.seed)
        n_stages = len(plan.pipelines[0].stages)
        cuts = [(s.start, s.end) for s in plan.pipelines[0].stages]
        assert all([(s.start, s.end) for s in p.stages] == cuts for p in plan.pipelines), "pipelines differ"
        # every rank creates every group, in the same order
        pp_groups = [dist.new_group([s.rank for s in p.stages]) for p in plan.pipelines]
        dp_groups = [
            dist.new_group([p.stages[i].rank for p in plan.pipelines]) if len(plan.pipelines) > 1 else None
            for i in range(n_stages)
        ]
        tied_ranks = sorted({p.stages[0].rank for p in plan.pipelines} | {p.stages[-1].rank for p in plan.pipelines})
        tied_group = dist.new_group(tied_ranks)
        self.pipeline, self.stage = plan.stage_of(rank)
        self.first, self.last = self.stage.index == 0, self.stage.index == n_stages - 1
        self.pp_group = pp_groups[self.pipeline.index]
        self.dp_group = dp_groups[self.stage.index]
        self.tied_group = tied_group if rank in tied_ranks else None

        owned = range(self.stage.start, self.stage.end)
        lm = build_layer_model(cfg.model, seed=t.seed, owned=owned)
        self.module = lm.stage(self.stage.start, self.stage.end)
        self.params = list(self.module.parameters())  # unique (a shared Parameter appears once)
        tied = {id(lm.layers[i].get_parameter(n)) for g in lm.tied for i, n in g.members if i in owned}
        self.tied = [p for p in self.params if id(p) in tied]
        self.untied = [p for p in self.params if id(p) not in tied]
        # for the norm: count the tied tensor once per pipeline (first stage holds it)
        self.norm_params = self.params if self.first else self.untied

        seq_len = dataset[0][0].shape[-1]
        self.loss_fn = token_sum_loss(t.global_batch_size * seq_len)
        stage = PipelineStage(self.module, self.stage.index, n_stages, torch.device("cpu"), group=self.pp_group)
        self.schedule = Schedule1F1B(
            stage, n_microbatches=self.pipeline.microbatches, loss_fn=self.loss_fn, scale_grads=False
        )
        o = t.optimizer
        decay = [p for p in self.params if p.ndim >= 2]
        no_decay = [p for p in self.params if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
        )
        self.max_norm = o.grad_clip
        start = t.microbatch_size * sum(p.microbatches for p in plan.pipelines[: self.pipeline.index])
        self.slice = slice(start, start + t.microbatch_size * self.pipeline.microbatches)

    def _flat_all_reduce(self, params, group):
        import torch
        import torch.distributed as dist

        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        return params, flat, dist.all_reduce(flat, group=group, async_op=True)

    def train_step(self, step: int) -> None:
        import torch
        import torch.distributed as dist

        from oobleck_elastic.engine.step.optim import set_lr
        from oobleck_elastic.data.sampler import collate

        x, y = collate(self.dataset, self.sampler.indices(step)[self.slice])
        if self.first and self.last:  # a one-stage pipeline
            self.schedule.step(x, target=y, losses=[])
        elif self.first:
            self.schedule.step(x)
        elif self.last:
            self.schedule.step(target=y, losses=[])
        else:
            self.schedule.step()
        # data-parallel gradient sync: one flat bucket per group, copied back into the grads in place
        pending = []
        if self.dp_group is not None and self.untied:
            pending.append(self._flat_all_reduce(self.untied, self.dp_group))
        if self.tied_group is not None and self.tied:
            pending.append(self._flat_all_reduce(self.tied, self.tied_group))
        for params, flat, work in pending:
            work.wait()
            chunks = flat.split([p.numel() for p in params])
            torch._foreach_copy_([p.grad for p in params], [c.view_as(p) for c, p in zip(chunks, params)])
        # clip_grad_norm_ for a pipeline: the norm needs every stage's squared sum
        if self.max_norm > 0:
            grads = [p.grad for p in self.params if p.grad is not None]
            norm2 = (
                torch.stack(torch._foreach_norm([p.grad for p in self.norm_params if p.grad is not None])).pow(2).sum()
            )
            dist.all_reduce(norm2, group=self.pp_group)
            coef = torch.clamp(self.max_norm / (norm2.sqrt() + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        set_lr(self.optimizer, step, self.cfg.training)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def worker(rank: int, world: int, tmp: str, cfg_dict: dict, layout: tuple[int, int], args: dict, out) -> None:
    import torch
    import torch.distributed as dist

    from oobleck_elastic.config import from_dict
    from oobleck_elastic.engine.trainer import Trainer
    from oobleck_elastic.testing import RandomTokens

    torch.set_num_threads(1)
    cfg = from_dict(cfg_dict)
    t = cfg.training
    pipelines, stages = layout
    plan = make_plan(
        pipelines, stages, cfg.model.num_layers + 2, t.microbatch_size, t.global_batch_size // t.microbatch_size
    )
    dataset = RandomTokens(n=max(256, 4 * t.global_batch_size), seq_len=cfg.data.seq_len, vocab=cfg.model.vocab_size)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    # the engine (re)creates the default process group from the store; the baseline's groups come after
    engine = Trainer(cfg, dataset=dataset, plan=plan, rank=rank, store=store)
    base = Baseline(cfg, plan, rank, dataset)
    timing = dist.new_group(list(range(world)))

    runners = {"engine": engine.train_step, "baseline": base.train_step}
    next_step = {"engine": 0, "baseline": 0}
    times: dict[str, list[list[float]]] = {"engine": [], "baseline": []}  # per round, per step

    def block(kind: str, n: int, keep: bool) -> None:
        local = torch.zeros(n, dtype=torch.float64)
        for i in range(n):
            dist.barrier(group=timing)
            t0 = time.perf_counter()
            runners[kind](next_step[kind])
            local[i] = time.perf_counter() - t0
            next_step[kind] += 1
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=timing)
        if keep:
            times[kind].append(local.tolist())

    for kind in ("engine", "baseline"):
        block(kind, args["warmup"], keep=False)
    for r in range(args["rounds"]):
        order = ("engine", "baseline") if r % 2 == 0 else ("baseline", "engine")
        for kind in order:
            block(kind, args["steps"], keep=True)

    # both copies saw the same batches for the same number of steps: their weights must agree
    diff = torch.zeros((), dtype=torch.float64)
    for a, b in zip(engine.params, base.params):
        diff = torch.maximum(diff, (a.detach() - b.detach()).abs().max().double())
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=timing)
    if rank == 0:
        out.put({"times": times, "max_weight_diff": float(diff)})
    dist.barrier(group=timing)
    engine.close()


def parse_layout(text: str) -> tuple[int, int]:
    """`PxS` (pipelines x stages, e.g. 4x1: four one-stage pipelines, pure data parallelism)."""
    try:
        pipelines, stages = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--layout {text!r}: give pipelines x stages, e.g. 4x1 or 2x2") from None
    if pipelines < 1 or stages < 1:
        raise SystemExit(f"--layout {text!r}: pipelines and stages must be >= 1")
    return pipelines, stages


def run_world(world: int, args: argparse.Namespace, cfg) -> dict:
    import torch.multiprocessing as mp

    from oobleck_elastic.config import to_dict

    layout = parse_layout(args.layout) if args.layout else {4: (2, 2), 2: (1, 2), 3: (1, 3)}.get(world)
    if layout is None:
        raise SystemExit(f"--world {world}: use 2 (1x2), 3 (1x3) or 4 (2x2), or give --layout")
    world = layout[0] * layout[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    opts = {"warmup": args.warmup, "rounds": args.rounds, "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            worker, args=(world, tmp, to_dict(cfg), layout, opts, out), nprocs=world, join=True, start_method="spawn"
        )
    res = out.get(timeout=10)
    med = statistics.median
    eng = med([t for block in res["times"]["engine"] for t in block])
    base = med([t for block in res["times"]["baseline"] for t in block])
    rounds = [
        round((med(e) / med(b) - 1.0) * 100.0, 1) for e, b in zip(res["times"]["engine"], res["times"]["baseline"])
    ]
    q1 = [statistics.quantiles([t for block in res["times"][k] for t in block], n=4)[0] for k in ("engine", "baseline")]
    gbs = cfg.training.global_batch_size
    overhead = (eng / base - 1.0) * 100.0
    return {
        "bench": "overhead",
        "world": world,
        "plan": f"{layout[0]}x{layout[1]}",
        "engine_samples_s": round(gbs / eng, 1),
        "baseline_samples_s": round(gbs / base, 1),
        "engine_step_ms": round(eng * 1e3, 2),
        "baseline_step_ms": round(base * 1e3, 2),
        "overhead_pct": round(overhead, 2),
        "goal_pct": GOAL_PCT,
        "meets_goal": overhead <= GOAL_PCT,
        "steps": args.steps,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "round_overhead_pct": rounds,
        "overhead_p25_pct": round((q1[0] / q1[1] - 1.0) * 100.0, 2),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "max_weight_diff": float(f"{res['max_weight_diff']:.3g}"),
    }


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[4, 2], help="world sizes: 4 = 2x2, 2 = 1x2, 3 = 1x3")
    p.add_argument("--layout", help="PxS pipelines x stages (e.g. 4x1, pure data parallelism); replaces --world")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--steps", type=int, default=10, help="steps per block (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each before the rounds")
    p.add_argument("--config", default=str(ROOT / "configs/gpt2-tiny.yaml"))
    p.add_argument("--quick", action="store_true", help="short run: 2 rounds x 4 steps, world 4 only")
    p.add_argument("overrides", nargs="*", help="config overrides key=value (after the defaults)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 4, 2
        if args.world == p.get_default("world"):
            args.world = [4]
    from oobleck_elastic.config import load_config

    cfg = load_config(args.config, DEFAULT_OVERRIDES + list(args.overrides))
    for world in [0] if args.layout else args.world:
        emit(run_world(world, args, cfg))


BENCH = Bench(main, quick=("--quick",))
