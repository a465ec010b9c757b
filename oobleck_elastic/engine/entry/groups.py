"""Process groups of one generation (`GenerationGroups`), and who holds which layer (`Holders`).

Every layer is held by one stage of every pipeline; pipelines of different templates cut the
layers differently, so each layer has its own holder set. Layers with the same holder set share
one process group (and one bucket in engine/step/grad_sync.py); tied parameters (GPT-2's wte =
lm_head) get a group over the union of their holders. Invariant: every rank creates every group
of the generation, in the same order, at entry, and connects its own with all their members in
that order before the first step (`connect_groups`: NCCL's rules, docs/nccl.md). docs/design.md.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _ProcessGroupWrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from ...models import LayerModel
from ...planning import Plan
from ..resilience import nccl_rules
from ..step.collectives import checked_timeout


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
        """Every rank creates every group, in the same order, with an explicit timeout (new_group
        does not inherit init_process_group's). Collective groups connect under `connect_timeout`
        (a peer that died meanwhile is given up on soon), then run under `timeout`. Pipeline groups
        connect under `timeout` itself: gloo's receives wait under the timeout their group connected
        with, and `_set_pg_timeout` does not change it (torch 2.13), so a short connect timeout would
        turn any slow stage into a failure. With tensor parallelism every group is made per lane,
        and each stage's lanes get `tp_group` and its one-dimensional `mesh`."""
        tp = plan.tensor_parallel
        self.plan, self.rank = plan, rank
        self.lane = rank - plan.stage_of(rank)[1].rank
        by_lane = [Holders.of(plan, layer_model, lane) for lane in range(tp)]
        self.holders = by_lane[self.lane]
        self.pipeline_group: Optional[dist.ProcessGroup] = None
        self.tp_group: Optional[dist.ProcessGroup] = None
        self.mesh: Optional[DeviceMesh] = None
        self.ordered: list[dist.ProcessGroup] = []
        """This rank's groups in the generation's creation order (`connect_groups` follows it)."""
        connect = checked_timeout(min(timeout, connect_timeout or timeout), timeout)

        def make(ranks: list[int]) -> dist.ProcessGroup:
            g = dist.new_group(ranks, timeout=connect)
            if rank in ranks:
                self.ordered.append(g)
                if connect != timeout:
                    set_group_timeout(timeout, g)
            return g

        for p in plan.pipelines:  # every rank creates every group, in the same order
            for lane in range(tp):
                ranks = [s.rank + lane for s in p.stages]
                # point-to-point: connected under the step's timeout (see __init__'s docstring)
                g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    self.pipeline_group = g
                    if g is not None:
                        self.ordered.append(g)
            if tp > 1:
                for s in p.stages:
                    ranks = [s.rank + lane for lane in range(tp)]
                    g = make(ranks)
                    if rank in ranks:
                        self.tp_group = g
                        self.mesh = lanes_mesh(g, device_type, plan.generation)
        self.sets: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for holders in by_lane:
            for members in holders.group_sets():
                g = make(list(members))
                if rank in members:
                    self.sets[members] = g

    def mine(self) -> list[dist.ProcessGroup]:
        """Every group of the generation this rank is in: its pipeline's, its stage's lanes', its
        holder sets'."""
        return [g for g in (self.pipeline_group, self.tp_group, *self.sets.values()) if g is not None]


def connect_groups(groups: Iterable[Optional[dist.ProcessGroup]], device: torch.device) -> None:
    """Connect each of `groups` (None: the default group) with all its members, in the order
    given, by a one-element all-reduce on `device`: NCCL creates a communicator at its first call,
    with every member taking part (torch's `batch_isend_irecv` docstring: as a group's first call
    "all ranks of the group must participate"), so no device group is first used by a subset of
    its members, from autograd's thread or inside a step. Every member calls this with its groups
    in the generation's creation order, so the calls cannot wait on each other in a circle.
    docs/nccl.md."""
    for group in groups:
        with nccl_rules.connecting():
            dist.all_reduce(torch.zeros(1, device=device), group=group)


_MESHES = itertools.count()


def lanes_mesh(group: dist.ProcessGroup, device_type: str, generation: int) -> DeviceMesh:
    """The one-dimensional mesh of a stage's lanes over `group`, named uniquely in this process
    (`lanes_g<generation>_<n>`). DTensor caches the layout of each operator's result keyed by its
    inputs' meshes, and two meshes are equal when their ranks are, whatever their groups; so
    without the name a later generation's mesh over the same ranks would get cached results laid
    on an earlier generation's mesh, whose group name is gone after the teardown ("Could not
    resolve the process group registered under the name 8") or, group names restarting at each
    generation, now names another group."""
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=(f"lanes_g{generation}_{next(_MESHES)}",))


def set_timeout(timeout: timedelta, groups: Iterable[Optional[dist.ProcessGroup]]) -> None:
    """A running generation's new communication timeout: the default group and every one of
    `groups` (None: the default group) post their next calls under it. gloo's point-to-point
    waits keep their connect timeout: they are given the timeout at their wait (`Progress`)."""
    seen: set[int] = set()
    for g in [None, *groups]:
        if id(g) not in seen:
            seen.add(id(g))
            set_group_timeout(timeout, g)


def set_group_timeout(timeout: timedelta, group: Optional[dist.ProcessGroup] = None) -> None:
    """`group`'s (None: the default group's) calls from now on run under `timeout`, on every device's
    backend; also where torch's collective checker wraps one (TORCH_DISTRIBUTED_DEBUG=DETAIL wraps
    gloo's and NCCL's, and `_set_pg_timeout` skips a wrapper with a warning)."""
    g = group if group is not None else dist.group.WORLD
    assert g is not None
    backends = [g._get_backend(device) for device in g._device_types]
    wrapped = [b for b in backends if isinstance(b, _ProcessGroupWrapper)]
    for backend in wrapped:
        backend.set_timeout(timeout)
    if len(wrapped) < len(backends):
        _set_pg_timeout(timeout, group)
