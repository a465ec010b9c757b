"""Where a worker trains, which backends its process groups use, and how they are torn down.

`resolve_device` (`training.device`: worker LOCAL_RANK on `cuda:<LOCAL_RANK>`, or the CPU),
`backend_for` (gloo for control collectives, NCCL for data on GPUs), `configure_nccl`,
`configure_cuda` (the allocator's setting, the current device) and
`release_groups` (a generation's groups aborted at once, freed when the abandoned step threads
have ended). Invariant: a peer's failure never kills a healthy worker, and tearing a generation
down never waits for a blocked collective. docs/recovery.md, docs/liveness.md.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Iterable, MutableMapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ErrorType
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


ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF_DEFAULT = "expandable_segments:True"
"""The CUDA caching allocator's setting unless the environment gives one: segments that grow in
place fragment less when generations free and allocate stages of other sizes (torch's CUDA
memory-management notes)."""


def configure_cuda(device: torch.device, environ: MutableMapping[str, str] = os.environ) -> Optional[str]:
    """Before any CUDA work of this worker: `ALLOC_CONF_DEFAULT` unless the environment sets
    `ALLOC_CONF_ENV` (read by the allocator once, at its first allocation), then
    `torch.cuda.set_device` (so that nothing, not the warm-up compile nor a communicator, lands on
    device 0). Returns a message when the allocator had started already and the default could not
    take effect (None otherwise, and off CUDA)."""
    if device.type != "cuda":
        return None
    late = None
    if default_alloc_conf(environ) and torch.cuda.is_initialized():
        late = f"CUDA started before {ALLOC_CONF_ENV}={ALLOC_CONF_DEFAULT} was set: the allocator runs without it"
    torch.cuda.set_device(device)
    return late


def default_alloc_conf(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set `ALLOC_CONF_ENV` to `ALLOC_CONF_DEFAULT` unless `environ` has it (the user's setting
    wins); whether it was set."""
    if ALLOC_CONF_ENV in environ:
        return False
    environ[ALLOC_CONF_ENV] = ALLOC_CONF_DEFAULT
    return True


def group_errors(groups: Iterable[Optional[dist.ProcessGroup]], device: torch.device) -> list[str]:
    """What `groups`' (None: the default group) backends for `device` report as their error state,
    one line each not `SUCCESS`: NCCL's watchdog marks a timed-out communicator and aborts it while
    the process lives (TORCH_NCCL_ASYNC_ERROR_HANDLING=2), and a `wait()` that returned before the
    kernel ran does not see it; a backend without an error state (gloo: its waits raise) reports
    none. Read before the commit vote (engine/step/commit.py). docs/nccl.md."""
    out = []
    for group in groups:
        pg = group if group is not None else _world.default_pg
        if pg is None:
            continue
        try:
            backend = pg._get_backend(device)
        except RuntimeError:  # no backend for this device type: nothing of the data plane ran on it
            continue
        get_error = getattr(backend, "get_error", None)
        try:
            state = get_error() if get_error is not None else ErrorType.SUCCESS
        except RuntimeError as err:  # torch's checker wraps gloo, which has no error state
            if "does not support getError" not in str(err):
                raise
            continue
        if state != ErrorType.SUCCESS:
            out.append(f"group {pg.group_name} ({device.type}): {state.name}")
    return out


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
