"""Malformed control values never end a job: the `closed` record is typed and validated at the
etcd boundary, a bad value is logged once per revision and ignored by workers, agents, the
launcher and the CLI."""

from __future__ import annotations

import json
import logging

import pytest

from oobleck_elastic import cluster_ops
from oobleck_elastic.etcd import connect
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.records.job import ClosedRecord
from oobleck_elastic.records.read import read_closed
from oobleck_elastic.rendezvous.worker import WorkerContext


@pytest.mark.parametrize(
    "value",
    [
        {"schema_version": 99},
        {"schema_version": 1},
        {"schema_version": 1, "time": 1.0},
        {"schema_version": 1, "time": 1.0, "reason": 3},
        {"schema_version": 1, "time": 1.0, "reason": "x", "failed": "yes"},
        {"schema_version": 1, "time": 1.0, "reason": "x", "stopped": 1},
        [1],
        "closed",
    ],
)
def test_a_malformed_closed_value_is_refused(value) -> None:
    with pytest.raises(ValueError):
        ClosedRecord.parse(value)


def test_closed_round_trip() -> None:
    rec = ClosedRecord(time=1.5, reason="finished 3 steps")
    assert ClosedRecord.parse(json.loads(json.dumps(rec.to_json()))) == rec and not rec.failed
    stopped = ClosedRecord(time=1.5, reason="stopped at step 2 of 3 on request (oobleck stop)", stopped=True)
    assert ClosedRecord.parse(json.loads(json.dumps(stopped.to_json()))) == stopped
    # a record written before `stopped` existed reads as not stopped
    assert not ClosedRecord.parse({"schema_version": 1, "time": 1.0, "reason": "finished 3 steps"}).stopped


def test_bad_closed_values_in_etcd_leave_the_job_open_and_are_logged_once(etcd_settings, run_id, caplog) -> None:
    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    ctx = WorkerContext(client=client, keys=keys, node_id="node0", local_rank=0)
    try:
        for raw in ['{"schema_version": 99}', "not json", '{"schema_version": 1, "reason": "x"}']:
            client.put(keys.closed, raw)
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                for _ in range(5):  # polled again and again: one warning for this revision
                    assert read_closed(client, keys) is None
                    assert ctx.should_leave(None) is None and ctx.failure_of_job() is None
            warnings = [r for r in caplog.records if keys.closed in r.getMessage()]
            assert len(warnings) == 1, [r.getMessage() for r in warnings]
            assert "closed" not in " ".join(cluster_ops.status(client, keys))
        ctx.close_job("injected fault ended a worker 3 times", failed=True)
        closed = read_closed(client, keys)
        assert closed is not None and closed.failed and closed.reason.startswith("injected fault")
        assert ctx.should_leave(None) == "the job is closed"
        assert ctx.failure_of_job() == "injected fault ended a worker 3 times"
        assert "(closed as failed: injected fault" in cluster_ops.status(client, keys)[0]
    finally:
        client.close()


def test_a_worker_refuses_a_plan_older_than_one_it_has_seen(etcd_settings, run_id, caplog) -> None:
    from helpers import layout_plan

    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    ctx = WorkerContext(client=client, keys=keys, node_id="n0", local_rank=0)
    try:
        newer, older = (layout_plan([[(0, 6)]], [8], generation=g) for g in (3, 2))
        client.put_json(keys.plan, newer.to_json())
        assert ctx.plan().generation == 3
        client.put_json(keys.plan, older.to_json())
        with caplog.at_level(logging.WARNING):
            assert ctx.plan().generation == 3 and ctx.plan().generation == 3
        assert len([r for r in caplog.records if "generation 3 was already seen" in r.getMessage()]) == 1
    finally:
        client.close()


def test_bad_progress_next_index_and_events_are_ignored_or_repaired(etcd_settings, run_id) -> None:
    """A malformed `progress` reads as none (the launcher and `oobleck status` go on); a malformed
    `next_index` is replaced by one past every index in use, so a joining node neither crashes nor
    reuses a fenced node's id; an event of another schema version is not accepted."""
    from oobleck_elastic.records.job import Event
    from oobleck_elastic.records.read import read_progress
    from oobleck_elastic.rendezvous.membership import Member, read_events

    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    member = None
    try:
        for raw in ['{"step": "abc", "generation": 1, "time": 1, "node": "node0"}', "[]", "{"]:
            client.put(keys.progress, raw)
            assert read_progress(client, keys) is None
            assert any(line.startswith("step: no progress") for line in cluster_ops.status(client, keys))
        ctx = WorkerContext(client=client, keys=keys, node_id="node0", local_rank=0)
        ctx.report_progress(generation=2, step=7)
        ctx.close()  # progress is written in the background: wait for it
        assert (read_progress(client, keys).step, read_progress(client, keys).generation) == (7, 2)
        client.put_json(keys.fence("node4"), {"time": 1.0, "generation": 1})
        client.put(keys.next_index, "garbage")
        member = Member(client, keys, devices=1, lease_ttl_s=5)
        member.register()
        assert member.node_id == "node5"  # past the fenced node4: never a reused id
        client.put_json(
            keys.event("node0"), {**Event(time=1.0, kind="join", node="node0").to_json(), "schema_version": 99}
        )
        assert [ev for _, ev in read_events(client, keys) if ev.node == "node0"] == []
    finally:
        if member is not None:
            member.close()
        client.close()
