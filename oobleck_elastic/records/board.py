"""The job's TensorBoard run: which directory every worker that writes TensorBoard writes into.

Invariant: one run directory per job, agreed once in etcd (put-if-absent on `tensorboard`), so
every rank 0 of the job writes into it. The story: docs/operations.md.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

from ..etcd.client import warn_once
from ..etcd.protocols import KVReader, KVStore
from .control import SCHEMA_VERSION
from .keys import Keys

__all__ = ["BoardRecord", "claim_board", "read_board"]


@dataclass(frozen=True)
class BoardRecord:
    """The value of `tensorboard`: the job's TensorBoard run, relative to `logging.tensorboard_dir`."""

    run: str
    """`<run id>/<start time>`: a relative path without `..` (`engine.telemetry.board`)."""
    node: str
    """The node of the worker that chose it."""
    time: float
    """Unix time it was chosen."""

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def parse(cls, data: Any) -> "BoardRecord":
        if not isinstance(data, dict):
            raise ValueError(f"expected an object, got {type(data).__name__}")
        run, node, at = data.get("run"), data.get("node"), data.get("time")
        if not isinstance(run, str) or not run or run.startswith("/") or ".." in run.split("/"):
            raise ValueError(f"run {run!r} is not a relative directory name")
        if not isinstance(node, str) or not isinstance(at, (int, float)) or isinstance(at, bool):
            raise ValueError(f"node {node!r} / time {at!r} are not a node id and a Unix time")
        return cls(run=run, node=node, time=float(at))


def read_board(reader: KVReader, keys: Keys) -> Optional[BoardRecord]:
    """The job's TensorBoard run, or None (not chosen yet, or a malformed value: logged once)."""
    data, revision = reader.get_json(keys.tensorboard)
    if data is None:
        return None
    try:
        return BoardRecord.parse(data)
    except ValueError as err:
        warn_once(keys.tensorboard, revision, f"ignoring malformed value of {keys.tensorboard}: {err}")
        return None


def claim_board(store: KVStore, keys: Keys, proposed: str, *, node: str) -> str:
    """The job's TensorBoard run: `proposed` when this call created the key, else the run already
    chosen. A malformed value is replaced by `proposed` (deleted at its revision, then created)."""
    value = json.dumps(BoardRecord(run=proposed, node=node, time=time.time()).to_json(), sort_keys=True)
    for _ in range(2):
        if store.put_if_absent(keys.tensorboard, value):
            return proposed
        found = read_board(store, keys)
        if found is not None:
            return found.run
        _, revision = store.get_json(keys.tensorboard)
        if revision is not None:
            store.delete(keys.tensorboard, revision=revision)
    return proposed
