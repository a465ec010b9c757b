"""The etcd key layout (records/keys.py) and the records stored there (records/control.py):
the keys and JSON forms other agents, workers, tools and tests read stay what they were, and a
malformed value is refused (then logged and ignored by the readers). No etcd: MemoryKV."""

from __future__ import annotations

import json

import pytest

from oobleck_elastic.etcd.memory import MemoryKV
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.records.control import (
    Admission,
    AnsweredRecord,
    Checkin,
    CheckinKind,
    FenceRecord,
    LeaderRecord,
    Ping,
    ProfileClaim,
    ReadyRecord,
)
from oobleck_elastic.records.read import (
    is_fenced,
    read_admitted,
    read_fences,
    read_leader,
    read_ready,
    readiness_withdrawn,
)

KEYS = Keys("/oobleck", "r")


def test_leaf_keys_are_the_layout_of_the_table() -> None:
    assert KEYS.fence("node4") == "/oobleck/r/fenced/node4"
    assert KEYS.admitted("node4") == KEYS.admissions + "node4" == "/oobleck/r/admitted/node4"
    assert KEYS.ready_worker("node1", 2) == KEYS.ready("node1") + "2" == "/oobleck/r/ready/node1/2"
    assert KEYS.checkin(3, "node1", 0) == KEYS.rollcall(3) + "node1/0" == "/oobleck/r/rollcall/g3/node1/0"
    assert KEYS.pong("node2") == KEYS.pongs + "node2" == "/oobleck/r/pong/node2"
    assert KEYS.probe("node0", 1, 42) == "/oobleck/r/probe/node0/1/42"
    assert KEYS.plan_at(3) == "/oobleck/r/plans/00000003"
    assert KEYS.liveness_answered == "/oobleck/r/liveness_answered"
    assert KEYS.leader_watched() == [
        "/oobleck/r/plan",
        "/oobleck/r/stop",
        "/oobleck/r/nodes/",
        "/oobleck/r/fenced/",
        "/oobleck/r/admitted/",
        "/oobleck/r/ready/",
        "/oobleck/r/stragglers",
        "/oobleck/r/profile",
        "/oobleck/r/profiles/",
    ]


def test_keys_parse_back_what_they_build() -> None:
    assert KEYS.node_of(KEYS.fence("node4")) == "node4"
    assert KEYS.checkin_of(KEYS.checkin(3, "node1", 2)) == ("node1", 2)
    with pytest.raises(ValueError):
        KEYS.checkin_of(KEYS.rollcall(3) + "node1/x")


@pytest.mark.parametrize(
    "record, wire",
    [
        (FenceRecord(time=1.5, generation=2), {"time": 1.5, "generation": 2}),
        (Admission(time=1.5), {"time": 1.5}),
        (ReadyRecord(time=1.5, pid=7), {"time": 1.5, "pid": 7}),
        (ReadyRecord(time=1.5, withdrawn=True, why="hung"), {"time": 1.5, "withdrawn": True, "why": "hung"}),
        (Checkin(time=1.5, kind=CheckinKind.STALL), {"time": 1.5, "kind": "stall"}),
        (LeaderRecord(node_id="node0", since=1.5), {"node_id": "node0", "since": 1.5}),
        (
            ProfileClaim(node="node0", local_rank=1, pid=7, time=1.5),
            {"schema_version": 1, "node": "node0", "local_rank": 1, "pid": 7, "time": 1.5},
        ),
        (
            AnsweredRecord(generation=3, addresses={"node1": "h:80"}),
            {"schema_version": 1, "generation": 3, "addresses": {"node1": "h:80"}},
        ),
    ],
)
def test_records_write_the_fields_of_the_table_and_read_them_back(record, wire) -> None:
    assert record.to_json() == wire
    assert type(record).parse(json.loads(json.dumps(wire))) == record


@pytest.mark.parametrize(
    "cls, bad",
    [
        (FenceRecord, {"generation": 1}),
        (FenceRecord, {"time": "x"}),
        (FenceRecord, []),
        (Admission, "x"),
        (ReadyRecord, {"time": 1.0, "pid": "7"}),
        (ReadyRecord, None),
        (LeaderRecord, {"since": 1.0}),
        (LeaderRecord, "garbage"),
        (ProfileClaim, {"time": 1.0, "node": 3}),
        (AnsweredRecord, {"schema_version": 1, "generation": 3, "addresses": {"node1": 80}}),
        (AnsweredRecord, {"generation": 3, "addresses": {}}),
    ],
)
def test_malformed_values_are_refused(cls, bad) -> None:
    with pytest.raises(ValueError):
        cls.parse(bad)


def test_a_checkin_is_evidence_whatever_its_value() -> None:
    assert Checkin.parse({"kind": "reboot"}).kind is CheckinKind.FAILURE
    assert Checkin.parse([]).kind is CheckinKind.FAILURE


def test_the_leader_value_is_the_bytes_agents_always_wrote() -> None:
    rec = LeaderRecord(node_id="node0", since=1.5)
    assert rec.encode() == json.dumps({"node_id": "node0", "since": 1.5}).encode()
    ping = Ping(nonce="123")
    assert ping.encode() == b"123" and ping.answered_by(b"123") and not ping.answered_by(b"124")
    assert not ping.answered_by(None)


def test_readers_ignore_malformed_values() -> None:
    kv = MemoryKV(
        {
            KEYS.leader: {"since": 1.0},
            KEYS.fence("node1"): {"time": 2.0, "generation": 1},
            KEYS.fence("node2"): "garbage",
            KEYS.admitted("node3"): {"time": 1.0},
            KEYS.ready_worker("node1", 0): {"time": 1.0, "pid": 3},
            KEYS.ready_worker("node1", 1): ["nonsense"],
        }
    )
    kv.put(KEYS.fence("node5"), "{")  # not JSON: ignored, so not fenced
    assert read_leader(kv, KEYS) is None
    assert dict(read_fences(kv, KEYS)) == {"node1": FenceRecord(2.0, 1), "node2": None}
    assert is_fenced(kv, KEYS, "node2") and not is_fenced(kv, KEYS, "node5") and not is_fenced(kv, KEYS, "node3")
    assert read_admitted(kv, KEYS) == {"node3"}
    assert read_ready(kv, KEYS, "node1") == [ReadyRecord(time=1.0, pid=3)]
    kv.put_json(KEYS.ready_worker("node1", 1), ReadyRecord.withdraw("hung").to_json())
    assert readiness_withdrawn(read_ready(kv, KEYS, "node1"))
