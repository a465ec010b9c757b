"""The record of the error that ended a worker, and how a repeated error is counted.

Each worker that ends with an error records it in etcd (the run's `errors` key) as an
`ErrorRecord`; `next_error_record` (a pure function) counts how many times in a row the same
error (`error_signature`: type and message with numbers masked) ended a worker at the same step.
The agent reads the record to close a job whose error repeats (`fault_tolerance.max_repeated_errors`);
which errors are a peer's failure rather than the worker's own is `engine.resilience.errors`.
The story: docs/recovery.md.
"""

from __future__ import annotations

import re
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Optional


SCHEMA_VERSION = 1


def error_signature(err: BaseException) -> str:
    """Type and first message line, with numbers masked (an OOM message's byte counts differ)."""
    lines = str(err).strip().splitlines()
    first = lines[0][:200] if lines else ""
    return f"{type(err).__name__}: {re.sub(r'[0-9]+', '#', first)}"


@dataclass(frozen=True)
class ErrorRecord:
    """The last error that ended a worker, as stored in etcd (`errors` key of the run)."""

    signature: str
    """`error_signature` of the error."""
    step: int
    """0-based step the worker was running (or about to run) when it failed."""
    count: int
    """Times in a row this signature ended a worker at this step."""
    generation: int
    """Generation the worker was in."""
    node: str
    """Node of the worker."""
    local_rank: int
    """Local rank of the worker."""
    error: str
    """First line of the error, unmasked."""
    traceback: str
    """The end of the formatted traceback."""
    time: float
    """Unix time."""

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def parse(cls, data: Any) -> Optional["ErrorRecord"]:
        """The record in `data`, or None when it is not a valid record of this schema."""
        if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
            return None
        try:
            rec = cls(**{k: data[k] for k in cls.__dataclass_fields__})
        except (KeyError, TypeError):
            return None
        ok = (
            isinstance(rec.signature, str)
            and isinstance(rec.step, int)
            and isinstance(rec.count, int)
            and rec.count >= 1
        )
        return rec if ok else None


def next_error_record(
    previous: Optional[ErrorRecord],
    err: BaseException,
    *,
    step: int,
    generation: int,
    node: str,
    local_rank: int,
    now: Optional[float] = None,
) -> ErrorRecord:
    """The record to store after `err` ended a worker: the count goes up when the previous record
    has the same signature at the same step in an earlier generation (several workers failing in
    one generation count once), and starts again at 1 for any other error or step."""
    sig = error_signature(err)
    same = previous is not None and previous.signature == sig and previous.step == step
    if same and previous is not None and previous.generation >= generation:
        return ErrorRecord(**{**asdict(previous), "time": time.time() if now is None else now})
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return ErrorRecord(
        signature=sig,
        step=step,
        count=previous.count + 1 if same and previous else 1,
        generation=generation,
        node=node,
        local_rank=local_rank,
        error=f"{type(err).__name__}: {first}",
        traceback=tb[-4000:],
        time=time.time() if now is None else now,
    )
