"""How an agent ends: torch's exceptions for a program, one line and a status for the torchrun CLI.

A program that embeds torch's agent (`elastic_launch`, `torch.distributed.run.main(args)`) gets
what the agent contract says: `JobClosed` (a `RendezvousClosedError`) when the job is closed,
`SettingError` (a `RendezvousError`) for a config it cannot load or an etcd it cannot reach, torch's
`ChildFailedError` when workers failed; never a `SystemExit` through its own code. Only an
uncaught one, at the top of a process, becomes one line on stderr and an exit status
(`install_exit_hook`, a `sys.excepthook` that hands every other exception on): 0 when the job
finished without this node, 2 when the job was closed by a known error before its first step
(a setting, data file, plan or checkpoint to change, `ClosedRecord.known_error`) or the config
is bad, 1 for any other failure (etcd out of reach too). docs/running.md tells it from the user's side.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, Callable, Optional

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError

from ..records.job import ClosedRecord

PREFIX = "torchrun --rdzv-backend=oobleck"
"""How every line of the agent's own starts."""

STATUS_FINISHED = 0
STATUS_FAILED = 1
STATUS_SETTING = 2
"""A setting (config, data, plan, checkpoint) to change: as argparse exits on a bad option."""


class JobClosed(RendezvousClosedError):
    """The job is closed: torch's agent stops (no worker is restarted into a closed job). `line`
    says why in one line, `status` is what the torchrun process exits with when nothing catches it."""

    def __init__(self, line: str, status: int) -> None:
        super().__init__(line)
        self.line = line
        self.status = status


class SettingError(RendezvousError):
    """The rendezvous handler cannot be built from its settings: its config (a misspelt key, a bad
    value: status 2), or an etcd it cannot reach at `--rdzv-endpoint` (status 1)."""

    def __init__(self, line: str, status: int = STATUS_SETTING) -> None:
        super().__init__(line)
        self.line = line
        self.status = status


def closed_error(run_id: str, closed: ClosedRecord, *, node: Optional[str] = None) -> JobClosed:
    """What `next_rendezvous` raises on a closed job: the job's own reason in one line; status 0
    when it finished or stopped (this node was a spare, or came too late), 2 when a known error
    closed it before its first step (every restart would repeat it), 1 for any other failure."""
    where = f" while node {node} waited to be admitted" if node else ""
    if closed.failed:
        return JobClosed(
            f"{PREFIX}: run {run_id} was closed as failed{where}: {closed.reason}",
            STATUS_SETTING if closed.known_error else STATUS_FAILED,
        )
    return JobClosed(
        f"{PREFIX}: run {run_id} was closed{where}"
        + (f" ({closed.reason})" if closed.reason else "")
        + "; nothing for this node to do",
        STATUS_FINISHED,
    )


_workers_failed_on: Optional[JobClosed] = None
"""Set by `note_closed`: the line a `ChildFailedError` ends with instead of torch's banner."""


def note_closed(run_id: str, closed: Optional[ClosedRecord]) -> None:
    """Remember, as the agent shuts down, that the job was closed as failed: its workers' failure
    (torch's `ChildFailedError`, with `--max-restarts=0`) is that known reason, said in one line."""
    global _workers_failed_on
    _workers_failed_on = closed_error(run_id, closed) if closed is not None and closed.failed else None


def ending_of(err: BaseException) -> Optional[tuple[str, int]]:
    """The line and exit status an uncaught `err` ends the process with, or None (not ours: the
    usual traceback)."""
    if isinstance(err, (JobClosed, SettingError)):
        return err.line, err.status
    if _workers_failed_on is not None and isinstance(err, ChildFailedError):
        return _workers_failed_on.line, _workers_failed_on.status
    return None


ExceptHook = Callable[[type[BaseException], BaseException, Optional[TracebackType]], Any]


def _hook(previous: ExceptHook) -> ExceptHook:
    def hook(kind: type[BaseException], err: BaseException, tb: Optional[TracebackType]) -> Any:
        ending = ending_of(err)
        if ending is None:
            return previous(kind, err, tb)
        line, status = ending
        print(line, file=sys.stderr, flush=True)
        raise SystemExit(status)  # from an excepthook: the process exits with `status`

    hook.oobleck_exit_hook = True  # type: ignore[attr-defined]
    return hook


def install_exit_hook() -> None:
    """Make an uncaught `JobClosed` / `SettingError` (and a `ChildFailedError` of a job closed as
    failed) end the process with its line and status; once per process, chained to the hook before."""
    if not getattr(sys.excepthook, "oobleck_exit_hook", False):
        sys.excepthook = _hook(sys.excepthook)


__all__ = [
    "JobClosed",
    "PREFIX",
    "STATUS_FAILED",
    "STATUS_FINISHED",
    "STATUS_SETTING",
    "SettingError",
    "closed_error",
    "ending_of",
    "install_exit_hook",
    "note_closed",
]
