"""The etcd key layout of one job and the JSON records stored there.

Everything lives under `<key_prefix>/<run_id>/` (key_prefix defaults to `/oobleck`):

| key                      | value (JSON, `schema_version` 1)                | written by        | lease |
|--------------------------|-------------------------------------------------|-------------------|-------|
| `nodes/<node_id>`        | NodeRecord: index, host, devices, agent pid, state (up/draining), since, liveness address | the node's agent, `kill-agent` | node |
| `next_index`             | next node index (int)                           | agents (CAS)      |       |
| `leader`                 | {node_id, since}                                | the elected agent | node  |
| `plan`                   | Plan of the current generation (planning/plan.py) | the leader (CAS) |      |
| `roster`                 | Roster: the plan's generation and nodes (what agents read of a plan) | the leader (same txn) | |
| `plans/<generation>`     | the same plan, kept per generation              | the leader (same txn) |   |
| `profile`                | ModelProfile every leader computes templates from: planning.profile_path, or the first worker-measured one | the first leader | |
| `profiles/<device>`      | ModelProfile measured by a worker on that device kind (`<device>`: sanitised "cuda NVIDIA H100 ...") | one worker per device kind | |
| `profile_claims/<device>` | {node, local_rank, pid, time}: this worker measures the profile of that device kind | that worker (put-if-absent) | node |
| `events/<ns>-<node_id>`  | Event: time, kind, node, generation, detail     | agents, leader, CLI |     |
| `admitted/<node>`       | a late node is admitted: its agent starts its workers | the leader |    |
| `ready/<node>/<local rank>` | a worker has loaded torch, data and config and can join a generation; `{withdrawn: true}`: its agent restarts it (hang.py) | workers, agent | |
| `rollcall/g<g>/<node>/<local rank>` | {time, kind}: a worker of generation g saw a communication failure, or stalled joining g | workers |    |
| `ping/<node>`, `pong/<node>` | the leader (or the deputy, about the leader) asks a node's agent whether it is alive; it answers | leader, deputy, agent | |
| `fenced/<node>`          | declared lost before its lease expired: excluded from plans; its workers stop | leader | |
| `progress`               | {generation, step, time, ...}                   | worker rank 0     |       |
| `stragglers`             | StragglerRecord: nodes named stragglers, each pipeline's measured seconds per microbatch | worker rank 0 | |
| `closed`                 | {time, reason, failed}: the job finished (or failed), stop planning | workers / handler / leader (no profile in time) | |
| `errors`                 | the last error that ended a worker and how often in a row (engine/errors.py) | workers |       |
| `store/g<generation>/...`| c10d Store keys of that generation's process groups | workers       |       |

Values that fail to parse or validate are logged and ignored (docs/design.md, invariant 5).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Callable, Iterable, Optional, TypeVar

from ..etcd.client import warn_once

T = TypeVar("T")

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

try:
    from enum import StrEnum
except ImportError:  # Python 3.10
    class StrEnum(str, Enum):  # type: ignore[no-redef]
        """A str-valued Enum (enum.StrEnum from Python 3.11 on)."""

        def __str__(self) -> str:
            return str(self.value)


class NodeState(StrEnum):
    """`NodeRecord.state`."""
    UP = "up"
    DRAINING = "draining"


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
    """A node renewed its lease after etcd let it expire (membership.py)."""
    HANG = "hang"
    """A node's agent found one of its workers hung in a step and stopped it (hang.py)."""
    SKIP = "skip"
    """The step guard did not apply a step: replayed, or its batch skipped (engine/guard.py)."""
    REPAIR = "repair"
    """A corrupt copy of a layer was replaced from its holders' majority (engine/fingerprint.py)."""
    STRAGGLER = "straggler"
    """A node was named persistently slower than the others, or no longer is (engine/straggler.py)."""


class CheckinKind(StrEnum):
    """Why a worker checked in at a roll call (`rollcall/g<g>/<node>/<local rank>`)."""
    FAILURE = "failure"
    """It saw a communication call of the generation fail."""
    STALL = "stall"
    """It waited too long for its peers while joining the generation."""



@dataclass(frozen=True)
class Keys:
    """Key names of one run."""

    prefix: str
    run_id: str

    @property
    def root(self) -> str:
        return f"{self.prefix.rstrip('/')}/{self.run_id}/"

    @property
    def nodes(self) -> str:
        return self.root + "nodes/"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    @property
    def next_index(self) -> str:
        return self.root + "next_index"

    @property
    def leader(self) -> str:
        return self.root + "leader"

    @property
    def plan(self) -> str:
        return self.root + "plan"

    @property
    def roster(self) -> str:
        """The current plan's generation and nodes only (`Roster`): what agents read of a plan."""
        return self.root + "roster"

    @property
    def plans(self) -> str:
        """Prefix of the plan history."""
        return self.root + "plans/"

    def plan_at(self, generation: int) -> str:
        """The plan of one generation, kept as history (joiners read the previous generation's)."""
        return f"{self.root}plans/{generation:08d}"

    @property
    def profile(self) -> str:
        """The profile every leader plans from (pinned once, never replaced)."""
        return self.root + "profile"

    @property
    def profiles(self) -> str:
        """Prefix of the worker-measured profiles, one per device kind."""
        return self.root + "profiles/"

    def device_profile(self, device: str) -> str:
        """The worker-measured profile of one device kind (`profiler.device_label`)."""
        return self.profiles + sanitise(device)

    def profile_claim(self, device: str) -> str:
        """Taken (put-if-absent) by the one worker that measures the profile of a device kind."""
        return f"{self.root}profile_claims/{sanitise(device)}"

    @property
    def events(self) -> str:
        return self.root + "events/"

    def event(self, node_id: str) -> str:
        return f"{self.events}{time.time_ns():020d}-{node_id}"

    def admitted(self, node_id: str) -> str:
        """The leader admitted a node that arrived while the job runs (its agent may start workers)."""
        return f"{self.root}admitted/{node_id}"

    def ready(self, node_id: str) -> str:
        """Prefix under which a node's workers say they are ready to join a generation."""
        return f"{self.root}ready/{node_id}/"

    def rollcall(self, generation: int) -> str:
        """Workers of `generation` that saw a communication failure (or stalled joining it) check in here."""
        return f"{self.root}rollcall/g{generation}/"

    def ping(self, node_id: str) -> str:
        return f"{self.root}ping/{node_id}"

    def pong(self, node_id: str) -> str:
        return f"{self.root}pong/{node_id}"

    @property
    def fenced(self) -> str:
        return self.root + "fenced/"

    @property
    def progress(self) -> str:
        return self.root + "progress"

    @property
    def stragglers(self) -> str:
        """The nodes the workers named stragglers, and the pipelines' measured speeds (engine/straggler.py)."""
        return self.root + "stragglers"

    @property
    def closed(self) -> str:
        return self.root + "closed"

    @property
    def errors(self) -> str:
        return self.root + "errors"

    def store(self, generation: int) -> str:
        return f"{self.root}store/g{generation}/"

    # ------------------------------------------------------------------ parsing
    def node_of(self, key: str) -> str:
        """The node a per-node key is about (`nodes/<node>`, `fenced/<node>`, `admitted/<node>`,
        `ping/<node>`, `pong/<node>`, `profiles/<device>`: the last path element)."""
        return key.rsplit("/", 1)[-1]

    def checkin_of(self, key: str) -> tuple[str, str]:
        """(node, local rank) of a roll-call key `rollcall/g<g>/<node>/<local rank>`."""
        node, local_rank = key.rsplit("/", 2)[1:]
        return node, local_rank

    def agent_watched(self, node_id: str) -> list[str]:
        """What every agent reads (its deputy and its wait to be admitted), mirrored by watches
        (etcd/mirror.py): prefixes end with "/", the others are exact keys. What only the leader
        reads is in `leader_watched`; the c10d store, events, progress and the plan history are in
        neither: agents do not read them while the job runs. So a node record that changes wakes
        the leader alone, not every agent."""
        return [self.roster, self.leader, self.closed, self.root + "rollcall/", self.ping(node_id),
                self.admitted(node_id), self.root + "pong/"]

    def leader_watched(self) -> list[str]:
        """What the leader reads besides `agent_watched` (mirrored while it leads)."""
        return [self.plan, self.nodes, self.fenced, self.root + "admitted/", self.root + "ready/", self.stragglers]


def sanitise(name: str) -> str:
    """A device name as one key segment: lower case, runs of anything but [a-z0-9._] become '-'
    ("cuda NVIDIA H100 80GB HBM3" -> "cuda-nvidia-h100-80gb-hbm3")."""
    return re.sub(r"[^a-z0-9._]+", "-", name.lower()).strip("-") or "unknown"


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
    """"host:port" of the agent's liveness socket (liveness.py); empty: none."""

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def parse(cls, data: Any, *, key: str = "") -> Optional["NodeRecord"]:
        """Validate a record read from etcd; log and return None when malformed."""
        try:
            if data.get("schema_version") != SCHEMA_VERSION:
                raise ValueError(f"schema_version {data.get('schema_version')!r}")
            rec = cls(node_id=str(data["node_id"]), index=int(data["index"]), host=str(data["host"]),
                      devices=int(data["devices"]), agent_pid=int(data["agent_pid"]),
                      state=NodeState(str(data["state"])), since=float(data["since"]),
                      lease_id=int(data["lease_id"]), liveness=data.get("liveness", ""))
            if not isinstance(rec.liveness, str):
                raise ValueError(f"liveness {rec.liveness!r} is not a string")
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
        if not isinstance(generation, int) or generation < 1 or not isinstance(nodes, list) or \
                not all(isinstance(n, str) for n in nodes):
            raise ValueError(f"generation {generation!r} / nodes {str(nodes)[:40]} are not a roster")
        return cls(generation=generation, nodes=tuple(nodes))


def read_roster(reader: Any, keys: "Keys") -> Optional[Roster]:
    """The current roster, or None (no plan yet, or a malformed value)."""
    return _read_record(reader, keys.roster, Roster.parse)


@dataclass(frozen=True)
class ClosedRecord:
    """The value of `closed`: the job ended (finished, or `failed` with `reason`)."""

    time: float
    """Unix time it was closed."""
    reason: str
    """Why (e.g. `finished 20 steps`, or the error that stopped it)."""
    failed: bool = False
    """The job stopped because of an error: workers and agents exit non-zero."""

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def parse(cls, data: Any) -> "ClosedRecord":
        """Validate a `closed` value; raises ValueError naming what is wrong."""
        try:
            if data.get("schema_version") != SCHEMA_VERSION:
                raise ValueError(f"schema_version {data.get('schema_version')!r} is not {SCHEMA_VERSION}")
            if not isinstance(data.get("reason"), str) or not isinstance(data.get("failed", False), bool):
                raise ValueError("reason must be a string and failed a boolean")
            return cls(time=float(data["time"]), reason=data["reason"], failed=data.get("failed", False))
        except (AttributeError, KeyError, TypeError) as err:
            raise ValueError(f"not a closed record ({type(err).__name__}: {err})") from None


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
class StragglerRecord:
    """The value of `stragglers`: what the worker holding rank 0 found after a step (engine/straggler.py)."""

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
        return {"schema_version": SCHEMA_VERSION, "generation": self.generation, "step": self.step,
                "time": self.time, "nodes": dict(self.nodes), "pipeline_s": list(self.pipeline_s)}

    @classmethod
    def parse(cls, data: Any) -> "StragglerRecord":
        """Validate a `stragglers` value; raises ValueError naming what is wrong."""
        try:
            if data.get("schema_version") != SCHEMA_VERSION:
                raise ValueError(f"schema_version {data.get('schema_version')!r} is not {SCHEMA_VERSION}")
            nodes = {str(k): float(v) for k, v in data["nodes"].items()}
            speeds = tuple(float(v) for v in data["pipeline_s"])
            if any(v < 0 for v in speeds) or not isinstance(data["generation"], int):
                raise ValueError("pipeline_s must be >= 0 and generation an integer")
            return cls(generation=data["generation"], step=int(data["step"]), time=float(data["time"]), nodes=nodes,
                       pipeline_s=speeds)
        except (AttributeError, KeyError, TypeError) as err:
            raise ValueError(f"not a stragglers record ({type(err).__name__}: {err})") from None


def read_stragglers(client: Any, keys: "Keys") -> Optional[StragglerRecord]:
    """The last stragglers report, or None (none yet, or a malformed value)."""
    return _read_record(client, keys.stragglers, StragglerRecord.parse)


def _read_record(client: Any, key: str, parse: Callable[[Any], T]) -> Optional[T]:
    """`parse` of the JSON value of `key`; None when it is absent, or malformed (then logged once
    per revision and ignored)."""
    data, revision = client.get_json(key)
    if data is None:
        return None
    try:
        return parse(data)
    except ValueError as err:
        warn_once(key, revision, f"ignoring malformed value of {key}: {err}")
        return None


def withdrawn_readiness(why: str) -> dict[str, Any]:
    """The `ready/<node>/<local rank>` value an agent writes while it restarts that worker (hang.py):
    the node counts as not ready until the restarted worker reports ready again."""
    return {"time": time.time(), "withdrawn": True, "why": why}


def readiness_withdrawn(values: Iterable[Any]) -> bool:
    """Whether any of a node's `ready/` values is a `withdrawn_readiness`."""
    return any(isinstance(v, dict) and bool(v.get("withdrawn")) for v in values)


def read_progress(client: Any, keys: "Keys") -> Optional[ProgressRecord]:
    """The job's progress, or None (none yet, or a malformed value)."""
    return _read_record(client, keys.progress, ProgressRecord.parse)


def read_closed(client: Any, keys: "Keys") -> Optional[ClosedRecord]:
    """The job's `closed` record, or None while the job is open (a malformed value is ignored: a
    stray value must never end a job)."""
    return _read_record(client, keys.closed, ClosedRecord.parse)


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
            return cls(time=float(data["time"]), kind=EventKind(data["kind"]), node=str(data["node"]),
                       generation=None if gen is None else int(gen), detail=str(data.get("detail", "")))
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            log.warning("ignoring malformed event %s: %s", key, err)
            return None

    def line(self) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.time)) + f".{int(self.time % 1 * 1000):03d}"
        gen = f" generation {self.generation}" if self.generation is not None else ""
        return f"{stamp} {self.kind:<8} {self.node}{gen}{': ' + self.detail if self.detail else ''}"
