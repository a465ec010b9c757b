"""The job's own records under its etcd keys (`records.keys`): its progress, its end, a request
to stop it, and its event log.

Each record writes exactly the fields in the key table of `records.keys` and validates a value
read back (`parse` raises ValueError naming what is wrong). The nodes' and the control plane's
records are in `records.control`. The story: docs/design.md.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

from .control import SCHEMA_VERSION, StrEnum

log = logging.getLogger(__name__)


class EventKind(StrEnum):
    """`Event.kind`."""

    JOIN = "join"
    LEAVE = "leave"
    LOST = "lost"
    DRAIN = "drain"
    PLAN = "plan"
    LEADER = "leader"
    WAITING = "waiting"
    CLOSED = "closed"
    RENEW = "renew"
    """A node renewed its lease after etcd let it expire (`rendezvous.membership`)."""
    HANG = "hang"
    """A node's agent found one of its workers hung in a step and stopped it (`rendezvous.hang`)."""
    SKIP = "skip"
    """The step guard did not apply a step: replayed, or its batch skipped (`engine.resilience.guard`)."""
    REPAIR = "repair"
    """A corrupt copy of a layer was replaced from its holders' majority (`engine.resilience.fingerprint`)."""
    STRAGGLER = "straggler"
    """A node was named persistently slower than the others, or no longer is (`engine.resilience.straggler`)."""


@dataclass(frozen=True)
class ClosedRecord:
    """The value of `closed`: the job ended (finished, or `failed` with `reason`)."""

    time: float
    """Unix time it was closed."""
    reason: str
    """Why (e.g. `finished 20 steps`, or the error that stopped it)."""
    failed: bool = False
    """The job stopped because of an error: workers and agents exit non-zero."""
    stopped: bool = False
    """The job was asked to stop before `training.steps` (`StopRecord`): the same command resumes it."""
    known_error: bool = False
    """`failed` by a known error before the first step (a setting, data file, plan or checkpoint to
    change): every restart would repeat it, so each agent exits 2."""

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def parse(cls, data: Any) -> "ClosedRecord":
        """Validate a `closed` value; raises ValueError naming what is wrong."""
        try:
            if data.get("schema_version") != SCHEMA_VERSION:
                raise ValueError(f"schema_version {data.get('schema_version')!r} is not {SCHEMA_VERSION}")
            flags = (data.get("failed", False), data.get("stopped", False), data.get("known_error", False))
            if not isinstance(data.get("reason"), str) or not all(isinstance(f, bool) for f in flags):
                raise ValueError("reason must be a string, failed, stopped and known_error booleans")
            return cls(
                time=float(data["time"]), reason=data["reason"], failed=flags[0], stopped=flags[1], known_error=flags[2]
            )
        except (AttributeError, KeyError, TypeError) as err:
            raise ValueError(f"not a closed record ({type(err).__name__}: {err})") from None


@dataclass(frozen=True)
class StopRecord:
    """The value of `stop`: someone asked the job to stop at its next step boundary."""

    time: float
    """Unix time of the request."""
    reason: str
    """Who asked and why (e.g. `Ctrl-C to the local launcher`)."""

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def parse(cls, data: Any) -> "StopRecord":
        """Validate a `stop` value; raises ValueError naming what is wrong."""
        if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError("not a stop record")
        if not isinstance(data.get("reason"), str) or not isinstance(data.get("time"), (int, float)):
            raise ValueError("reason must be a string and time a number")
        return cls(time=float(data["time"]), reason=data["reason"])


@dataclass(frozen=True)
class ProgressRecord:
    """The value of `progress`: the job's last completed step, reported by the rank-0 worker."""

    generation: int
    """Generation the step ran in."""
    step: int
    """Steps completed."""
    time: float
    """Unix time of the report."""
    node: str = ""
    """Node of the reporting worker."""

    @classmethod
    def parse(cls, data: Any) -> "ProgressRecord":
        """Validate a `progress` value (extra fields are allowed); raises ValueError."""
        try:
            gen, step = data["generation"], data["step"]
            if not (isinstance(gen, int) and isinstance(step, int)) or gen < 0 or step < 0:
                raise ValueError(f"generation and step must be integers >= 0 (got {gen!r}, {step!r})")
            return cls(generation=gen, step=step, time=float(data["time"]), node=str(data.get("node", "")))
        except (KeyError, TypeError) as err:
            raise ValueError(f"not a progress record ({type(err).__name__}: {err})") from None


@dataclass(frozen=True)
class Event:
    time: float
    """Unix time."""
    kind: str
    """An `EventKind`."""
    node: str
    """Node the event is about (or that wrote it)."""
    generation: Optional[int] = None
    """Plan generation, when it is about a plan."""
    detail: str = ""
    """Human-readable detail."""

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def parse(cls, data: Any, *, key: str = "") -> Optional["Event"]:
        try:
            if data.get("schema_version") != SCHEMA_VERSION:
                raise ValueError(f"schema_version {data.get('schema_version')!r} is not {SCHEMA_VERSION}")
            gen = data.get("generation")
            return cls(
                time=float(data["time"]),
                kind=EventKind(data["kind"]),
                node=str(data["node"]),
                generation=None if gen is None else int(gen),
                detail=str(data.get("detail", "")),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            log.warning("ignoring malformed event %s: %s", key, err)
            return None

    def line(self) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.time)) + f".{int(self.time % 1 * 1000):03d}"
        gen = f" generation {self.generation}" if self.generation is not None else ""
        return f"{stamp} {self.kind:<8} {self.node}{gen}{': ' + self.detail if self.detail else ''}"
