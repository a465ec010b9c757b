"""Tearing down a generation whose step is still blocked in a gloo operation
(engine/entry/devices.py `release_groups`).

Two processes share a gloo group with a 20 s timeout. Rank 0's step thread waits in an
all-reduce that rank 1, alive, never joins: what a survivor's abandoned step looks like when a
peer has already left the generation but keeps its sockets open. Rank 0 then tears the
generation down as `Trainer.abort` does and enters a new one. The teardown must not wait for
the blocked operation: a gloo group's destructor joins its worker threads, so dropping its last
reference on the main thread would stall the worker until the timeout fires.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time
from datetime import timedelta

TIMEOUT_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, results: "mp.Queue", done: "mp.Event") -> None:  # type: ignore[name-defined]
    import torch
    import torch.distributed as dist

    from oobleck_elastic.engine.entry.devices import release_groups

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=TIMEOUT_S))
    dist.barrier()
    if rank == 1:  # alive, holding its sockets open, never joining the all-reduce
        done.wait(2 * TIMEOUT_S)
        os._exit(0)
    blocked = threading.Event()

    def step() -> None:
        blocked.set()
        try:
            work = dist.all_reduce(torch.ones(4), async_op=True)  # as the commit vote waits
            work.wait()
        except Exception:  # noqa: BLE001 - its timeout, long after the test
            pass

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    blocked.wait()
    time.sleep(0.5)  # inside the all-reduce by now
    began = time.monotonic()
    release_groups(abort=True, busy=[thread])
    released = time.monotonic() - began
    # the next generation: a new default group (a world of one here) on a new store
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=TIMEOUT_S))
    t = torch.full((2,), 3.0)
    dist.all_reduce(t)
    results.put({"released_s": released, "thread_alive": thread.is_alive(), "next": t.tolist()})
    results.close()
    results.join_thread()  # the queue's feeder thread has written it: os._exit would drop it
    done.set()
    os._exit(0)  # the blocked operation's thread cannot end cleanly (engine/runner.py)


def test_a_generation_blocked_in_gloo_is_torn_down_without_waiting_for_the_timeout():
    ctx = mp.get_context("spawn")
    results, done = ctx.Queue(), ctx.Event()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results, done)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=90)
    finally:
        done.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    # not a speed goal: released well before the blocked operation's timeout, i.e. not waiting for it
    assert out["released_s"] < TIMEOUT_S / 4, out
    assert out["thread_alive"], "the all-reduce was not blocked when the generation was torn down"
    assert out["next"] == [3.0, 3.0]
