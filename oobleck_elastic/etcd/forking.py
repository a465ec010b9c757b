"""A process forked while it held etcd clients refuses etcd in the child, in one line.

gRPC does not survive `fork()` while other threads are inside it (a client's watch and keep-alive
streams always are): its fork handlers are skipped, the child shares the parent's poller, and
its own new channels fail or crash at random (`ev_epoll1_linux.cc ... Check failed`). So, with
`os.register_at_fork`, the parent notes before each fork whether any client was open (no gRPC
call, nothing to pay for a fork that never touches etcd, such as a DataLoader worker's), and such
a child raises `EtcdError(FORKED)` on its first etcd request, from a client it inherited or one
it connects anew. A client inherited by any child is refused too, and its close touches no gRPC.
docs/running.md says what a program that forks should do instead.
"""

from __future__ import annotations

import os
from typing import Optional

from . import closing
from .settings import EtcdError

FORKED = (
    "this process was forked from pid {pid} while that process held etcd clients, and gRPC does not "
    'survive such a fork: start it with the "spawn" or "forkserver" method (e.g. '
    'multiprocessing.get_context("spawn")), or fork before connecting to etcd'
)
"""The one line a refused request raises (`pid`: the parent's)."""

_open_at_fork: Optional[int] = None  # the forking process's pid when it held an open client
forked_from: Optional[int] = None
"""In a child forked while its parent held open clients: the parent's pid; None otherwise."""


def _before_fork() -> None:
    global _open_at_fork
    _open_at_fork = os.getpid() if closing.open_clients() else None


def _after_fork_in_child() -> None:
    global forked_from, _open_at_fork
    if _open_at_fork is not None:
        forked_from = _open_at_fork
    _open_at_fork = None
    closing.reset_in_child()  # the parent's clients are not this process's to close


def _after_fork_in_parent() -> None:
    global _open_at_fork
    _open_at_fork = None


def check(owner_pid: Optional[int] = None) -> None:
    """Raise `EtcdError(FORKED)` when this process may not use etcd: it was forked while its
    parent held clients, or `owner_pid` (the process that connected a client) is not this one."""
    if forked_from is not None:
        raise EtcdError(FORKED.format(pid=forked_from))
    if owner_pid is not None and owner_pid != os.getpid():
        raise EtcdError(FORKED.format(pid=owner_pid))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child, after_in_parent=_after_fork_in_parent)

__all__ = ["FORKED", "check", "forked_from"]
