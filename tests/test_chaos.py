"""Seeded chaos, run by hand (CI skips it):

    OOBLECK_CHAOS_SEED=7 OOBLECK_CHAOS_EVENTS=6 .venv/bin/python -m pytest -m chaos tests/test_chaos.py

A 4-node job runs while a seeded schedule SIGKILLs random nodes (the leader included) and starts
new ones, one event after the previous reconfiguration has finished; checkpoints every 3 steps
cover the cases where every copy of a layer dies. The invariant is the same as everywhere: the
final weights equal an uninterrupted single-process run on the same global batches."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from helpers import assert_same, run_job, tiny_profile, when

pytestmark = pytest.mark.chaos


def test_random_kills_and_joins(tmp_path: Path, etcd_server, run_id) -> None:
    from launcher.local import kill_node
    from oobleck_elastic.records.keys import Keys
    from oobleck_elastic.rendezvous.membership import live_nodes

    seed = int(os.environ.get("OOBLECK_CHAOS_SEED", "0"))
    events = int(os.environ.get("OOBLECK_CHAOS_EVENTS", "4"))
    rng = random.Random(seed)
    kinds = [rng.choice(["kill", "kill", "join"]) for _ in range(events)]
    steps = 8 + 6 * events
    event_steps = [4 + 6 * i for i in range(events)]
    joins = [str(s) for s, k in zip(event_steps, kinds) if k == "join"]
    kills = [s for s, k in zip(event_steps, kinds) if k == "kill"]
    keys = Keys("/oobleck", run_id)
    done: list[str] = []

    def chaos(proc) -> None:
        generation = 1
        for at in kills:

            def ready(c, at=at) -> bool:
                progress = c.get_json(keys.progress)[0] or {}
                # the generation reached so far, read when polled (it grows after each kill)
                return progress.get("step", 0) >= at and progress.get("generation", 0) >= generation  # noqa: B023

            def kill(c) -> None:
                nodes = live_nodes(c, keys)
                if len(nodes) > 2:  # keep n0 = 2 nodes alive
                    victim = rng.choice(nodes)
                    kill_node(victim.agent_pid)
                    done.append(victim.node_id)

            when(etcd_server.endpoint, proc, ready, kill)
            generation += 1

    profile = tiny_profile(tmp_path / "profile.json")
    launcher_args = ["--nodes", "4", "--exit-grace", "20"] + [a for s in joins for a in ("--join", s)]
    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        launcher_args,
        steps,
        profile,
        extra=["checkpoint.interval_steps=3"],
        during=chaos,
        killed_by_test=lambda: len(done),
    )
    print(f"seed {seed}: events {list(zip(event_steps, kinds))}, killed {done}")
    assert_same(job, ref)
