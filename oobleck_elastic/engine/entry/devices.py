"""Where a worker trains, which backends its process groups use, and how they are torn down.

- **Device.** `training.device=auto` puts worker `LOCAL_RANK` on `cuda:<LOCAL_RANK>` when CUDA is
  available, else on the CPU; `cpu` and `cuda` force it. The worker builds only its layers
  there and copies each microbatch from pinned host memory without blocking.
- **Two kinds of collectives, one mechanism.** On CUDA every process group is created with the
  backend `cpu:gloo,cuda:nccl` (torch's device-to-backend map), so a collective runs over the
  backend of its tensors' device: control collectives (generation agreement, held layouts, norm
  and loss, commit vote) are small CPU tensors and go over gloo; data (pipeline send/receive,
  holder-set gradient sums, tied-weight sums, layer and optimizer-state transfers) are device
  tensors and go over NCCL. On the CPU every group is plain `gloo` (both kinds over gloo), not
  the map `cpu:gloo`: torch 2.13 gives a group created from a map without NCCL no default
  backend whenever a backend plugin is registered (importing `torch.distributed.fsdp` registers
  its test backend `fake`), and destroying such a world then warns "No backend of type 0 found
  for Process Group with name undefined" at the end of every run.
- **Abandoning a generation.** `release_groups(abort=True)` aborts every group of the generation and
  forgets them (`_abort_process_group` on the world). NCCL operations blocked on a dead or hung
  peer return with an error at once; gloo has no way to interrupt a blocked operation, which
  returns only when its timeout fires or its peer's sockets close, so the caller runs steps
  where it can stop waiting for them (see `engine/worker.py`). Nor can a gloo group be freed while
  such an operation runs: its destructor joins the group's worker threads, so whichever thread
  drops the last reference waits for the operation's timeout (`comm_timeout_s`, 30 s and more).
  So the aborted groups are handed to a daemon thread that holds them until the abandoned step
  threads (`busy`) have ended, then drops them; the worker enters the next generation at once.
- **NCCL error handling** (`configure_nccl`): a peer's failure must never kill a healthy
  worker. `TORCH_NCCL_ASYNC_ERROR_HANDLING=2` (clean up only: on a timeout or error the watchdog
  aborts the communicators and the waiting call raises, the process lives on; 1 and torch's
  default 3 kill the process, so they are replaced, with a warning, even when the environment
  sets them: images often set 1), `TORCH_NCCL_ENABLE_MONITORING=0` (the heartbeat monitor would
  kill a process whose watchdog is stuck on a hung peer; also forced), and
  `TORCH_NCCL_DUMP_ON_TIMEOUT=0` (no flight-recorder dumps on every reconfiguration; a default).
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
    """The process groups' backend: on a GPU the device-to-backend map gloo for CPU tensors and
    NCCL for CUDA ones; on the CPU plain gloo (see the module docstring for why not `cpu:gloo`)."""
    return "gloo" if device.type == "cpu" else f"cpu:gloo,{device.type}:nccl"


_SAFE = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": ("0", "2"), "TORCH_NCCL_ENABLE_MONITORING": ("0",)}


def configure_nccl(environ: MutableMapping[str, str] = os.environ) -> tuple[dict[str, str], list[str]]:
    """Set NCCL_ENV (see the module docstring). Returns the values in force and one message per
    setting of the environment that was replaced because it would let a peer kill this worker."""
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
    """Forget every process group of this process: aborted (`abort`, see the module docstring)
    or destroyed (a healthy generation left at a step boundary); and restart torch's group
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
    there (module docstring). The caller must keep no other reference."""

    def free() -> None:
        for thread in busy:
            thread.join()
        groups.clear()

    threading.Thread(target=free, name="oobleck-free-groups", daemon=True).start()
