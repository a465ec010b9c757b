"""Process groups of one generation, and who holds what (engine/step/grad_sync.py sums gradients over them).

For a plan, every layer is held by exactly one stage of every pipeline; pipelines of different
templates cut the layers differently, so the set of ranks holding layer l ("its holders")
differs from layer to layer. Gradients are SUM-reduced among exactly the holders of each layer
(the loss is already divided by the global token count, so a sum is the global gradient).
Layers with the same holder set share one process group and one flat bucket. Tied parameters
(GPT-2's wte = lm_head) live in the first AND last stage of every pipeline; they are left out of
the per-layer buckets and summed over the union of their holders, each rank contributing its
local copy once (a rank holding both ends shares one Parameter, whose gradient already has both
contributions).

With tensor parallelism (docs/design.md, "Parallelism and the cost model") a stage is run by
`tensor_parallel` lanes, and all of this holds per lane: lane j of a layer is held by lane j of
one stage per pipeline, so holder sets, pipeline groups and tied groups are made for every lane
(disjoint rank sets), and each stage's lanes get a group of their own for the layers' collectives
(`tp_group`, with its one-dimensional `mesh`). Gradients are synchronised on each lane's local
shards.

`torch.distributed.new_group` must be called by every rank, in the same order, for every group;
`GenerationGroups` does that for the pipeline groups, the holder-set groups and the tied groups,
always with an explicit timeout (new_group does not inherit init_process_group's). Collective
groups connect under the short connect timeout (`fault_tolerance.join_timeout_s`: a peer that
died during the reconfiguration is given up on soon) and switch to the step's timeout
(`fault_tolerance.comm_timeout_s`) once up. Pipeline groups connect under the step's timeout
itself: gloo's point-to-point receives wait under the timeout their group connected with, and
`_set_pg_timeout` does not change it (measured on torch 2.13: a receive in a group connected
under 1 s and switched to 10 s still gave up after 1 s), so a group connected under the connect
timeout would turn any stage slower than it (a large model, a first step that warms up or
compiles) into a failure. Every peer was seen alive by the entry's first all-reduce just before,
and a peer that dies later is found by the control plane, which abandons the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from ...models import LayerModel
from ...planning import Plan


@dataclass(frozen=True)
class Holders:
    """Who holds what in a plan (pure data, no process groups)."""

    layer: dict[int, tuple[int, ...]]
    """Layer index -> sorted ranks holding it (one per pipeline)."""
    tied: list[tuple[tuple[tuple[int, str], ...], tuple[int, ...]]]
    """Per tied group: its (layer, param name) members and the sorted ranks holding any member."""

    @classmethod
    def of(cls, plan: Plan, layer_model: LayerModel, lane: int = 0) -> "Holders":
        """Who holds lane `lane` of every layer."""
        layer = {i: tuple(sorted(plan.holders(i, lane))) for i in range(plan.num_layers)}
        tied = []
        for group in layer_model.tied:
            members = tuple(group.members)
            ranks = sorted({r for li, _ in members for r in layer[li]})
            tied.append((members, tuple(ranks)))
        return cls(layer=layer, tied=tied)

    def group_sets(self) -> list[tuple[int, ...]]:
        """Every rank set that needs a group, in one canonical order (by first layer)."""
        seen: list[tuple[int, ...]] = []
        for i in sorted(self.layer):
            if self.layer[i] not in seen:
                seen.append(self.layer[i])
        for _, ranks in self.tied:
            if ranks not in seen:
                seen.append(ranks)
        return [s for s in seen if len(s) > 1]


class GenerationGroups:
    """The process groups one worker uses in one generation."""

    def __init__(
        self,
        plan: Plan,
        layer_model: LayerModel,
        *,
        rank: int,
        timeout: timedelta,
        connect_timeout: Optional[timedelta] = None,
        device_type: str = "cpu",
    ) -> None:
        """Collective groups connect under `connect_timeout` (a peer that died meanwhile is given
        up on soon), then run under `timeout`; pipeline groups run and connect under `timeout`."""
        tp = plan.tensor_parallel
        self.plan, self.rank = plan, rank
        self.lane = rank - plan.stage_of(rank)[1].rank
        by_lane = [Holders.of(plan, layer_model, lane) for lane in range(tp)]
        self.holders = by_lane[self.lane]
        self.pipeline_group: Optional[dist.ProcessGroup] = None
        self.tp_group: Optional[dist.ProcessGroup] = None
        self.mesh: Optional[DeviceMesh] = None
        connect = min(timeout, connect_timeout or timeout)

        def make(ranks: list[int]) -> dist.ProcessGroup:
            g = dist.new_group(ranks, timeout=connect)
            if rank in ranks and connect != timeout:
                _set_pg_timeout(timeout, g)
            return g

        for p in plan.pipelines:  # every rank creates every group, in the same order
            for lane in range(tp):
                ranks = [s.rank + lane for s in p.stages]
                # point-to-point: connected under the step's timeout (module docstring)
                g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    self.pipeline_group = g
            if tp > 1:
                for s in p.stages:
                    ranks = [s.rank + lane for lane in range(tp)]
                    g = make(ranks)
                    if rank in ranks:
                        self.tp_group = g
                        self.mesh = DeviceMesh.from_group(g, device_type)
        self.sets: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for holders in by_lane:
            for members in holders.group_sets():
                g = make(list(members))
                if rank in members:
                    self.sets[members] = g
