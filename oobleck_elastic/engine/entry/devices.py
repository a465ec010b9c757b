"""Where a worker trains, which backends its process groups use, and how they are torn down.

`resolve_device` (`training.device`: worker LOCAL_RANK on `cuda:<LOCAL_RANK>`, or the CPU),
`backend_for` (gloo for control collectives, NCCL for data on GPUs), `configure_nccl` and
`release_groups` (a generation's groups aborted at once, freed when the abandoned step threads
have ended). Invariant: a peer's failure never kills a healthy worker, and tearing a generation
down never waits for a blocked collective. docs/recovery.md, docs/liveness.md.
"""

from __future__ import annotations

import os
import threading
from typing import Any, MutableMapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group, _world

NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}


def resolve_device(setting: str, local_rank: int) -> torch.device:
    """The device of worker `local_rank` for `training.device` (`auto`, `cpu` or `cuda`)."""
    if setting == "cpu":
        return torch.device("cpu")
    if setting not in ("auto", "cuda"):
        raise ValueError(f"training.device is '{setting}'; choose one of auto, cpu, cuda")
    if not torch.cuda.is_available():
        if setting == "cuda":
            raise RuntimeError(
                "training.device=cuda but CUDA is not available on this machine (set training.device=auto or cpu)"
            )
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"worker LOCAL_RANK={local_rank} has no GPU: this node has {count}; "
            f"start at most {count} workers per node (--nproc-per-node)"
        )
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    """The process groups' backend: on a GPU the device-to-backend map gloo for CPU tensors (the
    control collectives: agreement, layouts, norm, commit) and NCCL for CUDA ones (pipeline sends,
    gradient sums, layer transfers); on the CPU plain gloo, not the map `cpu:gloo`: torch 2.13
    gives a group made from a map without NCCL no default backend whenever a backend plugin is
    registered (importing `torch.distributed.fsdp` registers `fake`), and destroying such a world
    then warns "No backend of type 0 found" at the end of every run."""
    return "gloo" if device.type == "cpu" else f"cpu:gloo,{device.type}:nccl"


_SAFE = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": ("0", "2"), "TORCH_NCCL_ENABLE_MONITORING": ("0",)}


def configure_nccl(environ: MutableMapping[str, str] = os.environ) -> tuple[dict[str, str], list[str]]:
    """Set NCCL_ENV: a peer's failure must never kill a healthy worker. ASYNC_ERROR_HANDLING=2
    (clean up only: the waiting call raises, the process lives; 1 and torch's default 3 kill it,
    so they are replaced even when the environment sets them), ENABLE_MONITORING=0 (the heartbeat
    monitor would kill a process whose watchdog is stuck on a hung peer; forced too) and
    DUMP_ON_TIMEOUT=0 (no flight-recorder dumps at every reconfiguration; a default). Returns the
    values in force and one message per setting of the environment that was replaced."""
    replaced = []
    for key, value in NCCL_ENV.items():
        old = environ.get(key)
        if old is not None and key in _SAFE and old.strip() not in _SAFE[key]:
            replaced.append(f"{key}={old} would end this worker when a peer fails; using {value}")
            old = None
        if old is None:
            environ[key] = value
    return {key: environ[key] for key in NCCL_ENV}, replaced


def release_groups(*, abort: bool, busy: Sequence[threading.Thread] = ()) -> None:
    """Forget every process group of this process: aborted (`abort`: NCCL operations blocked on a
    dead peer return at once; a blocked gloo operation returns only at its timeout or when the
    peer's sockets close, and its group cannot be freed meanwhile: its destructor joins its
    threads) or destroyed (a healthy generation left at a step boundary); and restart torch's group
    numbering: groups are named by a per-process counter that only a
    complete teardown resets, so a default group whose set-up failed half-way (a generation
    superseded while it was being joined) would leave this worker naming its groups differently
    from its peers in the next generation, and they would wait for each other's keys forever.
    `busy`: abandoned step threads that may still be blocked in an operation of these groups;
    the aborted groups are freed only once they have ended, on a daemon thread."""
    if dist.is_initialized():
        if abort:
            doomed: list[Any] = list(_world.pg_map)
            _abort_process_group()
            _free_later(doomed, busy)
        else:
            dist.destroy_process_group()
    _world.group_count = 0


def _free_later(groups: list[Any], busy: Sequence[threading.Thread]) -> None:
    """Hold `groups` on a daemon thread until every thread of `busy` has ended, then drop them
    there, so that no thread of this worker waits for a blocked gloo operation's timeout. The
    caller must keep no other reference."""

    def free() -> None:
        for thread in busy:
            thread.join()
        groups.clear()

    threading.Thread(target=free, name="oobleck-free-groups", daemon=True).start()
