"""64 simulated agents (the real Member / Mirror / Leader code, `python -m bench control_plane`), each
with its own etcd client (its own TCP connection, watch stream and keep-alive stream, as a node's
agent), against one etcd: the first plan follows the last registration, killing 4 agents produces
the next plan before their leases expire (the leader finds their liveness sockets closed), and at
steady state etcd serves only lease keep-alives (one per node per TTL/3), down streams opened
before: nobody polls. And `connect(own_connection=True)`, which gives each simulated agent its
own connection where gRPC would share one per process."""

from __future__ import annotations

import os

import pytest

from bench import control_plane
from oobleck_elastic.etcd import EtcdSettings, connect
from oobleck_elastic.etcd.server import EtcdServer


def test_own_connection_opens_a_connection_per_client(own_etcd: EtcdServer) -> None:
    port = int(own_etcd.endpoint.rsplit(":", 1)[1])
    count = lambda: control_plane.etcd_connections([os.getpid()], port)  # noqa: E731
    settings = EtcdSettings(endpoint=own_etcd.endpoint)
    shared = [connect(settings) for _ in range(3)]
    try:
        assert count() == 1  # gRPC's channels of one process share one connection to an endpoint
        own = [connect(settings, own_connection=True) for _ in range(3)]
        try:
            assert count() == 4
        finally:
            for client in own:
                client.close()
    finally:
        for client in shared:
            client.close()


@pytest.mark.slow
def test_64_agents_plan_replan_and_do_not_poll() -> None:
    ttl = 2.0
    result = control_plane.run(64, procs=2, kill=4, ttl=ttl, settle=0.3, window=4.0)  # a client per agent
    assert result["clients"] == "per-agent"
    # what etcd served: 64 clients, each with its own connection, keep-alive stream and watch stream
    assert (result["etcd_clients"], result["etcd_connections"]) == (64, 64), result
    assert (result["keepalive_streams_open"], result["watch_streams_open"]) == (64, 64), result
    assert result["killed"] == 4
    assert result["first_plan_s"] < 5.0, result
    # the killed agents' liveness sockets closed: the leader re-plans without waiting for their leases
    assert result["kill_to_plan_s"] < ttl, result
    # keep-alives: 64 nodes x one per TTL/3 (= 96/s); anything else is not polling at a tick
    assert 0.6 * 64 * 3 / ttl < result["steady_keepalives_per_s"] < 1.5 * 64 * 3 / ttl, result
    assert result["steady_other_requests_per_s"] < 2.0, result
    # every refresh goes down the keep-alive stream its client opened once (not one per refresh)
    assert result["steady_keepalive_streams_opened_per_s"] == 0, result
    # an agent is a member, a leader loop and a liveness listener: 3 threads; its client 5 (keep-alive
    # reader and request feeder, watch callback and request feeder, gRPC's); and its process's
    assert result["threads_per_agent"] < 10, result
