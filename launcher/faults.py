"""Fault injection on one machine: kill a simulated node the way a machine loss kills it.

A node of `python -m launcher.local` is a torchrun agent with its workers. torchrun starts the
workers in sessions of their own, so the agent's process group does not contain them:
`kill_node` SIGKILLs the agent, its process group and every descendant found in /proc
(`descendants`) at once, so that every process of the node dies together, as with a machine that
loses power (its sockets close, its lease stops being refreshed). The story: docs/running.md.
"""

from __future__ import annotations

import os
import signal


def descendants(pid: int) -> list[int]:
    """All live descendants of pid, from /proc (torchrun starts workers in their own sessions,
    so the agent's process group does not contain them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_node(pid: int) -> list[int]:
    """SIGKILL a node: the torchrun agent (pid, its process group) and every descendant at once."""
    pids = [pid] + descendants(pid)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return pids
