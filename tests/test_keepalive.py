"""Lease keep-alives share one etcd stream per client (etcd/keepalive.py): many leases refreshed
from many threads get each its own answer through one `LeaseKeepAlive` stream (etcd's own count
of started streams says so), a lease that is gone answers 0, and a refresh rides out a stalled
and a restarted etcd as any request does."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

from oobleck_elastic.etcd import EtcdSettings, connect
from oobleck_elastic.etcd.server import EtcdServer

from helpers import stall_process


def _keepalive_streams(server: EtcdServer) -> int:
    """How many LeaseKeepAlive streams etcd has started (its /metrics)."""
    text = urllib.request.urlopen(f"{server.client_url}/metrics", timeout=10).read().decode()
    m = re.search(r'grpc_server_started_total\{[^}]*grpc_method="LeaseKeepAlive"[^}]*\} (\d+)', text)
    return int(m.group(1)) if m else 0


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
