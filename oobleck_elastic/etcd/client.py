"""A thin wrapper over `pyetcd` (etcd-sdk-python, the etcd3 API) for the control plane.

Invariant: nothing outside this package touches `pyetcd`; every verb is retried across an etcd
outage of up to `outage_s`, and control data is stored as JSON, never unpickled. The story:
docs/design.md.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import grpc
import pyetcd
import pyetcd.etcdrpc
import pyetcd.exceptions
from pyetcd.client import EtcdTokenCallCredentials

from . import closing, forking
from .keepalive import KeepAliveStream
from .settings import EtcdError, EtcdSettings

log = logging.getLogger(__name__)

RETRY_S = 0.25
"""Seconds between two tries of a request while etcd is out of reach."""
_MEMBER_RETRY_S = 1.0
_STALL_S = 1.0  # a request answered later than this counts as an outage (etcd was stalled)
# what etcd answers when credentials are missing, wrong or not allowed (gRPC details)
_AUTH_MARKERS = (
    "user name is empty",
    "authentication failed",
    "permission denied",
    "user name not found",
    "invalid auth token",
)
# what pyetcd raises while no member answers: a member whose request failed is skipped for
# `_MEMBER_RETRY_S` (pyetcd's default is 300 s, which turned a 5 s stall into a dead job), and
# while every member is skipped it raises NoServerAvailableError or "Trying to use a failed node"
_UNREACHABLE = (
    pyetcd.exceptions.ConnectionFailedError,
    pyetcd.exceptions.ConnectionTimeoutError,
    pyetcd.exceptions.NoServerAvailableError,
    ValueError,
)


@dataclass(frozen=True)
class KV:
    """One key as stored: its value and the revisions and lease etcd keeps with it."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int = 0
    lease: int = 0
    """The lease the key is bound to (0: none; such a key never expires)."""

    @classmethod
    def of(cls, kv: Any) -> "KV":
        return cls(
            key=kv.key.decode(),
            value=bytes(kv.value),
            mod_revision=kv.mod_revision,
            create_revision=kv.create_revision,
            lease=getattr(kv, "lease", getattr(kv, "lease_id", 0)),
        )


class EtcdClient:
    """A connected pyetcd client: the control plane's verbs plus JSON helpers. `raw` is the
    pyetcd client, for this package only."""

    def __init__(self, raw: Any, settings: EtcdSettings) -> None:
        self.raw = raw
        self.settings = settings
        self._keepalive = KeepAliveStream(raw, settings.timeout_s)  # one stream for every lease refreshed here
        self._outage_since: Optional[float] = None  # monotonic time etcd was first found unreachable
        self.last_outage: Optional[tuple[float, float]] = None
        """(start, end), monotonic, of the last etcd outage this client rode out."""
        self.closed = False
        """`close()` was called: the channels are closed and every request fails."""
        self._watchers: list[Any] = []  # every pyetcd watch stream a watch went through (closed at close)
        self._close_lock = threading.Lock()
        self._pid = os.getpid()  # a forked child refuses the client it inherited (etcd/forking.py)
        closing.register(self)

    # ------------------------------------------------------------------ verbs
    def get(self, key: str) -> Optional[KV]:
        value, meta = self._call(self.raw.get, key)
        if value is None:
            return None
        return KV(
            key=key,
            value=bytes(value),
            mod_revision=meta.mod_revision,
            create_revision=meta.create_revision,
            lease=meta.lease_id,
        )

    def range(self, prefix: str, *, exact: bool = False) -> tuple[int, list[KV]]:
        """(revision of the read, every key under prefix sorted by key); with `exact`, the key
        `prefix` alone (an empty list when it does not exist)."""
        if exact:
            resp = self._call(self.raw.get_response, prefix)
        else:
            resp = self._call(self.raw.get_prefix_response, prefix, sort_order="ascend", sort_target="key")
        return resp.header.revision, [KV.of(kv) for kv in resp.kvs]

    def count(self, prefix: str) -> int:
        """How many keys are under prefix (the keys are not transferred)."""
        resp = self._call(self.raw.get_prefix_response, prefix, count_only=True)
        return int(resp.count)

    def put(self, key: str, value: bytes | str, *, lease: Optional[int] = None) -> None:
        self._call(self.raw.put, key, value, lease=lease)

    def put_if_absent(self, key: str, value: bytes | str, *, lease: Optional[int] = None) -> bool:
        """Create key; False if it exists already."""
        return bool(self._call(self.raw.put_if_not_exists, key, value, lease=lease))

    def put_if_revision(
        self, key: str, value: bytes | str, revision: Optional[int], *, lease: Optional[int] = None
    ) -> bool:
        """Compare-and-put: write key only if its mod revision is still `revision` (None: only if
        it does not exist). False when the compare failed (someone else wrote first)."""
        return self.transact(revisions={key: revision}, puts={key: value}, lease=lease)

    def swap(self, key: str, value: bytes | str, revision: Optional[int]) -> tuple[bool, Optional[KV]]:
        """Compare-and-put in one round trip: write key only if its mod revision is still
        `revision` (None: only if it does not exist). Returns whether it wrote, and the key as it
        is right after the transaction (the value written, or the one that won)."""
        tx = self.raw.transactions
        compare = [tx.create(key) == 0] if revision is None else [tx.mod(key) == revision]
        ok, resp = self._call(
            self.raw.transaction, compare=compare, success=[tx.put(key, value), tx.get(key)], failure=[tx.get(key)]
        )
        kvs = resp[-1]
        if not kvs:
            return bool(ok), None
        current, meta = kvs[0]
        return bool(ok), KV(
            key=key,
            value=bytes(current),
            mod_revision=meta.mod_revision,
            create_revision=meta.create_revision,
            lease=getattr(meta, "lease_id", 0),
        )

    def delete(self, key: str, *, revision: Optional[int] = None) -> bool:
        """Delete key (only if its mod revision is still `revision`, when given); whether it went."""
        if revision is None:
            return bool(self._call(self.raw.delete, key))
        tx = self.raw.transactions
        ok, _ = self._call(
            self.raw.transaction, compare=[tx.mod(key) == revision], success=[tx.delete(key)], failure=[]
        )
        return bool(ok)

    def transact(
        self,
        *,
        values: Optional[dict[str, bytes]] = None,
        revisions: Optional[dict[str, Optional[int]]] = None,
        puts: Optional[Mapping[str, bytes | str]] = None,
        lease: Optional[int] = None,
    ) -> bool:
        """One transaction: if every key in `values` holds that value and every key in `revisions`
        is at that mod revision (None: does not exist), put all of `puts` (under `lease`, when
        given). Whether it did."""
        tx = self.raw.transactions
        compare = [tx.value(k) == v for k, v in (values or {}).items()]
        compare += [tx.create(k) == 0 if r is None else tx.mod(k) == r for k, r in (revisions or {}).items()]
        ok, _ = self._call(
            self.raw.transaction,
            compare=compare,
            success=[tx.put(k, v, lease=lease) for k, v in (puts or {}).items()],
            failure=[],
        )
        return bool(ok)

    def delete_prefix(self, prefix: str) -> None:
        self._call(self.raw.delete_prefix, prefix)

    def compact(self, revision: int) -> None:
        """Drop the history before `revision` (watches from older revisions get a compaction)."""
        self._call(self.raw.compact, revision, physical=True)

    def grant_lease(self, ttl_s: float) -> int:
        """A new lease of `ttl_s` (rounded to whole seconds, at least 1); its id."""
        return int(self._call(self.raw.lease, max(1, int(round(ttl_s)))).id)

    def refresh_lease(self, lease_id: int) -> int:
        """Keep the lease alive; the TTL etcd now grants it, <= 0 when the lease is gone. Sent down
        this client's one keep-alive stream (`etcd.keepalive`), not a new stream per refresh."""
        return self._call(self._keepalive.refresh, lease_id)

    def revoke_lease(self, lease_id: int) -> None:
        """End the lease now; its keys disappear. A lease already gone is not an error."""
        try:
            self._call(self.raw.revoke_lease, lease_id)
        except pyetcd.exceptions.Etcd3Exception:
            pass
        except Exception as err:  # noqa: BLE001 - grpc's NOT_FOUND for a lease already expired
            if "not found" not in str(err):
                raise

    def cluster_leader(self) -> Optional[str]:
        """The name of the etcd member that currently leads the etcd cluster (raft leader)."""
        status = self._call(self.raw.status)
        return status.leader.name if status.leader is not None else None

    def watch(self, prefix: str, callback: Any, *, start_revision: int, exact: bool = False) -> Any:
        """Watch every key under prefix (with `exact`: the key `prefix` alone) from `start_revision`;
        `callback(response)` gets each response (`.events`, `.header.revision`), or an exception
        or None when the stream ends.
        See `etcd.mirror` for a watch that resumes by itself. A watch that etcd does not confirm in
        `timeout_s` is retried on a new stream (unless another caller replaced that stream
        already: threads resuming their watches together must not end each other's), for up to
        `outage_s`."""
        since = time.monotonic()
        used: list[Any] = []

        def add() -> Any:
            used[:] = [self.raw.watcher]  # the stream this attempt goes through
            if all(w is not used[0] for w in self._watchers):
                self._watchers = [w for w in self._watchers if closing.running(w)] + [used[0]]
            fn = self.raw.add_watch_callback if exact else self.raw.add_watch_prefix_callback
            return fn(prefix, callback, start_revision=start_revision)

        while True:
            started = time.monotonic()
            try:
                return self._call(add)
            except pyetcd.exceptions.WatchTimedOut:
                if time.monotonic() - since > self.settings.outage_s:
                    raise EtcdError(
                        f"etcd at {self.settings.endpoint} did not create a watch of {prefix} within "
                        f"{self.settings.outage_s:.0f} s"
                    ) from None
                if time.monotonic() - started < 0.9 * self.settings.timeout_s:
                    # the stream ended under the request (pyetcd starts it again at the next one):
                    # nothing is stuck, and replacing it would end every watch on it once more
                    time.sleep(RETRY_S)
                elif used and self.raw._stubs.get("watcher") is used[0]:
                    self._new_watch_stream()  # no answer for a whole timeout: the stream may be stuck

    def _new_watch_stream(self) -> None:
        """Close pyetcd's watch stream: the next watch opens a new one (with the current token)."""
        watcher = self.raw._stubs.pop("watcher", None)
        if watcher is not None:
            watcher.close()

    def cancel_watch(self, watch_id: Any) -> None:
        try:
            forking.check(self._pid)  # a forked child: nothing of the parent's to cancel, no gRPC to enter
            self.raw.cancel_watch(watch_id)
        except Exception:  # noqa: BLE001 - the stream may be gone already
            pass

    # ------------------------------------------------------------------ JSON values
    def get_json(self, key: str) -> tuple[Optional[Any], Optional[int]]:
        """(value, mod_revision) of a JSON key; (None, None) if absent, (None, rev) if malformed."""
        kv = self.get(key)
        if kv is None:
            return None, None
        return parse_json(kv.value, key, kv.mod_revision), kv.mod_revision

    def put_json(self, key: str, value: Any, *, lease: Optional[int] = None) -> None:
        self.put(key, json.dumps(value, sort_keys=True), lease=lease)

    def get_prefix_json(self, prefix: str) -> Iterator[tuple[str, Any]]:
        """(key, parsed value) for every key under prefix, sorted by key; malformed values skipped."""
        for kv in self.range(prefix)[1]:
            parsed = parse_json(kv.value, kv.key, kv.mod_revision)
            if parsed is not None:
                yield kv.key, parsed

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`, retried while etcd is unreachable, for up to `outage_s` from the
        start of the outage (one warning when it starts, one line when it ends); then EtcdError.
        Retrying is safe for the control plane's requests: reads, puts of whole values, and
        compare-and-swap transactions (a retried one that had succeeded fails its compare, which
        callers treat as a lost race and re-read)."""
        forking.check(self._pid)
        if self.closed:
            raise EtcdError(f"the etcd client of {self.settings.endpoint} was closed (this process is shutting down)")
        started = time.monotonic()
        renewed = False
        while True:
            try:
                result = fn(*args, **kwargs)
            except grpc.RpcError as err:
                details = (err.details() or "") if hasattr(err, "details") else str(err)
                if "invalid auth token" in details and self.settings.user and not renewed:
                    self._authenticate()  # etcd restarted: its simple tokens are gone, sign in again
                    renewed = True
                    continue
                if any(marker in details for marker in _AUTH_MARKERS):
                    raise EtcdError(auth_message(self.settings, details)) from None
                raise
            except _UNREACHABLE as err:
                if isinstance(err, ValueError) and "failed node" not in str(err):
                    raise
                now = time.monotonic()
                if self._outage_since is None:
                    self._outage_since = now
                    log.warning(
                        "etcd at %s is unreachable (%s); retrying for up to %.0f s",
                        self.settings.endpoint,
                        type(err).__name__,
                        self.settings.outage_s,
                    )
                if now - self._outage_since > self.settings.outage_s:
                    raise EtcdError(
                        f"etcd at {self.settings.endpoint} has been unreachable for more than "
                        f"{self.settings.outage_s:.0f} s ({type(err).__name__}): is the server running, "
                        "and is the endpoint right?"
                    ) from None
                time.sleep(RETRY_S)
                continue
            if self._outage_since is not None:
                now = time.monotonic()
                log.warning(
                    "etcd at %s is reachable again after %.1f s", self.settings.endpoint, now - self._outage_since
                )
                self.last_outage = (self._outage_since, now)
                self._outage_since = None
            elif time.monotonic() - started > _STALL_S:  # answered, but late: etcd stalled
                self.last_outage = (started, time.monotonic())
            return result

    def _authenticate(self) -> None:
        """Sign in again with the configured user and password (a new token for every request and
        for new watch streams)."""
        log.warning(
            "etcd at %s rejected the auth token (etcd restarted?); signing in again as %s",
            self.settings.endpoint,
            self.settings.user,
        )
        resp = self.raw.authstub.Authenticate(
            pyetcd.etcdrpc.AuthenticateRequest(name=self.settings.user, password=self.settings.password),
            self.settings.timeout_s,
        )
        self.raw.metadata = (("token", resp.token),)
        self.raw.call_credentials = grpc.metadata_call_credentials(EtcdTokenCallCredentials(resp.token))
        self._new_watch_stream()
        self._keepalive.reset()

    def outage_within(self, seconds: float) -> bool:
        """Whether etcd is unreachable now, or was (or answered later than `_STALL_S`) within the
        last `seconds`: leases may then have expired through no fault of their nodes."""
        if self._outage_since is not None:
            return True
        return self.last_outage is not None and time.monotonic() - self.last_outage[1] < seconds

    def close(self) -> None:
        """Close the client for good (idempotent): end its keep-alive and watch streams, close its
        gRPC channels and wait (briefly) for their threads and calls to end, so that nothing is
        left to the garbage collector at exit (`etcd.closing` says why that hangs)."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        if self._pid != os.getpid():
            return  # inherited by a forked child: its channels are the parent's, and gRPC must not be entered here
        closing.close_client(self.raw, self._watchers, self._keepalive)
        self._watchers = []
        closing.forget(self)


_warned: set[tuple[str, Optional[int]]] = set()


def warn_once(key: str, revision: Optional[int], message: str) -> None:
    """Log `message` once per (key, revision): a bad value read on every poll is reported once."""
    if (key, revision) not in _warned:
        if len(_warned) > 10_000:
            _warned.clear()
        _warned.add((key, revision))
        log.warning("%s", message)


def parse_json(value: bytes | str, key: str, revision: Optional[int] = None) -> Optional[Any]:
    """Parse a JSON value read from etcd; log (once per key and revision) and return None when it
    is malformed."""
    try:
        return json.loads(value)
    except (ValueError, UnicodeDecodeError):
        warn_once(key, revision, f"ignoring malformed JSON in etcd key {key}: {value[:80]!r}")
        return None


def auth_message(s: EtcdSettings, details: str) -> str:
    """One line for a request etcd refused for its credentials, saying what to change."""
    if not s.user:
        hint = (
            "this etcd has auth enabled: give a user and password (--rdzv-conf user=U,password=P, or --user "
            "and --password for `oobleck` commands); etcd accepts passwords only over TLS, so give cacert too"
        )
    else:
        hint = f"check the password and the permissions of etcd user '{s.user}'"
    return f"etcd at {s.endpoint} refused the request ({details}): {hint}"


def connect(settings: EtcdSettings, *, own_connection: bool = False) -> EtcdClient:
    """Connect and verify the server answers; raises EtcdError with what to change.

    gRPC shares one TCP connection between the channels of a process that reach the same
    endpoint with the same options (its global subchannel pool): two clients connected here share
    it, each with its own streams. With `own_connection`, this client opens a connection of its
    own, as a client in another process does (the control-plane benchmark hosts many simulated
    node agents per process, each connecting as a node's agent would)."""
    settings.check()
    forking.check()
    options = [("grpc.use_local_subchannel_pool", 1)] if own_connection else None
    try:
        creds = None
        if settings.cacert:
            creds = pyetcd.MultiEndpointEtcd3Client.get_secure_creds(settings.cacert, settings.key, settings.cert)
        endpoints = [
            pyetcd.Endpoint(host, port, secure=creds is not None, creds=creds, time_retry=_MEMBER_RETRY_S, opts=options)
            for host, port in settings.host_ports
        ]
        raw = pyetcd.MultiEndpointEtcd3Client(
            endpoints=endpoints,
            timeout=settings.timeout_s,
            user=settings.user,
            password=settings.password,
            failover=True,
        )
        for attempt in range(len(endpoints)):  # a member that does not answer: try the next one
            try:
                raw.status()
                break
            except (pyetcd.exceptions.ConnectionFailedError, pyetcd.exceptions.ConnectionTimeoutError):
                if attempt == len(endpoints) - 1:
                    raise
    except (
        pyetcd.exceptions.ConnectionFailedError,
        pyetcd.exceptions.ConnectionTimeoutError,
        pyetcd.exceptions.Etcd3Exception,
    ) as err:
        tls = " over TLS (check cacert/cert/key match the server)" if settings.cacert else ""
        raise EtcdError(
            f"cannot reach etcd at {settings.endpoint}{tls}: {type(err).__name__}{': ' + str(err) if str(err) else ''}"
        ) from None
    except Exception as err:  # grpc raises its own types for auth and TLS failures
        details = err.details() if isinstance(err, grpc.RpcError) and hasattr(err, "details") else ""
        if details and any(marker in details for marker in _AUTH_MARKERS):
            raise EtcdError(auth_message(settings, details)) from None
        raise EtcdError(f"cannot use etcd at {settings.endpoint}: {type(err).__name__}: {err}") from None
    return EtcdClient(raw, settings)
