"""The leader's side of straggler mitigation: what `decide` needs to see, and leaving a node out.

The workers name stragglers and report each pipeline's measured seconds per microbatch under
`stragglers` (`engine.resilience.straggler`). While that report is about the current generation,
`LeaderStragglers.view_fields` hands `decide` the speeds, the slow nodes and the planner's plan
without them (made once per report: planning is milliseconds, but the leader ticks often), and
`decide` picks a remedy (`planning.plan.rebalance`). A re-split is published like any plan; a node
left out (`leave_out`) is remembered by this leader and counted as not ready from then on, so no
later plan takes it back (a new leader forgets: its workers would name the node again).
The story: docs/planning.md.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from ..etcd.protocols import KVReader
from ..logs import JobLog
from ..planning import Plan, PlanningError
from ..records.job import Event, EventKind
from ..records.keys import Keys
from ..records.read import read_stragglers
from .membership import put_event

log = JobLog(logging.getLogger(__name__))


class LeaderStragglers:
    def __init__(self, planner: Callable[[list[str], int, Optional[Plan]], Plan], *, enabled: bool) -> None:
        self.planner, self.enabled = planner, enabled
        self.left_out: set[str] = set()
        """Stragglers left out of the plan for good."""
        self._without: Optional[tuple[tuple[int, int], Optional[Plan]]] = None  # (report, plan without them)

    def view_fields(self, reader: KVReader, keys: Keys, plan: Optional[Plan]) -> dict[str, Any]:
        """`speeds`, `slow` and `without` of the leader's view (`rendezvous.decide`): empty unless the workers
        of `plan`'s generation named a straggler."""
        if not self.enabled or plan is None:
            return {}
        rec = read_stragglers(reader, keys)
        if rec is None or rec.generation != plan.generation or not rec.nodes:
            return {}
        if self._without is None or self._without[0] != (rec.generation, rec.step):
            nodes = [n for n in plan.nodes if n not in rec.nodes]
            try:
                without = self.planner(nodes, plan.generation + 1, plan) if nodes else None
            except PlanningError:
                without = None
            self._without = ((rec.generation, rec.step), without)
        return {"speeds": rec.pipeline_s, "slow": tuple(sorted(rec.nodes)), "without": self._without[1]}

    def leave_out(
        self, client: Any, keys: Keys, nodes: tuple[str, ...], *, generation: int, why: str, leader: str
    ) -> None:
        """Keep `nodes` out of this and later plans (`generation`: the one about to be published)."""
        self.left_out |= set(nodes)
        detail = f"left out of the plan: a straggler, and the step is faster without it ({why}); it stays out"
        for node in nodes:
            log.at(node=leader).warning("node %s %s", node, detail)
            put_event(
                client,
                keys,
                Event(time=time.time(), kind=EventKind.STRAGGLER, node=node, generation=generation, detail=detail),
            )
