"""Plans and rosters read from etcd, parsed once per revision.

The leader reads the plan and the roster on every tick and a worker reads the plan before every
step; a plan of 1,000 nodes takes milliseconds to parse and a roster of 1,000 nodes is 1,000
names to check, so `PlanReader` and `RosterReader` keep the parsed value of the last revision
they saw. A value that is not a plan is logged once per key and revision and read as None: it
never crashes a reader. The story: docs/design.md.
"""

from __future__ import annotations

from typing import Optional

from ..etcd.client import parse_json, warn_once
from ..etcd.protocols import KVReader
from ..planning import Plan, PlanningError
from .control import Roster
from .read import read_roster
from .keys import Keys

__all__ = ["PlanReader", "RosterReader", "newest_history_plan", "parse_plan"]


def parse_plan(data: object, *, key: str = "plan", revision: Optional[int] = None) -> Optional[Plan]:
    """The plan in `data`, or None (absent, or malformed: logged once per key and revision)."""
    if data is None:
        return None
    try:
        return Plan.from_json(data)
    except PlanningError as err:
        warn_once(key, revision, f"ignoring malformed plan in etcd key {key}: {err}")
        return None


class PlanReader:
    """The plan in one key, parsed once per revision: a plan of 1,000 nodes takes milliseconds to
    parse, and the leader reads it every tick, a worker before every step."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._cached: Optional[tuple[int, Optional[Plan]]] = None  # (mod revision, plan)

    def read(self, reader: KVReader) -> tuple[Optional[Plan], Optional[int]]:
        """(plan, mod revision) from `reader` (a Mirror or an EtcdClient): (None, None) if the key
        is absent, (None, revision) if it holds something that is not a plan (logged once)."""
        kv = reader.get(self.key)
        if kv is None:
            return None, None
        if self._cached is None or self._cached[0] != kv.mod_revision:
            data = parse_json(kv.value, kv.key, kv.mod_revision)
            self._cached = (kv.mod_revision, parse_plan(data, key=self.key, revision=kv.mod_revision))
        return self._cached[1], kv.mod_revision


class RosterReader:
    """The roster in one key, parsed once per revision: every agent reads it every tick, and a
    roster of 1,000 nodes is 1,000 names to check (1,000 agents x 1,000 names per tick starved a
    2-core machine)."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self._cached: Optional[tuple[int, Optional[Roster]]] = None  # (mod revision, roster)

    def read(self, reader: KVReader) -> Optional[Roster]:
        """The roster from `reader`, or None (absent, or malformed: logged once per revision)."""
        kv = reader.get(self.keys.roster)
        if kv is None:
            return None
        if self._cached is None or self._cached[0] != kv.mod_revision:
            # a write between the two reads caches a newer roster under the older revision: the
            # next read sees the revision differ and parses again
            self._cached = (kv.mod_revision, read_roster(reader, self.keys))
        return self._cached[1]


def newest_history_plan(client: KVReader, keys: Keys) -> Optional[Plan]:
    """The newest valid plan of the history (`plans/<generation>`): what the current plan was when
    the `plan` key holds something that is not a plan, so generations never go back."""
    plans = [p for key, data in client.get_prefix_json(keys.plans) if (p := parse_plan(data, key=key)) is not None]
    return max(plans, key=lambda p: p.generation, default=None)
