"""A job waiting for nodes costs nothing: a lone agent below n0 (too few nodes for one replica)
sleeps until a change instead of asking the planner again on every pass (it used to take 1.5
cores of its agent and a third of etcd's, writing the same fence thousands of times a second)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from helpers import a_follower, run_job, tiny_profile, when

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of `pids` so far (0 for a process that is gone)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / _TICKS


@pytest.mark.slow
def test_a_lone_agent_below_n0_is_idle(tmp_path: Path, etcd_server, run_id) -> None:
    """Two nodes run one 2-stage pipeline (n0 = 2); one is killed at step 3. Over the next 20 s
    the survivor's agent (its leader among them) uses under 1 % of a core, and etcd's revision
    does not move (nothing but lease keep-alives, which do not write)."""
    from launcher.local import descendants, kill_node
    from oobleck_elastic.records.keys import Keys
    from oobleck_elastic.records.control import EventKind
    from oobleck_elastic.rendezvous.membership import live_nodes, read_events

    keys = Keys("/oobleck", run_id)
    seen: dict[str, float] = {}

    def waiting(client) -> bool:
        return any(ev.kind == EventKind.WAITING for _, ev in read_events(client, keys))

    def measure(client) -> None:
        time.sleep(2.0)  # the refused re-plan and its log lines are done
        (survivor,) = live_nodes(client, keys)
        agent = survivor.agent_pid
        worker = descendants(agent)
        rev0 = client.range(keys.root)[0]
        agent0, worker0 = cpu_seconds([agent]), cpu_seconds(worker)
        time.sleep(20.0)
        seen.update(
            agent=cpu_seconds([agent]) - agent0,
            worker=cpu_seconds(worker) - worker0,
            writes=client.range(keys.root)[0] - rev0,
        )

    def during(proc) -> None:
        when(
            etcd_server.endpoint,
            proc,
            lambda c: (c.get_json(keys.progress)[0] or {}).get("step", 0) >= 3,
            lambda c: kill_node(a_follower(c, keys).agent_pid),
        )
        when(etcd_server.endpoint, proc, waiting, measure, timeout=120)
        proc.terminate()

    run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "2"],
        400,
        tiny_profile(tmp_path / "p.json"),
        during=during,
        expect_failure=True,
        reference=False,
    )
    print(seen)
    assert seen and seen["writes"] == 0, seen
    assert seen["agent"] < 0.2, seen
