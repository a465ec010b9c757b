"""Process groups of one generation and the exact cross-replica gradient sync.

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
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from ...models import LayerModel
from ...models.tensor_parallel import is_sharded, local, wrap_like
from ...planning import Plan
from ..resilience.progress import STEP_PROGRESS


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


def _params_of(module: nn.Module, exclude: set[int]) -> list[torch.Tensor]:
    return [p for p in module.parameters() if id(p) not in exclude and p.requires_grad]


class GradSync:
    """Buckets this rank's gradients by holder set and all-reduces them (SUM)."""

    def __init__(self, groups: GenerationGroups, layer_model: LayerModel, owned: Iterable[int]) -> None:
        self.groups = groups
        self.owned = sorted(owned)
        holders = groups.holders
        tied_ids: set[int] = set()
        self.tied: list[tuple[list[torch.Tensor], tuple[int, ...]]] = []
        for members, ranks in holders.tied:
            params = {}
            for li, name in members:
                layer = layer_model.layers[li]
                if li in self.owned and layer is not None:
                    p = layer.get_parameter(name)
                    params[id(p)] = p
            tied_ids |= set(params)
            if params:
                self.tied.append((list(params.values()), ranks))
        buckets: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for li in self.owned:
            layer = layer_model.layers[li]
            assert layer is not None, f"layer {li} is not built on rank {groups.rank}"
            buckets.setdefault(holders.layer[li], []).extend(_params_of(layer, tied_ids))
        order = {s: i for i, s in enumerate(holders.group_sets())}
        self.buckets = sorted(buckets.items(), key=lambda kv: order.get(kv[0], -1))
        self.tied_ids = tied_ids

    def all_reduce(self) -> None:
        work = []
        for ranks, params in self.buckets + [(r, ps) for ps, r in self.tied]:
            if len(ranks) < 2:
                continue
            grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            work.append((params, flat, dist.all_reduce(flat, group=self.groups.sets[ranks], async_op=True)))
        for params, flat, handle in work:
            with STEP_PROGRESS.waiting(handle):  # engine/resilience/progress.py
                handle.wait()
            offset = 0
            for p in params:
                shard = local(p)
                n = shard.numel()
                p.grad = wrap_like(p, flat[offset : offset + n].view_as(shard).clone())
                offset += n

    def norm_squared(self) -> torch.Tensor:
        """Sum of squared gradients of the parameters this rank is the primary holder of, so that
        an all-reduce over the world counts every parameter of the model exactly once: a sharded
        parameter's shard on every lane, a replicated one on lane 0 only."""
        me, lane = self.groups.rank, self.groups.lane

        def counted(p: torch.Tensor) -> list[torch.Tensor]:  # [its local gradient] or []
            return [local(p.grad)] if p.grad is not None and (lane == 0 or is_sharded(p)) else []

        grads = [g for ranks, params in self.buckets if ranks[0] == me for p in params for g in counted(p)]
        grads += [g for params, ranks in self.tied if ranks[0] == me for p in params for g in counted(p)]
        if not grads:
            return torch.zeros((), dtype=torch.float64)
        total = torch.stack(torch._foreach_norm(grads, dtype=torch.float64)).pow(2).sum()
        return total
