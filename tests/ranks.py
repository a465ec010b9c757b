"""Start a test's gloo ranks from a fork server that has already imported torch.

`torch.multiprocessing.spawn` starts each rank as a fresh interpreter, which imports torch and
the engine again: about 3 s of CPU a rank, so 6 s of a 4-rank test's wall time on two cores
before its first step. `spawn` here forks each rank from one server per pytest process that
imported the heavy third-party modules once (torch, its DTensor and sympy, transformers).
Our own modules are not preloaded: some read the environment when imported, and a rank must see
the environment of the test that starts it, not the server's. So each rank first takes the
starting process's environment, then imports the test's function and runs it, as a spawned
rank would.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any, Callable

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "transformers"]
_preloaded = False


def _run(rank: int, environ: dict[str, str], fn: Callable[..., None], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)


def spawn(fn: Callable[..., Any], args: tuple = (), nprocs: int = 1) -> None:
    """Run fn(rank, *args) in nprocs ranks and wait for all; a rank's exception is raised here
    (as torch.multiprocessing.spawn raises it)."""
    global _preloaded
    if not _preloaded:
        multiprocessing.set_forkserver_preload(PRELOAD)
        _preloaded = True
    mp.start_processes(_run, args=(dict(os.environ), fn, args), nprocs=nprocs, join=True, start_method="forkserver")
