"""Lease keep-alives share one etcd stream per client (etcd/keepalive.py): many leases refreshed
from many threads get each its own answer through one `LeaseKeepAlive` stream (etcd's own count
of started streams says so), a lease that is gone answers 0, and a refresh rides out a stalled
and a restarted etcd as any request does. On a fake stub: a broken stream, a missing answer and
an auth error reach the caller as pyetcd's per-request errors would."""

from __future__ import annotations

import threading
import time

import grpc
import pyetcd.etcdrpc
import pyetcd.exceptions
import pytest

from oobleck_elastic.etcd import EtcdSettings, connect
from oobleck_elastic.etcd.keepalive import KeepAliveStream
from oobleck_elastic.etcd.server import EtcdServer

from helpers import etcd_grpc, stall_process


def _keepalive_streams(server: EtcdServer) -> int:
    """How many LeaseKeepAlive streams etcd has started (its /metrics)."""
    return etcd_grpc(server, "grpc_server_started_total").get("LeaseKeepAlive", 0)


def test_many_leases_share_one_stream_and_each_gets_its_answer(own_etcd) -> None:
    client = connect(EtcdSettings(endpoint=own_etcd.endpoint, timeout_s=2.0))
    try:
        leases = {client.grant_lease(ttl): ttl for ttl in (3, 7, 11, 13)}
        gone = client.grant_lease(5)
        client.revoke_lease(gone)
        before = _keepalive_streams(own_etcd)
        answers: dict[int, list[int]] = {lease: [] for lease in [*leases, gone]}

        def refresh(lease: int) -> None:
            for _ in range(10):
                answers[lease].append(client.refresh_lease(lease))

        threads = [threading.Thread(target=refresh, args=(lease,)) for lease in answers for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        # each refresh got the TTL of its own lease (etcd grants the full TTL again), the revoked one 0
        assert {lease: sorted(set(got)) for lease, got in answers.items()} == {
            **{lease: [ttl] for lease, ttl in leases.items()},
            gone: [0],
        }
        assert sum(len(got) for got in answers.values()) == 150
        assert _keepalive_streams(own_etcd) - before == 1  # 150 refreshes, one stream
    finally:
        client.close()


def test_a_refresh_rides_out_a_stalled_and_a_restarted_server(own_etcd) -> None:
    client = connect(EtcdSettings(endpoint=own_etcd.endpoint, timeout_s=1.0, outage_s=30.0))
    try:
        lease = client.grant_lease(60)
        assert client.refresh_lease(lease) == 60
        t0 = time.monotonic()
        stall = stall_process(own_etcd.pid, 3.0)
        time.sleep(0.2)
        assert client.refresh_lease(lease) > 0  # blocks in retries (new streams) until etcd answers
        assert time.monotonic() - t0 >= 2.5
        stall.join()

        port = own_etcd.port
        own_etcd.stop()

        def restart() -> None:
            time.sleep(2.0)
            own_etcd.port = port
            own_etcd.start()

        t = threading.Thread(target=restart, daemon=True)
        t.start()
        assert client.refresh_lease(lease) > 0  # the data dir kept the lease; a new stream carries it
        t.join()
    finally:
        client.close()


# ---------------------------------------------------------------------- failures, on a fake stub
class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeCall:
    """A LeaseKeepAlive call: answers each request with `ttl`, or ends with `error` at the first."""

    def __init__(self, requests, error=None, silent=False, ttl=9) -> None:
        self.requests, self.error, self.silent, self.ttl = requests, error, silent, ttl
        self.cancelled = threading.Event()

    def __iter__(self):
        for request in self.requests:
            if self.error is not None:
                raise self.error
            if self.silent:  # etcd stalled: no answer until the call is cancelled
                self.cancelled.wait(10)
                raise FakeRpcError(grpc.StatusCode.CANCELLED)
            yield pyetcd.etcdrpc.LeaseKeepAliveResponse(ID=request.ID, TTL=self.ttl)

    def cancel(self) -> None:
        self.cancelled.set()


class FakeRaw:
    """What KeepAliveStream uses of a pyetcd client; each call's behaviour comes from `plans`."""

    _manage_grpc_errors = pyetcd.MultiEndpointEtcd3Client._manage_grpc_errors

    def __init__(self, *plans: dict) -> None:
        self.plans, self.calls, self.failed, self.cleared = list(plans), [], 0, 0
        self.call_credentials = self.metadata = None
        self.leasestub = self
        self.endpoint_in_use = self

    def LeaseKeepAlive(self, requests, credentials=None, metadata=None) -> FakeCall:  # noqa: N802 - gRPC's name
        self.calls.append(FakeCall(requests, **self.plans.pop(0)))
        return self.calls[-1]

    def fail(self) -> None:
        self.failed += 1

    def _clear_old_stubs(self) -> None:
        self.cleared += 1


def test_a_broken_stream_fails_like_a_request_and_the_next_refresh_opens_another() -> None:
    raw = FakeRaw({"error": FakeRpcError(grpc.StatusCode.UNAVAILABLE)}, {})
    stream = KeepAliveStream(raw, timeout_s=2.0)
    try:
        with pytest.raises(pyetcd.exceptions.ConnectionFailedError):
            stream.refresh(7)
        assert raw.failed == 1  # pyetcd tries another member next
        assert stream.refresh(7) == 9 and len(raw.calls) == 2
    finally:
        stream.close()


def test_no_answer_within_the_timeout_is_a_timeout_and_ends_the_stream() -> None:
    raw = FakeRaw({"silent": True}, {})
    stream = KeepAliveStream(raw, timeout_s=0.3)
    try:
        with pytest.raises(pyetcd.exceptions.ConnectionTimeoutError):
            stream.refresh(7)
        assert raw.calls[0].cancelled.is_set() and (raw.failed, raw.cleared) == (1, 1)
        assert stream.refresh(7) == 9 and len(raw.calls) == 2
    finally:
        stream.close()


def test_an_auth_error_reaches_the_caller_as_the_grpc_error() -> None:
    raw = FakeRaw({"error": FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, "invalid auth token")})
    stream = KeepAliveStream(raw, timeout_s=2.0)
    try:
        with pytest.raises(grpc.RpcError) as err:  # EtcdClient._call signs in again on this one
            stream.refresh(7)
        assert err.value.details() == "invalid auth token" and raw.failed == 0
    finally:
        stream.close()
