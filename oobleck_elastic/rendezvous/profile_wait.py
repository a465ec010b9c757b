"""The leader's wait for the profile that the first plan needs.

The first nodes are admitted unplanned so a worker can measure the profile; the leader plans
generation 1 once it is in etcd, and closes the job after `timeout_s` without one. The story:
docs/planning.md.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from ..etcd import EtcdClient
from ..etcd.mirror import Mirror
from ..etcd.protocols import KVReader
from ..logs import JobLog
from ..records.control import Admission
from ..records.job import Event, EventKind
from ..records.keys import Keys
from .membership import put_event

log = JobLog(logging.getLogger(__name__))


class ProfileWait:
    """Whether the planner has its profile, and the admission, progress lines and timeout of the
    wait for one (docs/planning.md)."""

    def __init__(
        self,
        client: EtcdClient,
        keys: Keys,
        view: KVReader,
        *,
        node_id: str,
        profile_ready: Callable[[], bool],
        timeout_s: float,
        log_s: float,
    ) -> None:
        self.client, self.keys, self.view, self.node_id = client, keys, view, node_id
        self.profile_ready, self.timeout_s, self.log_s = profile_ready, timeout_s, log_s
        self._wait: tuple[float, float] | None = None  # (since, next progress line), monotonic
        self._known = False  # profile_ready() said yes (a profile never goes away once pinned)
        self._seen: Optional[tuple[tuple[str, int], ...]] = None  # the profile keys when last asked

    @property
    def waiting(self) -> bool:
        """Nodes are admitted and the first plan waits for a profile."""
        return self._wait is not None

    def reset(self) -> None:
        """No wait any more (a plan exists, or the job is closed)."""
        self._wait = None

    def has_profile(self) -> bool:
        """Whether the planner has its profile: asked (`profile_ready`, which reads etcd) only when
        the mirrored profile keys changed since it last said no, so a leader waiting for a worker
        to measure the profile sends etcd nothing; without a mirror, asked every time."""
        if self._known:
            return True
        if isinstance(self.view, Mirror):
            seen = tuple((kv.key, kv.mod_revision) for kv in self.view.range(self.keys.profiles))
            pinned = self.view.get(self.keys.profile)
            seen += ((pinned.key, pinned.mod_revision),) if pinned is not None else ()
            if seen == self._seen:
                return False
            self._seen = seen
        self._known = self.profile_ready()
        return self._known

    def wait(self, nodes: list[str]) -> Optional[str]:
        """One tick of the wait for the profile the first plan on `nodes` needs: admit them the
        first time (their workers start, one per device kind measures the profile), then a line
        every `log_s`; past `timeout_s`, why the job must fail (else None)."""
        now = time.monotonic()
        if self._wait is None:
            for node in nodes:
                if self.view.get_json(self.keys.admitted(node))[0] is None:
                    self.client.put_json(self.keys.admitted(node), Admission(time=time.time()).to_json())
            self._wait = (now, now + self.log_s)
            detail = (
                f"admitted {len(nodes)} node(s) ({', '.join(nodes)}); their workers start, and one per device "
                "kind measures the profile the first plan needs"
            )
            log.at(node=self.node_id).info("%s", detail)
            put_event(
                self.client,
                self.keys,
                Event(time=time.time(), kind=EventKind.WAITING, node=self.node_id, generation=1, detail=detail),
            )
            return None
        since, next_line = self._wait
        if now - since >= self.timeout_s:
            return (
                f"no worker published a profile of its device within {self.timeout_s:.0f}s "
                f"(fault_tolerance.rendezvous_timeout_s) after {len(nodes)} node(s) were admitted, so "
                "no plan can be made: check the workers' logs for an error while profiling (each worker "
                "calls WorkerContext.share_profile before it reports ready), or set planning.profile_path "
                "to a profile file"
            )
        if now >= next_line:
            self._wait = (since, now + self.log_s)
            log.at(node=self.node_id).info(
                "still waiting for a worker-measured profile (%.0fs of %.0fs; %d node(s) admitted)",
                now - since,
                self.timeout_s,
                len(nodes),
            )
        return None
