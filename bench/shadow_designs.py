"""Shadow copies, the two designs side by side: failure-free cost of (a) gradients every step and
(b) snapshots every N steps.

The designs. `fault_tolerance.shadow_copies` keeps every layer's weights and AdamW state also in
the host memory of nodes that do not hold the layer on their devices (engine/step/shadows.py).

- (a) Checkmate-style, what the engine does: after the gradient sums, a holder sends each layer's
  summed gradients (`_grad_flat`, one flat fp32 tensor per layer) to the layer's keeper over a
  process group of its own (`ShadowLink.post`), posted before the norm all-reduce and waited
  before the commit; after the commit the keeper applies them with the same clipping, learning
  rate and fused AdamW in a thread of its own (`ShadowStore.received`, `apply(background=True)`).
- (b) GEMINI-style: every N-th step, at the commit, the holder stages a consistent host copy of its
  layers' parameters, `exp_avg`, `exp_avg_sq` and `step` (GEMINI copies them from the GPU into
  pinned host memory), and a thread of its own sends it to the keeper over a process group of its
  own; the step does not wait for it, except that a snapshot waits for the previous one to have
  landed (its staging buffer is reused). The keeper's thread receives it into a buffer of its own
  and then copies it into its `ShadowStore`'s parameters and optimizer state, so a holder lost in
  mid-transfer leaves the previous snapshot whole.

Method. Two worker processes on loopback gloo, one thread each (`torch.set_num_threads(1)`), the
model of configs/gpt2-tiny.yaml widened to `--hidden` (default 256: embedding, 6 blocks, head;
about 5 M parameters, 20 MB in fp32), sequences of 64, microbatches of 2. Symmetric like the job:
rank 0 holds layers 0-3 on its "device" (the CPU) with its own AdamW (`build_optimizer`) and keeps
layers 4-7 as shadows in a `ShadowStore` (`new_store`); rank 1 the other way round. Each worker
builds the whole model from the seed (`build_layer_model`), runs one real forward and backward of
one microbatch, and keeps those gradients for every step. A step is paced like a device
(engine/stage/paced.py): it restores the kept gradients and sleeps to a deadline `--step-s` after
its start (default 1.2 s, the step of bench/shadows.py's job: on a GPU the host idles while the
device computes), then runs, for real, what the host does after the device: (a)'s posts, one SUM
all-reduce of the squared norm and the loss on the step group (the commit's collective), (a)'s
waits, the holder's clipping + learning rate + `optimizer.step()`, then (a)'s background apply or
(b)'s staging. The step's time is from its start to that point. The modes (`off`: no shadow work,
`a`, and `b<N>` for each of `--intervals`) alternate round-robin, `--repeats` runs each of
`--steps` steps, each run on freshly built layers, optimizer and store; the first `--warmup`
steps of a run are dropped. In b<N> the snapshots are taken at steps warmup, warmup + N, ... so
every run times at least one of them.

Checked, not only timed (the run fails loudly otherwise): after a run of `a` the keeper's shadows
(parameters, both moments and AdamW's step) equal the holder's layers bit for bit; after a run of
`b<N>`, once its last snapshot has landed, they equal the holder's as they were at that snapshot's
step.

Modelled and not. Modelled: the host work of each design on a host whose device is busy (the
flatten and sends of (a) and the keeper's AdamW; the staging copy of 3 x the weights of (b), its
send and the keeper's copy), both workers doing both roles at once, 2 cores shared by both.
Not modelled: on a GPU, (a) adds a device-to-host copy of the gradients every step (20 MB here) and
(b) one of 3 x the bytes (weights and both moments) every N steps, both over PCIe, which this
CPU-only bench has not; the sends run over loopback, not a network; the gradient sums among
holders (there is one holder per layer here).

Steps lost on a recovery from the shadows (when every device copy of a layer is lost):
- a: 0. A step commits only once its gradients are on every keeper, and a committed step is
  applied to (or rolled forward on) the shadows, so the shadows are at the last committed step.
- b<N>: up to N + m committed steps, m being the largest number of steps that committed while one
  snapshot was in flight (measured: `inflight_steps`, 0 when a send lasts less than a step). With
  snapshots at steps s, s + N, ...: a failure just before step s + N commits loses N - 1 steps (the
  keeper is at s); one after step s + N committed and staged its snapshot, but before that snapshot
  landed, loses N + m (the keeper is still at s).
Reported: `lost_bound` = 0 for a, N + max(m over the run's snapshots) for b<N>.

Output: one JSON line per (mode, repeat): `step_s` (median seconds of rank 0's timed steps),
`step_s_rank1`, `snap_step_s` (b: median of the timed steps that took a snapshot), `stage_s` (b:
median seconds staging a snapshot took, waiting for the previous included), `sent_bytes_per_step`
(bytes one worker sent for the shadows, over all the run's steps, averaged), `snapshot_bytes`,
`host_bytes` (the keeper's `ShadowStore.nbytes()`), `lost_bound`, `inflight_steps`, `verified`.
Then one summary line per mode: medians over repeats and `overhead` = step_s / step_s(off) - 1;
for b<N> also `amortized_overhead`, the mean step of a steady run with one snapshot step in N,
((N - 1) x median other step + median snapshot step) / N, over step_s(off), minus 1.

Why not torch's checkpoint staging. This torch has `torch.distributed.checkpoint.staging`
(`StateDictStager`, `DefaultStager`, and `_copy_state_dict`/`_create_cpu_state_dict`): they copy a
state dict into (pinned) host buffers, one tensor per entry, for a storage writer. Its live
point-to-point transfer, `PGTransport`, sends a pickled description and then one tensor at a
time, waiting for each CPU send before the next, and receives either in place (the keeper's copy
is then torn if the holder dies mid-transfer) or into freshly allocated tensors. One flat staging
buffer does the same copy as the stager, goes in one send, and lands whole before it is unpacked:
so plain gloo send/recv of one flat fp32 tensor per snapshot, as `ShadowLink` does for gradients.

Run (4 minutes with the defaults on 2 cores: 5 modes x 3 repeats x 12 steps x 1.2 s, plus
building the layers for each run):

    .venv/bin/python bench/shadow_designs.py [--repeats 3] [--steps 12] [--warmup 2] [--step-s 1.2]
        [--intervals 1 4 16] [--hidden 256]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oobleck_elastic.config import JobConfig, load_config  # noqa: E402
from oobleck_elastic.engine.entry.shadow_seeding import new_store  # noqa: E402
from oobleck_elastic.engine.step.shadows import ShadowLink, ShadowStore  # noqa: E402
from oobleck_elastic.engine.step.optim import build_optimizer, clip_coefficient, scale_grads, set_lr  # noqa: E402
from oobleck_elastic.models import LayerModel, build_layer_model  # noqa: E402

WORLD = 2


def job_config(*, hidden: int, steps: int) -> JobConfig:
    """configs/gpt2-tiny.yaml as bench/shadows.py runs it: 6 blocks of `hidden`, sequences of 64,
    microbatches of 2."""
    return load_config(
        ROOT / "configs" / "gpt2-tiny.yaml",
        [
            "model.num_layers=6",
            f"model.hidden_size={hidden}",
            "data.seq_len=64",
            "training.global_batch_size=16",
            "training.microbatch_size=2",
            f"training.steps={steps}",
        ],
    )


def held_layers(rank: int, num_layers: int) -> list[int]:
    """The layers `rank` holds on its device: rank 0 the first half, rank 1 the second."""
    half = num_layers // 2
    return list(range(half)) if rank == 0 else list(range(half, num_layers))


class PairPlan:
    """The two-worker layout in the terms `ShadowLink` reads from a Plan (`routes`): two nodes of
    one device each; every layer held by one rank and shadowed by the other's node."""

    gpus_per_node = 1

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        nodes = [["n1"] if layer in held_layers(0, num_layers) else ["n0"] for layer in range(num_layers)]
        self.shadows = type("Shadows", (), {"layers": nodes, "copies": 1})()

    def entry_ranks(self) -> dict[tuple[str, int], int]:
        return {("n0", 0): 0, ("n1", 0): 1}

    def holders(self, layer: int, lane: int = 0) -> list[int]:
        return [0 if layer in held_layers(0, self.num_layers) else 1]


def unique_params(model: LayerModel, layers: list[int]) -> list[torch.nn.Parameter]:
    return list(dict.fromkeys(p for i in layers for p in model.held(i).parameters()))


def pack(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, out: torch.Tensor) -> None:
    """Parameters and AdamW state into `out` (flat fp32): per parameter its values, exp_avg,
    exp_avg_sq, then step."""
    offset = 0
    for p in params:
        state = optimizer.state.get(p)
        if not state:
            raise RuntimeError("a parameter has no AdamW state: snapshot only after the first optimizer step")
        n = p.numel()
        for t in (p.detach(), state["exp_avg"], state["exp_avg_sq"]):
            out[offset : offset + n].copy_(t.reshape(-1))
            offset += n
        out[offset] = state["step"]
        offset += 1
    assert offset == out.numel(), (offset, out.numel())


def packed_numel(params: list[torch.nn.Parameter]) -> int:
    return sum(3 * p.numel() + 1 for p in params)


def unpack(flat: torch.Tensor, store: ShadowStore) -> None:
    """A snapshot (`pack`'s layout) into the store's parameters and AdamW state."""
    assert store.optimizer is not None
    offset = 0
    with torch.no_grad():
        for p in store.params:
            n = p.numel()
            values = [flat[offset + k * n : offset + (k + 1) * n].view_as(p).clone() for k in range(3)]
            offset += 3 * n
            p.copy_(values[0])
            step = flat[offset : offset + 1].reshape(()).clone()
            offset += 1
            store.optimizer.state[p] = {"step": step, "exp_avg": values[1], "exp_avg_sq": values[2]}
    assert offset == flat.numel()


@dataclass
class Snapshots:
    """Design (b) on one worker: the staging buffer it sends, the buffer the peer's arrive in, the
    thread of the snapshot in flight (a symmetric exchange: this holder's out, the peer's in)."""

    staged: torch.Tensor
    incoming: torch.Tensor
    group: Any
    peer: int
    store: ShadowStore
    thread: Optional[threading.Thread] = None
    failed: Optional[BaseException] = None
    inflight: list[int] = field(default_factory=list)
    """Per snapshot, how many steps committed while it was in flight."""

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.failed is not None:
            raise RuntimeError(f"a snapshot transfer failed: {self.failed}") from self.failed

    def send(self, step: int) -> None:
        def run() -> None:
            try:
                ops = [
                    dist.P2POp(dist.isend, self.staged, self.peer, self.group),
                    dist.P2POp(dist.irecv, self.incoming, self.peer, self.group),
                ]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                unpack(self.incoming, self.store)
                self.store.step = step
            except BaseException as err:  # noqa: BLE001 - re-raised by wait()
                self.failed = err

        self.inflight.append(0)
        self.thread = threading.Thread(target=run, name=f"snapshot-{step}", daemon=True)
        self.thread.start()

    def committed(self) -> None:
        """A step committed: count it against the snapshot still in flight."""
        if self.thread is not None and self.thread.is_alive():
            self.inflight[-1] += 1


def interval_of(mode: str) -> int:
    return int(mode[1:]) if mode.startswith("b") else 0


def run_mode(
    mode: str,
    *,
    cfg: JobConfig,
    rank: int,
    grads: dict[str, torch.Tensor],
    groups: dict[str, Any],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One run of `mode` on this worker: `args.steps` paced steps on fresh layers; its numbers."""
    peer = 1 - rank
    model = build_layer_model(cfg.model, seed=cfg.training.seed, device="cpu")
    mine, theirs = held_layers(rank, model.num_layers), held_layers(peer, model.num_layers)
    names = {p: name for name, p in _named(model)}
    params = unique_params(model, mine)
    saved = [grads[names[p]] for p in params]
    optimizer = build_optimizer(params, cfg.training)
    store = None
    if mode != "off":
        store = new_store(cfg, generation=0, step=-1, layers=theirs, kept=None, incoming=[])
    link = ShadowLink(PairPlan(model.num_layers), rank, groups["shadow"]) if mode == "a" else None  # type: ignore[arg-type]
    interval = interval_of(mode)
    snaps = None
    if interval:
        assert store is not None
        snaps = Snapshots(
            staged=torch.empty(packed_numel(params)),
            incoming=torch.empty(packed_numel(store.params)),
            group=groups["snapshot"],
            peer=peer,
            store=store,
        )
    times: list[float] = []
    snap_times: list[float] = []
    other_times: list[float] = []
    stage_times: list[float] = []
    sent, reference = 0, None
    loss = torch.tensor(0.0)
    for step in range(args.steps):
        t0 = time.perf_counter()
        now = [g.clone() for g in saved]  # the device's backward: this step's gradients
        for p, g in zip(params, now):
            p.grad = g
        time.sleep(max(0.0, t0 + args.step_s - time.perf_counter()))
        posted = link.post(model, store) if link is not None else None
        if posted is not None:
            sent += sum(t.numel() * 4 for t in posted.keep.values())
        norm = sum((g.double().pow(2).sum() for g in now), torch.zeros((), dtype=torch.float64))
        local = torch.stack([norm, loss.double()])
        dist.all_reduce(local, group=groups["step"])
        norm2 = float(local[0])
        if posted is not None:
            assert store is not None
            store.received(step, posted.wait())
        scale_grads(params, clip_coefficient(norm2, cfg.training.optimizer.grad_clip))
        set_lr(optimizer, step, cfg.training)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if mode == "a":
            assert store is not None
            store.apply(step, norm2, cfg, background=True)
        snapped = False
        if snaps is not None:
            snaps.committed()
            if step >= args.warmup and (step - args.warmup) % interval == 0:
                began = time.perf_counter()
                snaps.wait()
                pack(params, optimizer, snaps.staged)
                snaps.send(step)
                stage_times.append(time.perf_counter() - began)
                sent += snaps.staged.numel() * 4
                snapped = True
        elapsed = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(elapsed)
            (snap_times if snapped else other_times).append(elapsed)
        if snapped:  # the holder's layers at the snapshot's step, untimed: what the keeper must get
            reference = snaps.staged.clone()  # type: ignore[union-attr]
    # checks, untimed: the keeper's shadows against the holder's layers
    mine_now = torch.empty(packed_numel(params))
    pack(params, optimizer, mine_now)
    if snaps is not None:
        snaps.wait()
        assert reference is not None, "a b run took no snapshot: give more steps than the warm-up"
        mine_now = reference
    verified = None
    if store is not None:
        store.settle()
        assert store.optimizer is not None
        kept = torch.empty(packed_numel(store.params))
        pack(store.params, store.optimizer, kept)
        holder = torch.empty(packed_numel(store.params))
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, mine_now, peer, groups["step"]),
                dist.P2POp(dist.irecv, holder, peer, groups["step"]),
            ]
        )
        for w in works:
            w.wait()
        verified = bool(torch.equal(kept, holder))
        if not verified:
            diff = (kept - holder).abs().max().item()
            raise AssertionError(
                f"mode {mode}: rank {rank}'s shadows of layers {theirs} differ from their holder's "
                f"({'last snapshot' if snaps else 'current layers'}): max |difference| {diff}"
            )
    return {
        "times": times,
        "snap_times": snap_times,
        "other_times": other_times,
        "stage_times": stage_times,
        "sent_bytes_per_step": sent / args.steps,
        "snapshot_bytes": snaps.staged.numel() * 4 if snaps is not None else 0,
        "host_bytes": store.nbytes() if store is not None else 0,
        "inflight_steps": max(snaps.inflight) if snaps is not None and snaps.inflight else 0,
        "verified": verified,
    }


def _named(model: LayerModel) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"{i}.{name}", p) for i in model.built for name, p in model.held(i).named_parameters()]


def real_grads(cfg: JobConfig) -> dict[str, torch.Tensor]:
    """One real forward and backward of one microbatch of the whole model: gradient per parameter
    name (layer index.local name), the same on both workers (same seed, same tokens)."""
    model = build_layer_model(cfg.model, seed=cfg.training.seed, device="cpu")
    gen = torch.Generator().manual_seed(cfg.training.seed)
    shape = (int(cfg.training.microbatch_size), cfg.data.seq_len)
    x = torch.randint(0, cfg.model.vocab_size, shape, generator=gen)
    y = torch.randint(0, cfg.model.vocab_size, shape, generator=gen)
    model.loss_fn(model(x), y).backward()
    out = {}
    for name, p in _named(model):
        assert p.grad is not None, f"{name} got no gradient"
        out[name] = p.grad.detach().clone()
    return out


def worker(rank: int, port: int, args: argparse.Namespace, schedule: list[tuple[str, int]], out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        groups = {
            "step": dist.group.WORLD,
            "shadow": dist.new_group([0, 1], backend="gloo"),
            "snapshot": dist.new_group([0, 1], backend="gloo"),
        }
        cfg = job_config(hidden=args.hidden, steps=args.steps)
        grads = real_grads(cfg)
        for mode, repeat in schedule:
            dist.barrier()
            res = run_mode(mode, cfg=cfg, rank=rank, grads=grads, groups=groups, args=args)
            both: list[Any] = [None, None]
            dist.all_gather_object(both, res)
            if rank == 0:
                out.put(row(mode, repeat, both, args))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def row(mode: str, repeat: int, both: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    r0, r1 = both
    interval = interval_of(mode)

    def med(xs: list[float]) -> Optional[float]:
        return statistics.median(xs) if xs else None

    return {
        "bench": "shadow_designs",
        "mode": mode,
        "repeat": repeat,
        "hidden": args.hidden,
        "step_s": med(r0["times"]),
        "step_s_rank1": med(r1["times"]),
        "other_step_s": med(r0["other_times"]),
        "snap_step_s": med(r0["snap_times"]),
        "stage_s": med(r0["stage_times"]),
        "sent_bytes_per_step": r0["sent_bytes_per_step"],
        "snapshot_bytes": r0["snapshot_bytes"],
        "host_bytes": r0["host_bytes"],
        "inflight_steps": max(r0["inflight_steps"], r1["inflight_steps"]),
        "lost_bound": interval + max(r0["inflight_steps"], r1["inflight_steps"]) if interval else 0,
        "verified": None if r0["verified"] is None else bool(r0["verified"] and r1["verified"]),
    }


def summary(rows: list[dict[str, Any]], modes: list[str]) -> list[dict[str, Any]]:
    """Per mode: medians over its runs, and the overhead against `off`."""
    out = []
    by_mode = {m: [r for r in rows if r["mode"] == m] for m in modes}
    off = statistics.median(r["step_s"] for r in by_mode["off"]) if by_mode.get("off") else None
    for mode in modes:
        runs = by_mode[mode]
        if not runs:
            continue
        step_s = statistics.median(r["step_s"] for r in runs)
        line: dict[str, Any] = {
            "bench": "shadow_designs",
            "summary": True,
            "mode": mode,
            "step_s": step_s,
            "step_s_runs": [r["step_s"] for r in runs],
            "overhead": step_s / off - 1 if off else None,
            "sent_bytes_per_step": statistics.median(r["sent_bytes_per_step"] for r in runs),
            "host_bytes": runs[0]["host_bytes"],
            "lost_bound": max(r["lost_bound"] for r in runs),
        }
        interval = interval_of(mode)
        if interval:
            snap = statistics.median(r["snap_step_s"] for r in runs)
            others = [r["other_step_s"] for r in runs if r["other_step_s"] is not None]
            other = statistics.median(others) if others else snap
            steady = ((interval - 1) * other + snap) / interval
            line.update(
                snap_step_s=snap,
                stage_s=statistics.median(r["stage_s"] for r in runs),
                steady_bytes_per_step=runs[0]["snapshot_bytes"] / interval,
                amortized_overhead=steady / off - 1 if off else None,
            )
        out.append(line)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace, emit: Any = None) -> list[dict[str, Any]]:
    """The whole bench: per-run rows (passed to `emit` as they come), then the summary lines."""
    modes = ["off", "a"] + [f"b{n}" for n in args.intervals]
    schedule = [(mode, r) for r in range(args.repeats) for mode in modes]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = mp.spawn(worker, args=(free_port(), args, schedule, results), nprocs=WORLD, join=False)
    rows: list[dict[str, Any]] = []

    def drain() -> None:
        while True:
            try:
                got = results.get_nowait()
            except queue.Empty:
                return
            rows.append(got)
            if emit is not None:
                emit(got)

    while not procs.join(timeout=0.2):
        drain()
    time.sleep(0.1)
    drain()
    if len(rows) != len(schedule):
        raise RuntimeError(f"{len(rows)} runs reported of {len(schedule)}")
    lines = summary(rows, modes)
    if emit is not None:
        for line in lines:
            emit(line)
    return rows + lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--step-s", type=float, default=1.2)
    p.add_argument("--intervals", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--hidden", type=int, default=256)
    return p


def main() -> None:
    args = parser().parse_args()
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): no step would be timed")
    run(args, emit=lambda line: print(json.dumps(line), flush=True))


if __name__ == "__main__":
    main()
