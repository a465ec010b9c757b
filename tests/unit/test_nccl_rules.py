"""NCCL's rules checked on gloo (engine/resilience/nccl_rules.py): a device group's first call must
be the entry's connect, by all its members; a device group's error state after the waits makes every
worker refuse the step (engine/entry/devices.py `group_errors`, engine/step/commit.py); the CUDA
allocator's default; on CUDA, posted work not completed counts as waiting for the hang watch
(engine/resilience/progress.py). A world of one gloo rank in this process; fake groups and works."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._C._distributed_c10d import ErrorType

from oobleck_elastic.engine.entry.devices import ALLOC_CONF_DEFAULT, ALLOC_CONF_ENV, default_alloc_conf, group_errors
from oobleck_elastic.engine.entry.groups import connect_groups
from oobleck_elastic.engine.resilience import nccl_rules
from oobleck_elastic.engine.resilience.errors import GroupErrored, is_communication_error
from oobleck_elastic.engine.resilience.faults import FaultInjector
from oobleck_elastic.engine.resilience.nccl_rules import CHECKER, FirstUse, NcclRuleBroken, broken_rule
from oobleck_elastic.engine.resilience.progress import Progress
from oobleck_elastic.engine.step.commit import CommitVote, combine, refuse_errored


def use(**over) -> FirstUse:
    fields = dict(group="3", ranks=(0, 1, 2), op="all_reduce", point_to_point=False, thread="MainThread")
    return FirstUse(**{**fields, "connecting": True, **over})


def test_a_collective_in_the_connect_keeps_the_rules() -> None:
    assert broken_rule(use()) is None


def test_a_point_to_point_first_call_is_made_by_some_members() -> None:
    assert broken_rule(use(op="batch_isend_irecv", point_to_point=True, connecting=False)) == (
        "group 3 (ranks [0, 1, 2]) was first used by batch_isend_irecv on thread MainThread: point-to-point, "
        "so by some of its ranks (NCCL needs every member at its first call)"
    )


def test_a_first_call_inside_the_step_or_a_hook_breaks_the_rules() -> None:
    for thread in ("oobleck-step", "Dummy-3"):
        assert broken_rule(use(thread=thread, connecting=False)) == (
            f"group 3 (ranks [0, 1, 2]) was first used by all_reduce on thread {thread}, not in the entry's "
            "connect (NCCL would create its communicator there, late and blocking)"
        )


def test_a_two_member_group_first_used_point_to_point_in_a_step_breaks_them_too() -> None:
    assert "not in the entry's connect" in str(broken_rule(use(ranks=(0, 1), point_to_point=True, connecting=False)))


@pytest.fixture
def world(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo world entered as generation 7, with the checker on (restored after)."""
    assert nccl_rules.install({nccl_rules.RULES_ENV: "1"})
    CHECKER.begin_generation(7)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    CHECKER.bind_world()
    try:
        yield
    finally:
        CHECKER.begin_generation(0)
        dist.destroy_process_group()


def test_the_checker_raises_at_a_device_groups_first_call_outside_the_connect(world: None) -> None:
    group = dist.new_group([0])
    with pytest.raises(NcclRuleBroken) as err:
        dist.all_reduce(torch.ones(1), group=group)
    assert str(err.value) == (
        f"NCCL rules (OOBLECK_NCCL_RULES=1), generation 7: group {group.group_name} (ranks [0]) was first "
        "used by all_reduce on thread MainThread, not in the entry's connect (NCCL would create its "
        "communicator there, late and blocking)"
    )
    dist.all_reduce(torch.ones(1), group=group)  # the first call is the one checked


def test_groups_connected_at_entry_are_then_free_and_host_groups_are_exempt(world: None) -> None:
    data, host = dist.new_group([0]), nccl_rules.host_group(dist.new_group([0]))
    connect_groups([None, data], torch.device("cpu"))
    dist.all_reduce(torch.ones(1), group=data)
    dist.broadcast(torch.ones(1), src=0)  # the default group: connected too
    dist.all_reduce(torch.ones(1), group=host)
    assert [(u.op, u.ranks, u.connecting) for u in CHECKER.first.values()] == [
        ("all_reduce", (0,), True),
        ("all_reduce", (0,), True),
    ]
    assert "2 device group(s) of generation 7 first used by all their members" in CHECKER.summary()


def test_dtensors_functional_collectives_are_checked(world: None) -> None:
    group = dist.new_group([0])
    with pytest.raises(NcclRuleBroken, match="first used by all_reduce"):
        funcol.all_reduce(torch.ones(1), "sum", group)


def test_a_world_the_entry_did_not_make_is_not_checked(tmp_path: Path) -> None:
    nccl_rules.install({nccl_rules.RULES_ENV: "1"})
    CHECKER.begin_generation(3)  # no bind_world: a world of the caller's own
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "own"), 1), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(1), group=dist.new_group([0]))
        assert CHECKER.first == {}
    finally:
        dist.destroy_process_group()


class FakeWork:
    """A work whose wait() returns at once, its backend's error appearing afterwards (NCCL's watchdog)."""

    def __init__(self, backend: "FakeBackend") -> None:
        self.backend = backend

    def wait(self) -> bool:
        self.backend.state = ErrorType.TIMEOUT
        return True


class FakeBackend:
    def __init__(self) -> None:
        self.state = ErrorType.SUCCESS

    def get_error(self) -> ErrorType:
        return self.state


class CheckedGloo:
    """gloo under torch's collective checker (TORCH_DISTRIBUTED_DEBUG=DETAIL): the wrapper forwards."""

    def get_error(self) -> ErrorType:
        raise RuntimeError("Backend gloo does not support getError")


class FakeGroup:
    def __init__(self, name: str, backend: object) -> None:
        self.group_name, self.backend = name, backend

    def _get_backend(self, device: torch.device) -> object:
        return self.backend


def vote(**fields) -> CommitVote:
    values = dict(generation=3, peak_rss_bytes=0, peak_device_bytes=None, max_loss=2.5, rejections=0, stop=0)
    return CommitVote(**{**values, "entry_began": 0.0, "entry_ended": 0.0, "compute_s": (0.0, 0.0), **fields})


def test_an_error_after_wait_returned_makes_every_worker_refuse_the_step() -> None:
    cuda = torch.device("cuda", 0)
    nccl, gloo = FakeBackend(), object()  # gloo: no error state
    groups = [FakeGroup("4", nccl), FakeGroup("5", gloo), FakeGroup("6", CheckedGloo())]
    assert group_errors(groups, cuda) == []  # type: ignore[arg-type]
    FakeWork(nccl).wait()
    mine = group_errors(groups, cuda)  # type: ignore[arg-type]
    assert mine == ["group 4 (cuda): TIMEOUT"]
    votes = [vote(errored_groups=len(mine)), vote()]
    agreed = combine(votes)
    assert agreed.errored_groups == 1
    assert CommitVote.unpack(votes[0].pack(), world_size=2).errored_groups == 1  # it travels in the vote
    with pytest.raises(GroupErrored) as err:
        refuse_errored(agreed, step=5, mine=mine)
    assert str(err.value) == (
        "step 5 refused by every worker: a device group reported an error after its waits "
        "(group 4 (cuda): TIMEOUT); the step is replayed in the next generation"
    )
    assert is_communication_error(err.value)  # every worker goes to the next generation
    with pytest.raises(GroupErrored, match="on another worker"):
        refuse_errored(agreed, step=5)  # the worker whose groups were fine refuses it too
    refuse_errored(combine([vote(), vote()]), step=5)  # no error: it commits


def test_an_injected_group_error_comes_the_first_runs_of_its_step() -> None:
    faults = FaultInjector.from_env({"OOBLECK_GROUP_ERROR_AT": "1@3x2"})
    assert faults.group_error(rank=0, step=3) is None
    assert [faults.group_error(rank=1, step=3) for _ in range(3)] == [
        "injected: TIMEOUT (OOBLECK_GROUP_ERROR_AT)",
        "injected: TIMEOUT (OOBLECK_GROUP_ERROR_AT)",
        None,
    ]
    with pytest.raises(ValueError, match="RANK@STEP"):
        FaultInjector.from_env({"OOBLECK_GROUP_ERROR_AT": "x"})


def test_the_allocator_gets_expandable_segments_unless_the_user_set_it() -> None:
    env: dict[str, str] = {}
    assert default_alloc_conf(env) and env == {ALLOC_CONF_ENV: ALLOC_CONF_DEFAULT}
    mine = {ALLOC_CONF_ENV: "max_split_size_mb:128"}
    assert not default_alloc_conf(mine) and mine == {ALLOC_CONF_ENV: "max_split_size_mb:128"}


class PendingWork:
    """An NCCL-like handle: `wait()` returns at once; the work completes when the peer moves."""

    def __init__(self) -> None:
        self.done = False

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return self.done


def test_on_cuda_a_step_with_posted_work_not_completed_is_waiting_for_a_peer() -> None:
    """A healthy peer of a hung worker: its marked wait returned at once (NCCL), then its step thread
    blocks in an unmarked call (a kernel launch, an implicit sync) while the work is pending. It
    waits for a peer until the work completes; then, blocked still, it stands still."""
    import threading

    progress = Progress()
    progress.track_posted = True  # the trainer sets it on CUDA
    work, release = PendingWork(), threading.Event()

    def step() -> None:
        progress.new_step()
        with progress.waiting(work):
            work.wait()  # returns at once
        release.wait()  # blocked outside any marked wait

    thread = threading.Thread(target=step)
    thread.start()
    try:
        while progress.posted == ():
            pass
        assert progress.waits is None and progress.waits_for_a_peer()
        work.done = True  # the hung peer moved: the work completed
        assert not progress.waits_for_a_peer()
    finally:
        release.set()
        thread.join()
    progress.new_step()
    assert progress.posted == ()


def test_on_the_cpu_a_returned_wait_is_not_waiting() -> None:
    progress, work = Progress(), PendingWork()  # gloo's waits block: nothing is kept
    with progress.waiting(work):
        assert progress.waits_for_a_peer()
    assert progress.posted == () and not progress.waits_for_a_peer()


def test_the_group_is_found_by_position_or_keyword_and_none_means_the_default_group() -> None:
    def collective(tensor, op=None, group=None, async_op=False):  # torch's order for all_reduce
        raise AssertionError("not called")

    position = nccl_rules._group_position(inspect.signature(collective))
    assert position == 2
    marker = object()
    assert nccl_rules._group_of("all_reduce", position, ("t", "sum", marker), {}, False) is marker
    assert nccl_rules._group_of("all_reduce", position, ("t",), {"group": marker}, False) is marker
    assert nccl_rules._group_of("all_reduce", position, ("t",), {"async_op": True}, False) is None
