"""Start a test's gloo ranks from a fork server that has already imported torch.

`torch.multiprocessing.spawn` starts each rank as a fresh interpreter, which imports torch and
the engine again: about 3 s of CPU a rank, so 6 s of a 4-rank test's wall time on two cores
before its first step. `spawn` here forks each rank from one server per pytest process that
imported the heavy third-party modules once (torch, its DTensor and sympy, transformers).
Our own modules are not preloaded: some read the environment when imported, and a rank must see
the environment of the test that starts it, not the server's. So each rank takes the starting
process's environment, imports the test's function, and waits at a barrier for the others
before running it: a rank slow to import on a loaded machine would otherwise reach the engine's
connect seconds after the others, past `fault_tolerance.join_timeout_s` (3 s), and fail a test
about something else (as a job's agents start workers only once the rendezvous let them).
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any, Callable

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "transformers"]
START_TIMEOUT_S = 300.0
"""How long a rank waits for the others to start (a rank that died first fails the test anyway)."""
_preloaded = False


def _run(rank: int, environ: dict[str, str], start: Any, fn: Callable[..., None], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    start.wait(START_TIMEOUT_S)  # every rank has imported the test's module: they start together
    fn(rank, *args)


def spawn(fn: Callable[..., Any], args: tuple = (), nprocs: int = 1) -> None:
    """Run fn(rank, *args) in nprocs ranks and wait for all; a rank's exception is raised here
    (as torch.multiprocessing.spawn raises it)."""
    global _preloaded
    if not _preloaded:
        multiprocessing.set_forkserver_preload(PRELOAD)
        _preloaded = True
    start = multiprocessing.get_context("forkserver").Barrier(nprocs)
    mp.start_processes(
        _run, args=(dict(os.environ), start, fn, args), nprocs=nprocs, join=True, start_method="forkserver"
    )
