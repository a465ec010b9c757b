"""Seeded chaos: a 4-node job runs while a seeded schedule SIGKILLs random nodes (the leader
included) and starts new ones; checkpoints every 3 steps cover the cases where every copy of a
layer dies. The invariant is the same as everywhere: the final weights equal an uninterrupted
single-process run on the same global batches.

    make test-all       # seeds 1-5 and 4242, 8 events each (extended: not in CI)
    OOBLECK_CHAOS_SEED=7 OOBLECK_CHAOS_EVENTS=6 .venv/bin/python -m pytest -m chaos -s tests/chaos/test_chaos.py

The schedule keeps n0 = 2 nodes alive by what the job itself has seen: the next victim is chosen
only once the current plan has left out every node killed before (so a node whose record has not
expired yet is never counted as alive), among that plan's nodes, and only while more than two of
them are left. A seed therefore can never make the job's task impossible."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from helpers import assert_same, run_job, tiny_profile, when

N0 = 2  # the tiny profile's fewest nodes for one replica


def schedule(seed: int, events: int) -> tuple[list[tuple[int, str]], int]:
    """(step, kill|join) of each event and the job's steps, from the seed."""
    rng = random.Random(seed)
    kinds = [rng.choice(["kill", "kill", "join"]) for _ in range(events)]
    return [(4 + 6 * i, kind) for i, kind in enumerate(kinds)], 8 + 6 * events


def pick_victim(rng: random.Random, plan_nodes: list[str], killed: list[str]) -> str | None:
    """The next node to kill: one of the current plan's nodes, while more than n0 of them remain."""
    alive = [n for n in plan_nodes if n not in killed]
    return rng.choice(alive) if len(alive) > N0 else None


def test_a_victim_is_chosen_only_among_the_plans_nodes_while_more_than_n0_remain() -> None:
    rng = random.Random(0)
    assert pick_victim(rng, ["a", "b", "c"], []) in {"a", "b", "c"}
    assert pick_victim(rng, ["a", "b", "c"], ["c"]) is None  # two left: keep them
    assert pick_victim(rng, ["a", "b"], []) is None
    assert pick_victim(rng, ["a", "b", "c", "d"], ["a"]) in {"b", "c", "d"}
    assert schedule(4242, 8) == schedule(4242, 8) and len(schedule(4242, 8)[0]) == 8


def _chaos(tmp_path: Path, etcd_server, run_id: str, seed: int, events: int) -> None:
    from launcher.faults import kill_node
    from oobleck_elastic.planning import Plan
    from oobleck_elastic.records.keys import Keys
    from oobleck_elastic.rendezvous.membership import live_nodes

    plan_of_events, steps = schedule(seed, events)
    said = f"seed {seed}: events {plan_of_events}"
    print(said, flush=True)
    rng = random.Random(seed + 1)
    joins = [str(s) for s, k in plan_of_events if k == "join"]
    kills = [s for s, k in plan_of_events if k == "kill"]
    keys = Keys("/oobleck", run_id)
    done: list[str] = []

    def current_plan(c) -> Plan | None:
        value = c.get_json(keys.plan)[0]
        return Plan.from_json(value) if value else None

    def chaos(proc) -> None:
        for at in kills:

            def ready(c, at=at) -> bool:
                progress = c.get_json(keys.progress)[0] or {}
                plan = current_plan(c)
                # the job has reached the step, and its plan no longer holds a node killed before
                return (
                    progress.get("step", 0) >= at and plan is not None and not set(done) & set(plan.nodes)  # noqa: B023
                )

            def kill(c) -> None:
                plan = current_plan(c)
                assert plan is not None
                victim = pick_victim(rng, list(plan.nodes), done)
                if victim is None:
                    return
                record = next((r for r in live_nodes(c, keys) if r.node_id == victim), None)
                if record is not None:
                    kill_node(record.agent_pid)
                    done.append(victim)

            when(etcd_server.endpoint, proc, ready, kill)

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
    print(f"{said}, killed {done}", flush=True)
    assert_same(job, ref)


@pytest.mark.chaos
def test_random_kills_and_joins(tmp_path: Path, etcd_server, run_id) -> None:
    seed = int(os.environ.get("OOBLECK_CHAOS_SEED", "0"))
    events = int(os.environ.get("OOBLECK_CHAOS_EVENTS", "4"))
    _chaos(tmp_path, etcd_server, run_id, seed, events)


@pytest.mark.extended
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 4242])
def test_chaos_seeds(tmp_path: Path, etcd_server, run_id, seed: int) -> None:
    _chaos(tmp_path, etcd_server, run_id, seed, 8)
