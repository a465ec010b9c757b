"""A stage's lanes mesh belongs to its generation (engine/entry/groups.py `lanes_mesh`): DTensor's
cached operator layouts never hand a later generation a tensor on an earlier generation's mesh."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from oobleck_elastic.engine.entry.devices import release_groups
from oobleck_elastic.engine.entry.groups import lanes_mesh


def _enter(generation: int, groups_before: int) -> tuple[dist.ProcessGroup, object]:
    """A one-rank generation that creates `groups_before` other groups, then its stage's lanes group."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for _ in range(groups_before):
        dist.new_group([0])
    group = dist.new_group([0])
    return group, lanes_mesh(group, "cpu", generation)


def test_a_later_generation_computes_on_its_own_mesh_after_the_same_operator_ran_on_an_earlier_one() -> None:
    try:
        _, first = _enter(1, groups_before=5)  # generation 1: the lanes group is named "6"
        doubled = distribute_tensor(torch.ones(4, 4), first, [Shard(0)]) * 2
        assert doubled.device_mesh is first
        release_groups(abort=True)  # a failure: every group aborted, names restart
        group, second = _enter(2, groups_before=0)  # generation 2: the same ranks, a group named "1"
        assert group.group_name != "6"
        again = distribute_tensor(torch.ones(4, 4), second, [Shard(0)]) * 2
        # with meshes equal by ranks alone, the cached layout of `* 2` named generation 1's mesh,
        # whose group no longer resolves ("Could not resolve the process group registered under the name 6")
        assert again.device_mesh is second
        assert again.device_mesh.get_group().group_name == group.group_name
        assert torch.equal(again.full_tensor(), torch.full((4, 4), 2.0))
    finally:
        release_groups(abort=False)
