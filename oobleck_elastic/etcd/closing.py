"""Closing etcd clients explicitly: their gRPC calls, channels and threads, never the garbage collector.

Invariant: every client `connect` makes is closed before the interpreter finalizes (by its owner,
else by the exit hook here), because a gRPC call collected at finalization can block the process
forever. The story: docs/design.md.
"""

from __future__ import annotations

import atexit
import gc
import logging
import threading
import time
import weakref
from typing import Any, Iterable, Protocol

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 5.0
"""How long closing a client waits for its threads and calls to end (they end within
milliseconds once the channel is closed; this bounds a wedged one)."""


class Closable(Protocol):
    closed: bool

    def close(self) -> None: ...


_open: "weakref.WeakSet[Any]" = weakref.WeakSet()
_lock = threading.Lock()


def register(client: Closable) -> None:
    """Remember `client` until it is closed or collected (closed at exit if still open)."""
    with _lock:
        _open.add(client)


def forget(client: Closable) -> None:
    with _lock:
        _open.discard(client)


def reset_in_child() -> None:
    """In a child just forked: forget the parent's clients (closing them would call into the
    parent's gRPC) and take a fresh lock (another thread of the parent may have held this one)."""
    global _open, _lock
    _open = weakref.WeakSet()
    _lock = threading.Lock()


def open_clients() -> list[Any]:
    """The registered clients not closed yet."""
    with _lock:
        return [c for c in list(_open) if not c.closed]


def close_open_clients() -> int:
    """Close every registered client still open, then collect the garbage while every thread
    still runs (at exit, before finalization: a daemon thread ended there while it holds a gRPC
    call's lock leaves it taken, and collecting that call blocks the exit for good; docs/design.md);
    how many were open."""
    left = open_clients()
    for client in left:
        log.debug("closing an etcd client still open at exit (%s)", getattr(client, "settings", client))
        try:
            client.close()
        except Exception:  # noqa: BLE001 - exiting: close the others
            pass
    gc.collect()
    return len(left)


atexit.register(close_open_clients)


def running(watcher: Any) -> bool:
    """Whether a pyetcd watcher's thread may still run (it is then closed and joined at close)."""
    thread = getattr(watcher, "_callback_thread", None)
    return thread is not None and thread.is_alive()


def _threads(watchers: Iterable[Any]) -> list[threading.Thread]:
    return [t for w in watchers if (t := getattr(w, "_callback_thread", None)) is not None]


def close_client(raw: Any, watchers: Iterable[Any], keepalive: Any, wait_s: float = CLOSE_WAIT_S) -> bool:
    """Close a pyetcd client `raw` (docs/design.md): its keep-alive stream (`keepalive`, which
    waits for its own readers), every watcher in `watchers`, its channels; then wait up to `wait_s`
    for the watch threads and the channels' calls to end. True when everything ended in time."""
    deadline = time.monotonic() + wait_s
    watchers = list(watchers)
    stubs = getattr(raw, "_stubs", {})
    current = stubs.get("watcher")
    if current is not None and all(current is not w for w in watchers):
        watchers.append(current)
    keepalive.close()
    for watcher in watchers:
        try:
            watcher.close()
        except Exception:  # noqa: BLE001 - a stream already broken
            pass
    channels = [ep.channel for ep in getattr(raw, "endpoints", {}).values()]
    try:
        raw.close()
    except Exception:  # noqa: BLE001 - closing a broken channel must not mask the real error
        pass
    me = threading.current_thread()
    for thread in _threads(watchers):
        if thread is not me:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
    while time.monotonic() < deadline and any(_in_flight(ch) for ch in channels):
        time.sleep(0.005)
    stubs.clear()  # the stubs and the watchers hold the calls: drop them now, not at exit
    ended = not any(_in_flight(ch) for ch in channels) and not any(
        t.is_alive() for t in _threads(watchers) if t is not me
    )
    if not ended:
        log.warning("closing the etcd client: gRPC calls or watch threads still running after %.0f s", wait_s)
    return ended


def _in_flight(channel: Any) -> bool:
    """Whether gRPC's spin thread of `channel` still has calls to deliver events to."""
    state = getattr(channel, "_call_state", None)
    if state is None:
        return False
    with state.lock:
        return bool(state.managed_calls)
