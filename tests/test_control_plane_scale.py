"""64 simulated agents (the real Member / Mirror / Leader code, bench/control_plane.py) against
one etcd: the first plan follows the last registration, killing 4 agents produces the next plan
before their leases expire (the leader finds their liveness sockets closed), and at steady state
etcd serves only lease keep-alives (one per node per TTL/3), down streams opened before: nobody
polls."""

from __future__ import annotations

import sys

import pytest

from helpers import ROOT


@pytest.mark.slow
def test_64_agents_plan_replan_and_do_not_poll() -> None:
    sys.path.insert(0, str(ROOT / "bench"))  # the agent processes (spawned) import it by name too
    import control_plane as bench

    ttl = 2.0
    result = bench.run(64, procs=2, kill=4, ttl=ttl, settle=0.3, window=4.0)
    assert result["killed"] == 4
    assert result["first_plan_s"] < 5.0, result
    # the killed agents' liveness sockets closed: the leader re-plans without waiting for their leases
    assert result["kill_to_plan_s"] < ttl, result
    # keep-alives: 64 nodes x one per TTL/3 (= 96/s); anything else is not polling at a tick
    assert 0.6 * 64 * 3 / ttl < result["steady_keepalives_per_s"] < 1.5 * 64 * 3 / ttl, result
    assert result["steady_other_requests_per_s"] < 2.0, result
    # every refresh goes down a keep-alive stream each agent process opened once (not one per refresh)
    assert result["steady_keepalive_streams_opened_per_s"] == 0, result
    # an agent is a member, a leader loop and a liveness listener: 3 threads, and its process's gRPC ones
    assert result["threads_per_agent"] < 5, result
