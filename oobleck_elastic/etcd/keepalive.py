"""Lease keep-alives over one long-lived etcd stream per client.

Invariant: one `LeaseKeepAlive` stream per client, however many leases it refreshes. The story:
docs/liveness.md.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Optional

import grpc
import pyetcd.etcdrpc
import pyetcd.exceptions


class _Waiter:
    """One refresh waiting for its answer: the granted TTL, or the error that ended the stream."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ttl = 0
        self.error: Optional[BaseException] = None


class _Stream:
    """One open `LeaseKeepAlive` call, its request queue and its reader thread."""

    def __init__(self, raw: Any, on_end: Any) -> None:
        self.stub = raw.leasestub
        self.requests: queue.Queue = queue.Queue()
        self.waiters: dict[int, list[_Waiter]] = {}
        self.lock = threading.Lock()
        self.ended = False
        self.call = self.stub.LeaseKeepAlive(
            iter(self.requests.get, None), credentials=raw.call_credentials, metadata=raw.metadata
        )
        self.reader = threading.Thread(target=self._read, args=(on_end,), name="oobleck-keepalive", daemon=True)
        self.reader.start()

    def _read(self, on_end: Any) -> None:
        error: BaseException
        try:
            for response in self.call:
                with self.lock:
                    waiting = self.waiters.get(response.ID)
                    waiter = waiting.pop(0) if waiting else None
                if waiter is not None:
                    waiter.ttl = int(response.TTL)
                    waiter.done.set()
            error = pyetcd.exceptions.ConnectionFailedError()  # etcd ended the stream
        except grpc.RpcError as err:
            error = err
        self.end(error)
        on_end(self)

    def ask(self, lease_id: int) -> _Waiter:
        waiter = _Waiter()
        with self.lock:
            if self.ended:
                waiter.error = pyetcd.exceptions.ConnectionFailedError()
                waiter.done.set()
                return waiter
            self.waiters.setdefault(lease_id, []).append(waiter)
        self.requests.put(pyetcd.etcdrpc.LeaseKeepAliveRequest(ID=lease_id))
        return waiter

    def end(self, error: BaseException) -> None:
        """Fail every waiting refresh with `error` and close the call (idempotent)."""
        with self.lock:
            self.ended = True
            waiting = [w for ws in self.waiters.values() for w in ws]
            self.waiters.clear()
        for waiter in waiting:
            waiter.error = error
            waiter.done.set()
        self.requests.put(None)  # ends the request iterator
        self.call.cancel()


class KeepAliveStream:
    """Refreshes leases through one shared `LeaseKeepAlive` stream of a pyetcd client (`raw`)."""

    def __init__(self, raw: Any, timeout_s: float) -> None:
        self.raw = raw
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._stream: Optional[_Stream] = None
        self._streams: list[_Stream] = []  # every stream opened and maybe not over yet (joined at close)

    def _current(self) -> _Stream:
        with self._lock:
            stream = self._stream
            if stream is None or stream.ended or stream.stub is not self.raw.leasestub:
                if stream is not None:
                    stream.end(pyetcd.exceptions.ConnectionFailedError())
                stream = self._stream = _Stream(self.raw, self._forget)
                self._streams = [s for s in self._streams if s.reader.is_alive()] + [stream]
            return stream

    def _forget(self, stream: _Stream) -> None:
        with self._lock:
            if self._stream is stream:
                self._stream = None

    def refresh(self, lease_id: int) -> int:
        """Keep the lease alive; the TTL etcd now grants it (0 when the lease is gone). Raises
        pyetcd's exceptions (or the gRPC error) as a per-request refresh would."""
        stream = self._current()
        waiter = stream.ask(lease_id)
        if not waiter.done.wait(self.timeout_s):
            # no answer within the timeout: like a request's DEADLINE_EXCEEDED, the endpoint is
            # marked failed (pyetcd tries another member next) and the stream is ended
            stream.end(pyetcd.exceptions.ConnectionTimeoutError())
            self._forget(stream)
            self.raw.endpoint_in_use.fail()
            self.raw._clear_old_stubs()
            raise pyetcd.exceptions.ConnectionTimeoutError()
        if waiter.error is None:
            return waiter.ttl
        if isinstance(waiter.error, grpc.RpcError):
            try:
                raise waiter.error
            except grpc.RpcError as err:
                self.raw._manage_grpc_errors(err)  # marks the endpoint, raises pyetcd's exception (or err)
        raise waiter.error

    def reset(self) -> None:
        """End the stream (the next refresh opens a new one: after signing in again)."""
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.end(pyetcd.exceptions.ConnectionFailedError())

    def close(self, wait_s: float = 2.0) -> None:
        """End the stream and wait (up to `wait_s`) for the reader thread of every stream it opened,
        the ones replaced before included: a reader still in gRPC at exit can leave a call's lock
        taken for good (`etcd.closing`)."""
        with self._lock:
            stream, self._stream = self._stream, None
            streams, self._streams = self._streams, []
        if stream is not None:
            stream.end(pyetcd.exceptions.ConnectionFailedError())
        deadline = time.monotonic() + wait_s
        for s in streams:
            if s.reader is not threading.current_thread():
                s.reader.join(timeout=max(0.0, deadline - time.monotonic()))
