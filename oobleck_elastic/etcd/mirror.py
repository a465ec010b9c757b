"""A local copy of the keys under some prefixes, kept current by etcd watches.

The control plane's readers read the mirror, not etcd, so the requests etcd serves do not grow
with the number of readers or steps, and readers go on while etcd is away. The story:
docs/design.md.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from typing import Any, Iterator, Optional

import pyetcd.events
import pyetcd.exceptions

from .client import RETRY_S, KV, EtcdClient, parse_json
from .settings import EtcdError

log = logging.getLogger(__name__)


class Mirror:
    """Every key under `prefixes`, as of the last watch event applied. A prefix that ends with
    "/" covers the keys under it; any other is one exact key."""

    def __init__(self, client: EtcdClient, prefixes: list[str] | str, *, name: str = "mirror") -> None:
        self.client = client
        self.prefixes = [prefixes] if isinstance(prefixes, str) else list(prefixes)
        self.name = name
        self._data: dict[str, KV] = {}
        self._keys: list[str] = []  # the keys of _data, sorted: a prefix read is a bisect, not a scan
        self._revision = {p: 0 for p in self.prefixes}  # last revision applied, per prefix
        self._watch: dict[str, Any] = {}
        self._cond = threading.Condition()
        self.version = 0
        """Grows by one with every applied change (see `wait`)."""
        self.error: Optional[EtcdError] = None
        self.resumes = 0
        """How many times a watch was re-established (for tests and logs)."""
        self._closed = False
        self._parsed: dict[str, tuple[int, Any]] = {}  # key -> (mod revision, parsed JSON): parse once

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Mirror":
        for prefix in self.prefixes:
            self._sync(prefix)
        return self

    def add(self, prefixes: list[str]) -> None:
        """Mirror these prefixes (or exact keys) too, from now on."""
        for prefix in prefixes:
            if prefix not in self._revision:
                self.prefixes.append(prefix)
                self._revision[prefix] = 0
                self._sync(prefix)

    def remove(self, prefixes: list[str]) -> None:
        """Stop mirroring these (keys still covered by another prefix stay)."""
        for prefix in prefixes:
            if prefix not in self._revision:
                continue
            self.prefixes.remove(prefix)
            del self._revision[prefix]
            watch_id = self._watch.pop(prefix, None)
            if watch_id is not None:
                self.client.cancel_watch(watch_id)
            with self._cond:
                for key in [k for k in self._data if _covers(prefix, k)]:
                    if not any(_covers(other, key) for other in self.prefixes):
                        del self._data[key]
                    self._parsed.pop(key, None)
                self._keys = sorted(self._data)
                self._changed()

    def close(self) -> None:
        self._closed = True
        for watch_id in list(self._watch.values()):
            self.client.cancel_watch(watch_id)
        self._watch.clear()
        with self._cond:
            self._cond.notify_all()

    def _sync(self, prefix: str) -> None:
        """List `prefix` and watch it from the revision after the listing."""
        exact = not prefix.endswith("/")
        revision, kvs = self.client.range(prefix, exact=exact)
        with self._cond:
            for key in [k for k in self._data if _covers(prefix, k)]:
                del self._data[key]
            self._data.update((kv.key, kv) for kv in kvs)
            self._keys = sorted(self._data)
            self._revision[prefix] = revision
            self._changed()
        self._follow(prefix)

    def _follow(self, prefix: str) -> None:
        """Watch `prefix` from the revision after the last one applied."""
        self._watch[prefix] = self.client.watch(
            prefix,
            lambda r, p=prefix: self._on_response(p, r),
            start_revision=self._revision[prefix] + 1,
            exact=not prefix.endswith("/"),
        )

    def _changed(self) -> None:
        self.version += 1
        self._cond.notify_all()

    def _on_response(self, prefix: str, response: Any) -> None:
        """A watch response (apply it), or the end of the stream (an exception or None: resume)."""
        if self._closed or prefix not in self._revision:  # closed, or a late answer for a removed prefix
            return
        events = getattr(response, "events", None)
        if events is None:  # the stream ended; pyetcd calls back from its own thread, so resume in another
            compacted = isinstance(response, pyetcd.exceptions.RevisionCompactedError)
            threading.Thread(
                target=self._resume, args=(prefix, compacted), name=f"{self.name}-resume", daemon=True
            ).start()
            return
        with self._cond:
            for event in events:
                key = event.key.decode()
                if isinstance(event, pyetcd.events.DeleteEvent):
                    if self._data.pop(key, None) is not None:
                        del self._keys[bisect.bisect_left(self._keys, key)]
                    self._parsed.pop(key, None)
                else:
                    if key not in self._data:
                        bisect.insort(self._keys, key)
                    self._data[key] = KV(
                        key=key,
                        value=bytes(event.value),
                        mod_revision=event.mod_revision,
                        create_revision=event.create_revision,
                        lease=event.lease,
                    )
                self._revision[prefix] = max(self._revision[prefix], event.mod_revision)
            if events:
                self._changed()

    def _resume(self, prefix: str, compacted: bool) -> None:
        self._watch.pop(prefix, None)
        since = time.monotonic()
        while not self._closed and prefix in self._revision:
            try:
                if compacted:
                    log.warning(
                        "%s: etcd compacted the history after revision %d; listing %s again",
                        self.name,
                        self._revision[prefix],
                        prefix,
                    )
                    self._sync(prefix)
                else:
                    self._follow(prefix)
                self.resumes += 1
                log.info("%s: watch of %s resumed from revision %d", self.name, prefix, self._revision[prefix] + 1)
                return
            except pyetcd.exceptions.RevisionCompactedError:
                compacted = True
            except Exception as err:  # noqa: BLE001 - an unexpected answer (a gRPC error): try again
                if not isinstance(err, EtcdError) and time.monotonic() - since <= self.client.settings.outage_s:
                    log.warning(
                        "%s: resuming the watch of %s failed (%s: %s); retrying",
                        self.name,
                        prefix,
                        type(err).__name__,
                        err,
                    )
                    time.sleep(RETRY_S)
                    continue
                if not isinstance(err, EtcdError):
                    err = EtcdError(
                        f"could not resume the watch of {prefix} for {self.client.settings.outage_s:.0f} "
                        f"s: {type(err).__name__}: {err}"
                    )
                log.error("%s: %s", self.name, err)
                with self._cond:
                    self.error = err
                    self._changed()
                return

    # ------------------------------------------------------------------ reads
    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def get(self, key: str) -> Optional[KV]:
        self._check()
        with self._cond:
            return self._data.get(key)

    def range(self, prefix: str) -> list[KV]:
        """Every key under prefix, sorted by key (the leader reads one node's readiness prefix per
        node: with 1,000 node records mirrored, a scan of every key per read was 1,000,000 string
        comparisons per leader tick)."""
        self._check()
        with self._cond:
            keys, out = self._keys, []
            i = bisect.bisect_left(keys, prefix)
            while i < len(keys) and keys[i].startswith(prefix):
                out.append(self._data[keys[i]])
                i += 1
            return out

    def _json(self, kv: KV) -> Any:
        """The parsed value of kv, parsed once per revision (callers must not modify it)."""
        cached = self._parsed.get(kv.key)
        if cached is not None and cached[0] == kv.mod_revision:
            return cached[1]
        value = parse_json(kv.value, kv.key, kv.mod_revision)
        self._parsed[kv.key] = (kv.mod_revision, value)
        return value

    def get_json(self, key: str) -> tuple[Optional[Any], Optional[int]]:
        """Like `EtcdClient.get_json`, from the mirror."""
        kv = self.get(key)
        if kv is None:
            return None, None
        return self._json(kv), kv.mod_revision

    def get_prefix_json(self, prefix: str) -> Iterator[tuple[str, Any]]:
        """Like `EtcdClient.get_prefix_json`, from the mirror."""
        for kv in self.range(prefix):
            parsed = self._json(kv)
            if parsed is not None:
                yield kv.key, parsed

    def nudge(self) -> None:
        """Wake every `wait` now, as a change would (for news that does not come from etcd)."""
        with self._cond:
            self._changed()

    def wait(self, version: int, timeout: float) -> int:
        """Block until `self.version` > version (a change was applied), the timeout, or close;
        returns the version now."""
        with self._cond:
            if self.version <= version and not self._closed:
                self._cond.wait(timeout)
            return self.version

    def wait_for(self, predicate: Any, timeout: float) -> bool:
        """Block until predicate(self) is true (checked after each change) or the timeout."""
        deadline = time.monotonic() + timeout
        version = self.version
        while not predicate(self):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            version = self.wait(version, left)
        return True


def _covers(prefix: str, key: str) -> bool:
    """Whether a mirrored `prefix` (ending in "/") or exact key covers `key`."""
    return key.startswith(prefix) if prefix.endswith("/") else key == prefix
