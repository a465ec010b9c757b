"""The nodes' and the control plane's values under a job's etcd keys (`records.keys`), one record
class per kind of value: nodes, rosters, the leader, fences, readiness, roll calls, stragglers.

Each record writes exactly the fields in the key table of `records.keys` and validates a value
read back (`parse` raises ValueError naming what is wrong). The job's own records (progress,
closed, a stop request, events) are in `records.job`. The story: docs/design.md.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Optional, TypeVar


T = TypeVar("T")

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10

    class StrEnum(str, Enum):
        """A str-valued Enum (enum.StrEnum from Python 3.11 on)."""

        def __str__(self) -> str:
            return str(self.value)


class NodeState(StrEnum):
    """`NodeRecord.state`."""

    UP = "up"
    DRAINING = "draining"
    RETURNED = "returned"
    """Declared lost while its process lived, and back under a new lease: it never trains again,
    but hands over the layers it holds when the next plan needs them (docs/recovery.md)."""


class CheckinKind(StrEnum):
    """Why a worker checked in at a roll call (`rollcall/g<g>/<node>/<local rank>`)."""

    FAILURE = "failure"
    """It saw a communication call of the generation fail."""
    STALL = "stall"
    """It waited too long for its peers while joining the generation."""


@dataclass(frozen=True)
class NodeRecord:
    node_id: str
    """Unique id of the node in this run (`node<index>`)."""
    index: int
    """Small integer the CLI uses (`kill-agent --index N`), assigned in order of arrival."""
    host: str
    """Host name or address of the node."""
    devices: int
    """Workers (devices) on the node (--nproc-per-node)."""
    agent_pid: int
    """PID of the torchrun agent."""
    state: NodeState
    """`up` or `draining`."""
    since: float
    """Unix time the node registered."""
    lease_id: int
    """etcd lease the record is bound to."""
    liveness: str = ""
    """"host:port" of the agent's liveness socket (`rendezvous.liveness`); empty: none."""
    device_class: str = ""
    """The node's device class (`planning.classes`, `--rdzv-conf device_class=NAME`); empty: none
    declared (every node alike)."""

    def to_json(self) -> dict[str, Any]:
        out = {"schema_version": SCHEMA_VERSION, **asdict(self)}
        if not self.device_class:
            del out["device_class"]  # the records of fleets without classes stay as they were
        return out

    @classmethod
    def parse(cls, data: Any, *, key: str = "") -> Optional["NodeRecord"]:
        """Validate a record read from etcd; log and return None when malformed."""
        try:
            if data.get("schema_version") != SCHEMA_VERSION:
                raise ValueError(f"schema_version {data.get('schema_version')!r}")
            rec = cls(
                node_id=str(data["node_id"]),
                index=int(data["index"]),
                host=str(data["host"]),
                devices=int(data["devices"]),
                agent_pid=int(data["agent_pid"]),
                state=NodeState(str(data["state"])),
                since=float(data["since"]),
                lease_id=int(data["lease_id"]),
                liveness=data.get("liveness", ""),
                device_class=data.get("device_class", ""),
            )
            if not isinstance(rec.liveness, str):
                raise ValueError(f"liveness {rec.liveness!r} is not a string")
            if not isinstance(rec.device_class, str):
                raise ValueError(f"device_class {rec.device_class!r} is not a string")
            if key and not key.endswith("/" + rec.node_id):
                raise ValueError(f"node_id {rec.node_id!r} does not match the key")
            return rec
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            log.warning("ignoring malformed node record %s: %s", key, err)
            return None


@dataclass(frozen=True)
class Roster:
    """The value of `roster`: the current plan's generation and nodes. Agents read this instead
    of the plan (150 KB at 1,000 nodes), so a re-plan sends each agent a few KB."""

    generation: int
    nodes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "generation": self.generation, "nodes": list(self.nodes)}

    @classmethod
    def parse(cls, data: Any) -> "Roster":
        if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError("not a roster record")
        generation, nodes = data.get("generation"), data.get("nodes")
        if (
            not isinstance(generation, int)
            or generation < 1
            or not isinstance(nodes, list)
            or not all(isinstance(n, str) for n in nodes)
        ):
            raise ValueError(f"generation {generation!r} / nodes {str(nodes)[:40]} are not a roster")
        return cls(generation=generation, nodes=tuple(nodes))


@dataclass(frozen=True)
class AnsweredRecord:
    """The value of `liveness_answered`: the liveness addresses of plan nodes that accepted the
    leader's connection. A refused connection proves a death only at an address that answered
    before (`rendezvous.liveness`); a new leader has reached nobody yet and takes these as
    answered, so nodes that died with the old leader are found dead by their sockets too."""

    generation: int
    """The generation whose leader wrote it."""
    addresses: dict[str, str]
    """Node -> the "host:port" that answered."""

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "generation": self.generation, "addresses": dict(self.addresses)}

    @classmethod
    def parse(cls, data: Any) -> "AnsweredRecord":
        if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError("not a liveness_answered record")
        generation, addresses = data.get("generation"), data.get("addresses")
        if (
            not isinstance(generation, int)
            or not isinstance(addresses, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in addresses.items())
        ):
            raise ValueError(f"generation {generation!r} / addresses {str(addresses)[:40]} are not one")
        return cls(generation=generation, addresses=dict(addresses))


def _number(data: Any, name: str) -> float:
    """`data[name]` as a float; ValueError when `data` is not a dict or the field is not a number."""
    if not isinstance(data, dict):
        raise ValueError(f"not a JSON object: {str(data)[:40]}")
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} {value!r} is not a number")
    return float(value)


@dataclass(frozen=True)
class LeaderRecord:
    """The value of `leader`: the elected agent's node, bound to that node's lease."""

    node_id: str
    since: float
    """Unix time it was elected."""

    def to_json(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "since": self.since}

    def encode(self) -> bytes:
        """The value as written (the leader compares it, byte for byte, in the plan's transaction)."""
        return json.dumps(self.to_json(), sort_keys=True).encode()

    @classmethod
    def parse(cls, data: Any) -> "LeaderRecord":
        if not isinstance(data, dict) or not isinstance(data.get("node_id"), str):
            raise ValueError(f"not a leader record (no node_id): {str(data)[:60]}")
        return cls(node_id=data["node_id"], since=_number(data, "since") if "since" in data else 0.0)


@dataclass(frozen=True)
class FenceRecord:
    """The value of `fenced/<node>`: the leader declared the node lost (the key's presence is what
    fences it; the leader drops an entry once the node's record is gone and the entry is old)."""

    time: float
    generation: int = 0
    """The generation the node was lost in."""

    def to_json(self) -> dict[str, Any]:
        return {"time": self.time, "generation": self.generation}

    @classmethod
    def parse(cls, data: Any) -> "FenceRecord":
        at = _number(data, "time")
        generation = data.get("generation", 0)
        if isinstance(generation, bool) or not isinstance(generation, int):
            raise ValueError(f"generation {generation!r} is not an integer")
        return cls(time=at, generation=generation)


@dataclass(frozen=True)
class Goodbye:
    """The value of `goodbye/<node>`: the node's agent left cleanly (shut down, drained). Written
    before its liveness socket closes and under no lease, so the leader still finds it after the
    node's record is gone; the key's presence is what counts."""

    time: float
    detail: str = ""
    """Why it left, for its `leave` event."""

    def to_json(self) -> dict[str, Any]:
        return {"time": self.time, "detail": self.detail}

    @classmethod
    def parse(cls, data: Any) -> "Goodbye":
        return cls(time=_number(data, "time"), detail=str(data.get("detail", "")))


@dataclass(frozen=True)
class Admission:
    """The value of `admitted/<node>`: the leader admitted the node, so its agent starts its
    workers (the key's presence is what counts)."""

    time: float

    def to_json(self) -> dict[str, Any]:
        return {"time": self.time}

    @classmethod
    def parse(cls, data: Any) -> "Admission":
        return cls(time=_number(data, "time"))


@dataclass(frozen=True)
class ReadyRecord:
    """The value of `ready/<node>/<local rank>`: the worker loaded torch, its data and config and
    can join a generation; or, `withdrawn`, its agent restarts it (`rendezvous.hang`) and the node counts as
    not ready until the restarted worker reports ready again."""

    time: float
    pid: Optional[int] = None
    """The worker's process id (absent in a withdrawn readiness)."""
    withdrawn: bool = False
    why: str = ""
    """Why it was withdrawn."""

    @classmethod
    def withdraw(cls, why: str) -> "ReadyRecord":
        """What an agent writes while it restarts that worker."""
        return cls(time=time.time(), withdrawn=True, why=why)

    def to_json(self) -> dict[str, Any]:
        if self.withdrawn:
            return {"time": self.time, "withdrawn": True, "why": self.why}
        return {"time": self.time, **({"pid": self.pid} if self.pid is not None else {})}

    @classmethod
    def parse(cls, data: Any) -> "ReadyRecord":
        at = _number(data, "time")
        pid = data.get("pid")
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int)):
            raise ValueError(f"pid {pid!r} is not an integer")
        return cls(time=at, pid=pid, withdrawn=bool(data.get("withdrawn")), why=str(data.get("why", "")))


@dataclass(frozen=True)
class Checkin:
    """The value of `rollcall/g<g>/<node>/<local rank>`: a worker of generation g saw a
    communication call fail, or stalled joining g. The key is the evidence, so `parse` never
    refuses one: a value it cannot read counts as a `failure` (a roll call too many costs a few
    pings; a failure missed costs the job its timeout)."""

    time: float
    kind: CheckinKind = CheckinKind.FAILURE

    def to_json(self) -> dict[str, Any]:
        return {"time": self.time, "kind": str(self.kind)}

    @classmethod
    def parse(cls, data: Any) -> "Checkin":
        kind = data.get("kind") if isinstance(data, dict) else None
        at = data.get("time") if isinstance(data, dict) else None
        return cls(
            time=float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else 0.0,
            kind=CheckinKind(kind) if kind in tuple(CheckinKind) else CheckinKind.FAILURE,
        )


@dataclass(frozen=True)
class Ping:
    """The value of `ping/<node>`: a nonce, one per round of pings; the node's agent answers by
    copying it, byte for byte, to `pong/<node>` (`rendezvous.handler`)."""

    nonce: str

    @classmethod
    def new(cls) -> "Ping":
        return cls(nonce=f"{time.time_ns()}")

    def encode(self) -> bytes:
        return self.nonce.encode()

    def answered_by(self, pong: Optional[bytes]) -> bool:
        """Whether a `pong/<node>` value answers this ping."""
        return pong is not None and pong == self.encode()


@dataclass(frozen=True)
class ProfileClaim:
    """The value of `profile_claims/<device>`: this worker measures the profile of that device
    kind (bound to its node's lease, so the claim vanishes with the node)."""

    node: str
    local_rank: int
    pid: int
    time: float

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def parse(cls, data: Any) -> "ProfileClaim":
        at = _number(data, "time")
        node, local_rank, pid = data.get("node"), data.get("local_rank"), data.get("pid")
        if not isinstance(node, str) or not isinstance(local_rank, int) or not isinstance(pid, int):
            raise ValueError(f"node {node!r} / local_rank {local_rank!r} / pid {pid!r} are not a claim")
        return cls(node=node, local_rank=local_rank, pid=pid, time=at)


# ---------------------------------------------------------------------- readers
@dataclass(frozen=True)
class StragglerRecord:
    """The value of `stragglers`: what the worker holding rank 0 found after a step (`engine.resilience.straggler`)."""

    generation: int
    """Generation the speeds were measured in (the leader acts only on the current one's)."""
    step: int
    """The step after which they were found (0-based)."""
    time: float
    """Unix time of the report."""
    nodes: dict[str, float]
    """Nodes named stragglers -> their slowdown (empty: none any more)."""
    pipeline_s: tuple[float, ...]
    """Each pipeline's measured bottleneck, seconds per microbatch, in plan order."""

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "generation": self.generation,
            "step": self.step,
            "time": self.time,
            "nodes": dict(self.nodes),
            "pipeline_s": list(self.pipeline_s),
        }

    @classmethod
    def parse(cls, data: Any) -> "StragglerRecord":
        """Validate a `stragglers` value; raises ValueError naming what is wrong."""
        try:
            if data.get("schema_version") != SCHEMA_VERSION:
                raise ValueError(f"schema_version {data.get('schema_version')!r} is not {SCHEMA_VERSION}")
            speeds = tuple(float(v) for v in data["pipeline_s"])
            if any(v < 0 for v in speeds) or not isinstance(data["generation"], int):
                raise ValueError("pipeline_s must be >= 0 and generation an integer")
            return cls(
                generation=data["generation"],
                step=int(data["step"]),
                time=float(data["time"]),
                nodes={str(k): float(v) for k, v in data["nodes"].items()},
                pipeline_s=speeds,
            )
        except (AttributeError, KeyError, TypeError) as err:
            raise ValueError(f"not a stragglers record ({type(err).__name__}: {err})") from None
