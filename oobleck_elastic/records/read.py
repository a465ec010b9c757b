"""Reading the records of a job's etcd keys tolerantly (docs/design.md, invariant 5).

Every `read_*` helper returns the record a key holds, parsed by its class in `records.control`, or None
when the key is absent or its value malformed: a malformed value is logged once per key and
revision (`warn_once`) and otherwise ignored, so a stray or half-written value never stops an
agent or ends a job. Signal keys whose presence is what counts (`fenced/<node>`,
`admitted/<node>`) are read by presence.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

from ..etcd.client import warn_once
from ..etcd.protocols import KVReader
from .control import AnsweredRecord, FenceRecord, LeaderRecord, ProfileClaim, ReadyRecord, Roster, StragglerRecord
from .job import ClosedRecord, ProgressRecord, StopRecord
from .keys import Keys

T = TypeVar("T")


def _read_record(reader: KVReader, key: str, parse: Callable[[Any], T]) -> Optional[T]:
    """`parse` of the JSON value of `key`; None when it is absent, or malformed (then logged once
    per revision and ignored)."""
    data, revision = reader.get_json(key)
    if data is None:
        return None
    try:
        return parse(data)
    except ValueError as err:
        warn_once(key, revision, f"ignoring malformed value of {key}: {err}")
        return None


def _read_prefix(reader: KVReader, prefix: str, parse: Callable[[Any], T]) -> Iterator[tuple[str, T]]:
    """(key, record) of every key under `prefix` whose value parses (the others are logged once)."""
    for key, data in reader.get_prefix_json(prefix):
        try:
            yield key, parse(data)
        except ValueError as err:
            warn_once(key, None, f"ignoring malformed value of {key}: {err}")


def read_roster(reader: KVReader, keys: Keys) -> Optional[Roster]:
    """The current roster, or None (no plan yet, or a malformed value)."""
    return _read_record(reader, keys.roster, Roster.parse)


def read_answered(reader: KVReader, keys: Keys) -> Optional[AnsweredRecord]:
    """The liveness addresses the last leader reached, or None."""
    return _read_record(reader, keys.liveness_answered, AnsweredRecord.parse)


def read_progress(reader: KVReader, keys: Keys) -> Optional[ProgressRecord]:
    """The job's progress, or None (none yet, or a malformed value)."""
    return _read_record(reader, keys.progress, ProgressRecord.parse)


def read_stragglers(reader: KVReader, keys: Keys) -> Optional[StragglerRecord]:
    """The last stragglers report, or None (none yet, or a malformed value)."""
    return _read_record(reader, keys.stragglers, StragglerRecord.parse)


def read_closed(reader: KVReader, keys: Keys) -> Optional[ClosedRecord]:
    """The job's `closed` record, or None while the job is open (a malformed value is ignored: a
    stray value must never end a job)."""
    return _read_record(reader, keys.closed, ClosedRecord.parse)


def read_stop(reader: KVReader, keys: Keys) -> Optional[StopRecord]:
    """The request to stop the job at its next step boundary, or None (none, or a malformed value)."""
    return _read_record(reader, keys.stop, StopRecord.parse)


def read_profile_claim(reader: KVReader, keys: Keys, device: str) -> Optional[ProfileClaim]:
    """Who measures the profile of `device`, or None (nobody, or a malformed claim)."""
    return _read_record(reader, keys.profile_claim(device), ProfileClaim.parse)


def read_leader(reader: KVReader, keys: Keys) -> Optional[LeaderRecord]:
    """Who leads, or None (nobody, or a value no agent wrote)."""
    return _read_record(reader, keys.leader, LeaderRecord.parse)


def read_fences(reader: KVReader, keys: Keys) -> Iterator[tuple[str, Optional[FenceRecord]]]:
    """(node, its fence record) of every node declared lost; the record is None when the value is
    malformed (the node is fenced all the same: the key's presence is what counts)."""
    for key, data in reader.get_prefix_json(keys.fenced):
        try:
            yield keys.node_of(key), FenceRecord.parse(data)
        except ValueError as err:
            warn_once(key, None, f"malformed value of {key}: {err}")
            yield keys.node_of(key), None


def is_fenced(reader: KVReader, keys: Keys, node: str) -> bool:
    """Whether the leader declared `node` lost: its key holds JSON (whatever the fields say; a
    value that is not JSON is ignored, as the leader ignores it)."""
    return reader.get_json(keys.fence(node))[0] is not None


def read_admitted(reader: KVReader, keys: Keys) -> set[str]:
    """The nodes the leader admitted (the keys' presence is what counts)."""
    return {keys.node_of(key) for key, _ in reader.get_prefix_json(keys.admissions)}


def read_ready(reader: KVReader, keys: Keys, node: str) -> list[ReadyRecord]:
    """The readiness of `node`'s workers that reported (malformed values are logged and ignored)."""
    return [rec for _, rec in _read_prefix(reader, keys.ready(node), ReadyRecord.parse)]


def readiness_withdrawn(records: Iterable[ReadyRecord]) -> bool:
    """Whether any of a node's readiness records was withdrawn by its agent (`rendezvous.hang`)."""
    return any(rec.withdrawn for rec in records)
