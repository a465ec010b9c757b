"""A c10d `Store` on etcd v3, for `init_process_group(backend, store=EtcdStore(...), ...)`.

Every key lives under the store's prefix (one per generation); `add` and `compare_set` are
compare-and-swap transactions with TCPStore's semantics; nothing read is unpickled. The story:
docs/design.md.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import pyetcd.exceptions
import torch.distributed as dist

from .client import EtcdClient

_WATCH_SLICE_S = 5.0
_HOOK_SLICE_S = 0.25


def _to_bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdStore(dist.Store):
    """c10d Store whose keys live in etcd under `prefix`.

    `client` is a connected `EtcdClient` (see `connect`). It may be shared with other users in
    the same process, because gRPC channels are thread-safe.
    """

    def __init__(
        self,
        client: EtcdClient,
        *,
        prefix: str,
        timeout: timedelta = timedelta(seconds=300),
        on_wait: Optional[Callable[[float], None]] = None,
        min_wait: Optional[timedelta] = None,
    ) -> None:
        super().__init__()
        if not prefix.strip("/"):
            raise ValueError(
                "EtcdStore needs a non-empty prefix such as '/oobleck/<run>/gen3/store', "
                "so that delete_prefix() cannot wipe unrelated keys"
            )
        self.client = client
        self.prefix = "/" + prefix.strip("/") + "/"
        self.on_wait = on_wait
        self.min_wait = min_wait
        self.set_timeout(timeout)

    # ------------------------------------------------------------------ helpers
    def _key(self, key: str) -> str:
        return self.prefix + key

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # EtcdClient._call turns gRPC connection failures into an EtcdError that names the endpoint.
        return self.client._call(fn, *args, **kwargs)

    @property
    def _raw(self) -> Any:
        return self.client.raw

    def _txn(self, compare: list, success: list, failure: list) -> tuple[bool, list]:
        return self._call(self._raw.transaction, compare=compare, success=success, failure=failure)

    # ------------------------------------------------------------------ Store API
    def set(self, key: str, value: str | bytes) -> None:
        self._call(self._raw.put, self._key(key), _to_bytes(value))

    def get(self, key: str) -> bytes:
        """The value of key, waiting up to the store timeout for it to be set."""
        return self._wait_get([key], None)[0]

    def add(self, key: str, value: int) -> int:
        """Atomically add value to the integer stored at key (missing counts as 0); the new value."""
        k, tx = self._key(key), self._raw.transactions
        ok, resp = self._txn([tx.create(k) == 0], [tx.put(k, str(int(value)))], [tx.get(k)])
        if ok:
            return int(value)
        while True:
            kvs = resp[0]
            if not kvs:  # deleted meanwhile: start again from zero
                ok, resp = self._txn([tx.create(k) == 0], [tx.put(k, str(int(value)))], [tx.get(k)])
                if ok:
                    return int(value)
                continue
            current, meta = kvs[0]
            try:
                new = int(current) + int(value)
            except ValueError:
                raise ValueError(f"EtcdStore.add: key {key!r} holds {current[:40]!r}, not an integer") from None
            ok, resp = self._txn([tx.mod(k) == meta.mod_revision], [tx.put(k, str(new))], [tx.get(k)])
            if ok:
                return new

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """TCPStore's compare-and-set: key missing and expected "": set, return desired; key missing
        and expected not "": return expected; value == expected: set, return desired; otherwise
        return the current value."""
        k, tx = self._key(key), self._raw.transactions
        expected, desired = _to_bytes(expected_value), _to_bytes(desired_value)
        while True:
            ok, resp = self._txn([tx.value(k) == expected], [tx.put(k, desired)], [tx.get(k)])
            if ok:
                return desired
            if resp[0]:
                return resp[0][0][0]
            if expected:
                return expected
            ok, _ = self._txn([tx.create(k) == 0], [tx.put(k, desired)], [])
            if ok:
                return desired
            # created by someone else between the two transactions: compare against it

    def wait(self, keys: Sequence[str], override_timeout: Optional[timedelta] = None) -> None:
        """Block until every key is set, or raise DistStoreError after the timeout."""
        self._wait_get(list(keys), override_timeout)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether all keys are set (one read, no waiting)."""
        keys = list(keys)
        if not keys:
            return True
        tx = self._raw.transactions
        _, resp = self._txn([], [tx.get(self._key(k)) for k in keys], [])
        return all(bool(kvs) for kvs in resp)

    def delete_key(self, key: str) -> bool:
        return bool(self._call(self._raw.delete, self._key(key)))

    def num_keys(self) -> int:
        """Number of keys under this store's prefix."""
        return int(self._call(self._raw.get_prefix_response, self.prefix, count_only=True).count)

    def clone(self) -> "EtcdStore":
        """A store on the same client, prefix and timeout (c10d clones stores for some backends)."""
        return EtcdStore(
            self.client, prefix=self.prefix, timeout=self._timeout(), on_wait=self.on_wait, min_wait=self.min_wait
        )

    # ------------------------------------------------------------------ extras
    def delete_prefix(self) -> int:
        """Delete every key of this store (e.g. an old generation's); returns how many were deleted."""
        return int(self._call(self._raw.delete_prefix, self.prefix).deleted)

    def __repr__(self) -> str:
        return f"EtcdStore({self.client.settings.endpoint}, prefix={self.prefix!r})"

    # ------------------------------------------------------------------ waiting
    def _timeout(self) -> timedelta:
        """The store's timeout (a property of c10d's Store that torch's type stubs do not declare)."""
        return self.timeout  # type: ignore[attr-defined]

    def _wait_get(self, keys: list[str], override_timeout: Optional[timedelta]) -> list[bytes]:
        timeout = override_timeout if override_timeout is not None else self._timeout()
        if self.min_wait is not None and timeout.total_seconds() > 0:
            timeout = max(timeout, self.min_wait)
        total_s = timeout.total_seconds()
        start = time.monotonic()
        deadline = start + total_s if total_s > 0 else float("inf")
        slice_s = _WATCH_SLICE_S if self.on_wait is None else _HOOK_SLICE_S
        values = []
        for key in keys:
            k = self._key(key)
            while True:
                resp = self._call(self._raw.get_response, k)
                if resp.count:
                    values.append(resp.kvs[0].value)
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [key] + [
                        other
                        for other in keys[len(values) + 1 :]
                        if not self._call(self._raw.get_response, self._key(other)).count
                    ]
                    raise dist.DistStoreError(
                        f"EtcdStore: timed out after {total_s:g} s waiting for key(s) {missing} under "
                        f"{self.prefix!r} at etcd {self.client.settings.endpoint}: a peer never set them "
                        "(did one die or start late?); raise the store/process-group timeout if peers "
                        "are just slow"
                    )
                try:  # from the revision after our read, so a put in between still wakes us
                    self._call(
                        self._raw.watch_once_response,
                        k,
                        timeout=min(remaining, slice_s),
                        start_revision=resp.header.revision + 1,
                    )
                except pyetcd.exceptions.WatchTimedOut:
                    pass
                if self.on_wait is not None:
                    self.on_wait(time.monotonic() - start)
        return values
