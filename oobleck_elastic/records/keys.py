"""The etcd key layout of one job: every key is built by a `Keys` method, and per-node and
per-worker keys are parsed back by `node_of` and `checkin_of`.

Everything lives under `<key_prefix>/<run_id>/`; no key is built anywhere else. The table of keys
(value, writer, lease): docs/operations.md.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    """Key names of one run. Properties name a prefix (ending in "/") or a single key; methods
    with arguments name the key of one node, worker or generation."""

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
    def liveness_answered(self) -> str:
        """The liveness addresses the leader reached (`AnsweredRecord`): a new leader's proof."""
        return self.root + "liveness_answered"

    @property
    def plans(self) -> str:
        """Prefix of the plan history."""
        return self.root + "plans/"

    def plan_at(self, generation: int) -> str:
        """The plan of one generation, kept as history (joiners read the previous generation's)."""
        return f"{self.plans}{generation:08d}"

    @property
    def profile(self) -> str:
        """The profile every leader plans from (pinned once, never replaced)."""
        return self.root + "profile"

    @property
    def profiles(self) -> str:
        """Prefix of the worker-measured profiles, one per device kind."""
        return self.root + "profiles/"

    def device_profile(self, device: str) -> str:
        """The worker-measured profile of one device kind (`planning.profile.cache.device_label`)."""
        return self.profiles + sanitise(device)

    def profile_claim(self, device: str) -> str:
        """Taken (put-if-absent) by the one worker that measures the profile of a device kind."""
        return f"{self.root}profile_claims/{sanitise(device)}"

    @property
    def events(self) -> str:
        return self.root + "events/"

    def event(self, node_id: str) -> str:
        return f"{self.events}{time.time_ns():020d}-{node_id}"

    @property
    def admissions(self) -> str:
        """Prefix of the admitted nodes."""
        return self.root + "admitted/"

    def admitted(self, node_id: str) -> str:
        """The leader admitted a node that arrived while the job runs (its agent may start workers)."""
        return self.admissions + node_id

    @property
    def readiness(self) -> str:
        """Prefix of every worker's readiness."""
        return self.root + "ready/"

    def ready(self, node_id: str) -> str:
        """Prefix under which a node's workers say they are ready to join a generation."""
        return f"{self.readiness}{node_id}/"

    def ready_worker(self, node_id: str, local_rank: int) -> str:
        """One worker's readiness (`ReadyRecord`)."""
        return f"{self.ready(node_id)}{local_rank}"

    @property
    def rollcalls(self) -> str:
        """Prefix of the roll-call check-ins of every generation."""
        return self.root + "rollcall/"

    def rollcall(self, generation: int) -> str:
        """Workers of `generation` that saw a communication failure (or stalled joining it) check in here."""
        return f"{self.rollcalls}g{generation}/"

    def checkin(self, generation: int, node_id: str, local_rank: int) -> str:
        """One worker's roll-call check-in (`Checkin`); `checkin_of` parses it back."""
        return f"{self.rollcall(generation)}{node_id}/{local_rank}"

    def ping(self, node_id: str) -> str:
        return f"{self.root}ping/{node_id}"

    @property
    def pongs(self) -> str:
        """Prefix of the agents' answers to pings."""
        return self.root + "pong/"

    def pong(self, node_id: str) -> str:
        return self.pongs + node_id

    @property
    def fenced(self) -> str:
        """Prefix of the nodes declared lost."""
        return self.root + "fenced/"

    def fence(self, node_id: str) -> str:
        """A node declared lost (`FenceRecord`): excluded from plans, its workers stop."""
        return self.fenced + node_id

    @property
    def goodbyes(self) -> str:
        """Prefix of the nodes whose agents left cleanly."""
        return self.root + "goodbye/"

    def goodbye(self, node_id: str) -> str:
        """A node's agent left cleanly (`Goodbye`): written before it closes its liveness socket,
        so a refused connection to it is a leave, not a death."""
        return self.goodbyes + node_id

    @property
    def progress(self) -> str:
        return self.root + "progress"

    @property
    def stragglers(self) -> str:
        """The nodes the workers named stragglers, and the pipelines' measured speeds
        (`engine.resilience.straggler`)."""
        return self.root + "stragglers"

    @property
    def tensorboard(self) -> str:
        """The job's TensorBoard run directory, chosen once by its first writer (`records.board`)."""
        return self.root + "tensorboard"

    @property
    def closed(self) -> str:
        return self.root + "closed"

    @property
    def stop(self) -> str:
        """A request to stop the job at the next step boundary, after a checkpoint (`StopRecord`):
        `oobleck stop`, the local launcher's Ctrl-C, or the leader when every node was drained."""
        return self.root + "stop"

    @property
    def errors(self) -> str:
        return self.root + "errors"

    @property
    def failures(self) -> str:
        """Prefix of the errors that broke generations before a step committed in them."""
        return self.root + "failures/"

    def failure(self, generation: int) -> str:
        """The error of the first worker that saw `generation` break before it committed a step
        there (`ErrorRecord`, put if absent): what the leader names when it stops a restart loop
        (`rendezvous.restart_loop`). Read by the leader alone, so mirrored by nobody."""
        return f"{self.failures}g{generation}"

    def store(self, generation: int) -> str:
        return f"{self.root}store/g{generation}/"

    @property
    def torchrun_state(self) -> str:
        """torch's dynamic-rendezvous state of a `mode=restart` job (`rendezvous.restart`)."""
        return self.root + "torchrun/state"

    @property
    def torchrun_store(self) -> str:
        """Prefix of the c10d store the agents of a `mode=restart` job share."""
        return self.root + "torchrun/store/"

    @property
    def probes(self) -> str:
        """Prefix of examples/probe.py's reports."""
        return self.root + "probe/"

    def probe(self, node_id: str, local_rank: int, pid: int) -> str:
        """What one process of examples/probe.py reports (its restart count)."""
        return f"{self.probes}{node_id}/{local_rank}/{pid}"

    # ------------------------------------------------------------------ parsing
    def node_of(self, key: str) -> str:
        """The node a per-node key is about (`nodes/<node>`, `fenced/<node>`, `admitted/<node>`,
        `ping/<node>`, `pong/<node>`, `goodbye/<node>`, `profiles/<device>`: the last path element)."""
        return key.rsplit("/", 1)[-1]

    def checkin_of(self, key: str) -> tuple[str, int]:
        """(node, local rank) of a roll-call key `rollcall/g<g>/<node>/<local rank>`; ValueError
        when the key is not one."""
        parts = key.rsplit("/", 2)
        if len(parts) != 3 or not parts[2].isdigit():
            raise ValueError(f"{key} is not a roll-call check-in key (…/<node>/<local rank>)")
        return parts[1], int(parts[2])

    def agent_watched(self, node_id: str) -> list[str]:
        """What every agent reads (its deputy and its wait to be admitted), mirrored by watches
        (`etcd.mirror`): prefixes end with "/", the others are exact keys. What only the leader
        reads is in `leader_watched`; the c10d store, events, progress and the plan history are in
        neither: agents do not read them while the job runs. So a node record that changes wakes
        the leader alone, not every agent."""
        return [
            self.roster,
            self.leader,
            self.closed,
            self.rollcalls,
            self.ping(node_id),
            self.admitted(node_id),
            self.pongs,
        ]

    def leader_watched(self) -> list[str]:
        """What the leader reads besides `agent_watched` (mirrored while it leads); the profile
        keys so that a leader waiting for the first profile learns of it without asking etcd."""
        return [
            self.plan,
            self.stop,
            self.nodes,
            self.fenced,
            self.admissions,
            self.readiness,
            self.stragglers,
            self.profile,
            self.profiles,
        ]


def sanitise(name: str) -> str:
    """A device name as one key segment: lower case, runs of anything but [a-z0-9._] become '-'
    ("cuda NVIDIA H100 80GB HBM3" -> "cuda-nvidia-h100-80gb-hbm3")."""
    return re.sub(r"[^a-z0-9._]+", "-", name.lower()).strip("-") or "unknown"
