"""The restart bound (rendezvous/restart_loop.py) on made-up generations, no etcd and no threads; and the
injected failure that drills it (OOBLECK_COMM_FAIL_AT)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from oobleck_elastic.etcd.memory import MemoryKV
from oobleck_elastic.records.errors import ErrorRecord
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.rendezvous.restart_loop import Attempt, read_attempts, restart_verdict
from oobleck_elastic.testing import layout_plan

NODES = ("n0", "n1")
KEYS = Keys("/oobleck", "run")


def _error(generation: int, text: str = "ConnectionError: injected") -> ErrorRecord:
    return ErrorRecord(
        signature=text,
        step=0,
        count=1,
        generation=generation,
        node="n1",
        local_rank=0,
        error=text,
        traceback=f"Traceback (most recent call last):\n  ...\n{text}\n",
        time=1.0,
    )


def _attempts(first: int, last: int, nodes: tuple[str, ...] = NODES) -> list[Attempt]:
    return [Attempt(g, nodes, _error(g)) for g in range(first, last + 1)]


def test_five_restarts_without_a_step_fail_naming_the_error() -> None:
    # generation 1, then restarts 2..6: after the fifth restart broke too, a sixth is refused
    verdict = restart_verdict(_attempts(1, 6), next_nodes=NODES, progress=0, bound=5)
    assert verdict is not None
    assert verdict.reason.startswith("generations 1-6 on the same 2 node(s) all broke before a step committed")
    assert "fault_tolerance.max_restarts_without_progress=5" in verdict.reason
    assert "ConnectionError: injected at step 0 on n1 local rank 0, in generations 1-6" in verdict.reason
    assert "\n" not in verdict.reason
    assert verdict.record == _error(6) and "Traceback" in verdict.record.traceback
    # one restart fewer: go on
    assert restart_verdict(_attempts(1, 5), next_nodes=NODES, progress=0, bound=5) is None


def test_different_errors_are_each_named_with_their_generations() -> None:
    attempts = _attempts(1, 4)
    attempts[1] = replace(attempts[1], error=_error(2, "RuntimeError: other"))
    attempts[3] = replace(attempts[3], error=None)
    verdict = restart_verdict(attempts, next_nodes=NODES, progress=0, bound=3)
    assert verdict is not None
    assert "ConnectionError: injected at step 0 on n1 local rank 0, in generations 1, 3" in verdict.reason
    assert "RuntimeError: other at step 0 on n1 local rank 0, in generation 2" in verdict.reason
    assert "no worker recorded why, in generation 4" in verdict.reason
    assert verdict.record == _error(3)  # the last error recorded, with its traceback


def test_a_step_committed_in_between_goes_on() -> None:
    # generation 3 committed a step: generations 4..6 are only 2 restarts after it
    assert restart_verdict(_attempts(1, 6), next_nodes=NODES, progress=3, bound=3) is None
    assert restart_verdict(_attempts(1, 7), next_nodes=NODES, progress=3, bound=3) is not None


def test_a_membership_change_in_between_goes_on() -> None:
    # a node joined for generation 4 (n2), left again for 5: the streak on n0, n1 starts at 5
    attempts = _attempts(1, 3) + _attempts(4, 4, ("n0", "n1", "n2")) + _attempts(5, 7)
    assert restart_verdict(attempts, next_nodes=NODES, progress=0, bound=3) is None
    assert restart_verdict(attempts + _attempts(8, 8), next_nodes=NODES, progress=0, bound=3) is not None


def test_a_shrinking_cluster_never_trips_it() -> None:
    # every generation lost a node before a step committed: no two in a row on the same nodes
    nodes = [tuple(f"n{i}" for i in range(k)) for k in range(8, 2, -1)]
    attempts = [Attempt(g, n, _error(g)) for g, n in enumerate(nodes, start=1)]
    assert restart_verdict(attempts, next_nodes=nodes[-1][:-1], progress=0, bound=1) is None


def test_a_re_plan_on_other_nodes_is_no_restart() -> None:
    assert restart_verdict(_attempts(1, 9), next_nodes=("n0",), progress=0, bound=3) is None


def test_bound_zero_never_fails() -> None:
    assert restart_verdict(_attempts(1, 50), next_nodes=NODES, progress=0, bound=0) is None


def test_a_gap_in_the_generations_ends_the_streak() -> None:
    attempts = _attempts(1, 2) + _attempts(4, 6)  # generation 3's plan missing from the history
    assert restart_verdict(attempts, next_nodes=NODES, progress=0, bound=3) is None


def _kv(last: int, nodes_of=lambda g: NODES, progress: int | None = None) -> MemoryKV:
    kv = MemoryKV()
    for g in range(1, last + 1):
        kv.put_json(
            KEYS.plan_at(g), layout_plan([[(0, 6)]] * len(nodes_of(g)), [2] * len(nodes_of(g)), generation=g).to_json()
        )
        kv.put_json(KEYS.failure(g), _error(g).to_json())
    if progress is not None:
        kv.put_json(KEYS.progress, {"generation": progress, "step": 3, "time": 1.0})
    return kv


def test_read_attempts_reads_the_streak_from_etcd() -> None:
    current = layout_plan([[(0, 6)]] * 2, [2, 2], generation=6)
    attempts, progress = read_attempts(_kv(6, progress=1), KEYS, current, bound=3)
    assert progress == 1 and [a.generation for a in attempts] == [3, 4, 5, 6]  # bound + 1 of them
    assert all(a.nodes == NODES and a.error == _error(a.generation) for a in attempts)
    verdict = restart_verdict(attempts, next_nodes=current.nodes, progress=progress, bound=3)
    assert verdict is not None and "generations 3-6" in verdict.reason


def test_read_attempts_prefers_a_workers_own_error_and_reads_nothing_right_after_a_step() -> None:
    kv = _kv(4)
    kv.put_json(KEYS.errors, _error(3, "ValueError: the model's own").to_json())
    current = layout_plan([[(0, 6)]] * 2, [2, 2], generation=4)
    attempts, _ = read_attempts(kv, KEYS, current, bound=3)
    assert [a.error.error for a in attempts if a.error] == [
        "ConnectionError: injected",
        "ConnectionError: injected",
        "ValueError: the model's own",
        "ConnectionError: injected",
    ]
    # progress in generation 2: two generations since cannot be a loop of 3 restarts; not even read
    kv.put_json(KEYS.progress, {"generation": 2, "step": 1, "time": 1.0})
    assert read_attempts(kv, KEYS, current, bound=3) == ([], 2)


def test_read_attempts_stops_at_a_membership_change() -> None:
    kv = _kv(6, nodes_of=lambda g: ("n0", "n1", "n2") if g == 3 else NODES)
    current = layout_plan([[(0, 6)]] * 2, [2, 2], generation=6)
    attempts, _ = read_attempts(kv, KEYS, current, bound=3)
    assert [a.generation for a in attempts] == [3, 4, 5, 6] and len(attempts[0].nodes) == 3
    assert restart_verdict(attempts, next_nodes=current.nodes, progress=0, bound=3) is None


def test_the_injected_failure_is_a_communication_failure_at_its_rank_and_step_only() -> None:
    from oobleck_elastic.engine.resilience.errors import is_communication_error
    from oobleck_elastic.engine.resilience.faults import FaultInjector

    faults = FaultInjector.from_env({"OOBLECK_COMM_FAIL_AT": "1@0"})
    faults.check(rank=0, step=0)
    faults.check(rank=1, step=1)
    with pytest.raises(ConnectionError, match="injected communication failure: rank 1 at step 0") as caught:
        faults.check(rank=1, step=0)
    assert is_communication_error(caught.value)  # the worker lives on and checks in at the roll call
    with pytest.raises(ValueError, match="OOBLECK_COMM_FAIL_AT"):
        FaultInjector.from_env({"OOBLECK_COMM_FAIL_AT": "1"})
