"""The honest torchrun baseline for bench/recovery.py: what a torchrun user does today.

Plain data parallelism (DDP over gloo) of the same tiny GPT-2 as `examples/train.py`, started
by stock torchrun with the c10d rendezvous, one torchrun per (simulated) node:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:PORT --rdzv-id=JOB --nnodes=3:4 --nproc-per-node=1 \\
        --max-restarts=3 --monitor-interval=0.1 \\
        --rdzv-conf=join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2 \\
        bench/baseline_train.py --config configs/gpt2-tiny.yaml --progress-dir DIR \\
        --checkpoint-every K [key=value ...]

(`bench/recovery.py` starts exactly this, plus `is_host=1` for node 0 and `is_host=0` for the
others so that the c10d store lives in node 0's agent, as on a real cluster where only the
endpoint host serves it.)

What a worker does, and why it does the same work per step as the oobleck job:

- model: `oobleck_elastic.models.build_layer_model(cfg.model, seed=training.seed)`, all layers
  as one `nn.Sequential`, wrapped in `DistributedDataParallel` (gloo, default buckets);
- data: `build_dataset(cfg)` and `GlobalBatchSampler`: the global batch of step s is the same
  `training.global_batch_size` samples as in the oobleck job. It is split over the CURRENT world
  size as evenly as possible (16 over 4 ranks: 4 each; over 3 ranks: 6, 5, 5), and each rank
  accumulates gradients over microbatches of `training.microbatch_size` (`no_sync` on all but
  the last). The loss is the token SUM divided by the global batch's token count, times the
  world size (DDP averages over ranks), so the update is exactly the mean-loss gradient over the
  whole global batch whatever the world size: losing a node keeps the global batch and the
  per-step work the same;
- optimizer: the job's AdamW (`engine.optim.build_optimizer`, weight decay on matrices), its LR
  schedule (`set_lr`) and `clip_grad_norm_` at `training.optimizer.grad_clip`;
- checkpoints: every `--checkpoint-every` steps rank 0 `torch.save`s model, optimizer and the
  next step to `<checkpoint.dir>/baseline-step-NNNNNNNN.pt` (written to a temporary name, then
  renamed); on (re)start every rank loads the newest one and continues from its step. A failure
  loses every step since that checkpoint;
- failure: a collective that fails (a peer was SIGKILLed) raises; the worker logs it and exits 1
  at once with `os._exit` (a plain uncaught exception can spend a while in gloo's teardown, so
  this favours the baseline).
  torchrun then stops the node's workers, re-rendezvouses with the nodes still alive (a round
  completes last_call_timeout = 1 s after the 3 survivors joined; a dead node's heartbeats
  expire after keep_alive_interval x keep_alive_max_attempt = 2 s) and starts fresh worker
  processes, counted as a restart.

Progress, for the benchmark to poll: rank 0 replaces `<progress-dir>/progress.json`
({step, time, world, restart}) after every step and appends one JSON record per event to
`<progress-dir>/history.jsonl`: `spawned` (process start, before `import torch`), `ready`
(process group up, checkpoint loaded: {resumed_from}, and the times `import torch` + oobleck
ended, the dataset was loaded, `init_process_group` returned and the model was built: its first
build imports transformers' GPT-2), `step` ({step, time, seconds, world, restart, loss}),
`checkpoint`, `failed` (from any rank), `done`. It also logs one line per step:
`2026-11-21 19:15:33,021 INFO baseline step 3/30 rank 0 world 4 restart 0: loss 5.07, 18.7
samples/s, 0.857 s/step`.
"""

from __future__ import annotations

import time

SPAWNED = time.time()  # before the imports: how long a restarted worker takes to come back

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

log = logging.getLogger("baseline")
CKPT_RE = re.compile(r"baseline-step-(\d{8})\.pt$")


class Progress:
    """Progress records in --progress-dir (only rank 0 writes steps; any rank may write `failed`)."""

    def __init__(self, directory: str, rank: int, restart: int) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.restart = rank, restart

    def event(self, kind: str, **data: object) -> None:
        rec = {
            "kind": kind,
            "time": time.time(),
            "rank": self.rank,
            "restart": self.restart,
            "pid": os.getpid(),
            **data,
        }
        with open(self.dir / "history.jsonl", "a") as fh:  # one short write per line: atomic with O_APPEND
            fh.write(json.dumps(rec) + "\n")

    def step(self, *, step: int, world: int, seconds: float, loss: float) -> None:
        now = time.time()
        self.event("step", step=step, world=world, seconds=seconds, loss=loss)
        tmp = self.dir / f".progress.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"step": step, "time": now, "world": world, "restart": self.restart}))
        os.replace(tmp, self.dir / "progress.json")


def latest_checkpoint(directory: Path) -> Path | None:
    found = sorted((int(m.group(1)), p) for p in directory.glob("baseline-step-*.pt") if (m := CKPT_RE.search(p.name)))
    return found[-1][1] if found else None


def save_checkpoint(directory: Path, next_step: int, model, optimizer) -> Path:
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"baseline-step-{next_step:08d}.pt"
    tmp = directory / f".{path.name}.{os.getpid()}.tmp"
    torch.save({"next_step": next_step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
    os.replace(tmp, path)
    return path


def share(indices: list[int], rank: int, world: int) -> list[int]:
    """This rank's contiguous share of the global batch, as even as possible."""
    base, extra = divmod(len(indices), world)
    start = rank * base + min(rank, extra)
    return indices[start : start + base + (1 if rank < extra else 0)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--progress-dir", required=True, help="where progress.json and history.jsonl go")
    ap.add_argument("--checkpoint-every", type=int, default=5, help="torch.save every K steps (rank 0)")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    progress = Progress(args.progress_dir, rank, restart)
    if rank == 0:
        progress.event("spawned", time_spawned=SPAWNED, world=world)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from oobleck_elastic.config import load_config
    from oobleck_elastic.config.timing import comm_timeout
    from oobleck_elastic.data.sampler import GlobalBatchSampler, collate
    from oobleck_elastic.data.dataset import build_dataset
    from oobleck_elastic.engine.step.optim import build_optimizer, set_lr, token_sum_loss
    from oobleck_elastic.models import build_layer_model

    t_imported = time.time()
    cfg = load_config(args.config, args.overrides)
    t = cfg.training
    torch.manual_seed(t.seed)
    dataset = build_dataset(cfg, log=log.info)
    sampler = GlobalBatchSampler(len(dataset), t.global_batch_size, t.seed)
    seq_len = dataset[0][0].shape[-1]
    loss_fn = token_sum_loss(t.global_batch_size * seq_len)

    t_data = time.time()
    dist.init_process_group("gloo", timeout=timedelta(seconds=comm_timeout(cfg.fault_tolerance)))
    t_group = time.time()
    layers = build_layer_model(cfg.model, seed=t.seed)
    module = layers.stage(0, layers.num_layers)
    t_model = time.time()
    optimizer = build_optimizer(module.parameters(), t)
    ckpt_dir = Path(cfg.checkpoint.dir)
    step = 0
    latest = latest_checkpoint(ckpt_dir)
    if latest is not None:
        state = torch.load(latest, map_location="cpu", weights_only=True)
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["next_step"])
        log.info("baseline rank %d world %d restart %d: resumed from %s (step %d)", rank, world, restart, latest, step)
    model = DDP(module)  # broadcasts rank 0's parameters (all ranks loaded the same checkpoint anyway)
    params = list(model.parameters())
    if rank == 0:
        progress.event(
            "ready",
            world=world,
            resumed_from=step if latest is not None else None,
            imported=t_imported,
            data_ready=t_data,
            group_ready=t_group,
            model_built=t_model,
        )

    try:
        while step < t.steps:
            t0 = time.perf_counter()
            mine = share(sampler.indices(step), rank, world)
            x, y = collate(dataset, mine)
            chunks = list(range(0, len(mine), t.microbatch_size))
            local_loss = 0.0
            for k, i in enumerate(chunks):
                last = k == len(chunks) - 1
                with model.no_sync() if not last else contextlib.nullcontext():
                    loss = loss_fn(model(x[i : i + t.microbatch_size]), y[i : i + t.microbatch_size]) * world
                    loss.backward()
                local_loss += loss.item() / world
            torch.nn.utils.clip_grad_norm_(params, t.optimizer.grad_clip)
            set_lr(optimizer, step, t)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total = torch.tensor([local_loss], dtype=torch.float64)
            dist.all_reduce(total)  # the logged loss of the global batch (tiny)
            step += 1
            seconds = time.perf_counter() - t0
            if rank == 0:
                log.info(
                    "baseline step %d/%d rank 0 world %d restart %d: loss %.4f, %.1f samples/s, %.3f s/step",
                    step,
                    t.steps,
                    world,
                    restart,
                    float(total[0]),
                    t.global_batch_size / seconds,
                    seconds,
                )
                progress.step(step=step, world=world, seconds=seconds, loss=float(total[0]))
                if args.checkpoint_every and step % args.checkpoint_every == 0 and step < t.steps:
                    path = save_checkpoint(ckpt_dir, step, module, optimizer)
                    progress.event("checkpoint", step=step, path=str(path))
    except (RuntimeError, ConnectionError, TimeoutError) as err:
        first = str(err).splitlines()[0][:160] if str(err) else ""
        log.warning(
            "baseline step %d rank %d world %d restart %d: communication failed (%s: %s); exiting so "
            "torchrun restarts the workers",
            step,
            rank,
            world,
            restart,
            type(err).__name__,
            first,
        )
        progress.event("failed", step=step, error=f"{type(err).__name__}: {first}")
        sys.stdout.flush()
        os._exit(1)  # what the uncaught exception would do, without waiting on gloo's teardown
    if rank == 0:
        progress.event("done", step=step, world=world)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
