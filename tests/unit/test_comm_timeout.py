"""The auto communication timeout follows the job from its first steps (config/timing.py): the rule on
made-up step times, the hang bound staying under the timeout in force, a running single-process
generation's group moving to the new timeout, and the fingerprint's waits marked with their handles."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from oobleck_elastic.config import FaultToleranceConfig, load_config
from oobleck_elastic.config.timing import (
    FIRST_COMM_TIMEOUT_S,
    comm_timeout,
    due_comm_timeout,
    hang_bound,
    typical_step,
)
from oobleck_elastic.engine.resilience.progress import Progress
from helpers import RandomTokens

ROOT = Path(__file__).resolve().parents[2]


def follow(ft: FaultToleranceConfig, steps: list[float]) -> list[float]:
    """The timeout in force after each of `steps` (wall seconds), as a worker derives it between
    steps: from the lower median of the last 20, when `due_comm_timeout` says so."""
    timeout, basis, seen, out = comm_timeout(ft, 0.0), 0.0, [], []
    for s in steps:
        seen.append(s)
        typical = typical_step(seen[-20:])
        due = due_comm_timeout(ft, basis, typical)
        if due is not None:
            timeout, basis = due, typical
        out.append(timeout)
    return out


def test_the_timeout_is_derived_once_a_step_is_measured_and_again_when_the_step_changes_a_lot() -> None:
    auto = FaultToleranceConfig()
    assert due_comm_timeout(auto, 0.0, 0.0) is None  # nothing measured: the first timeout stands
    assert due_comm_timeout(auto, 0.0, 0.5) == 120.0  # first measured: 300 s -> max(120, 3 x 30)
    assert due_comm_timeout(auto, 0.5, 0.9) is None  # under 2x: it stands
    assert due_comm_timeout(auto, 0.5, 0.26) is None
    assert due_comm_timeout(auto, 0.5, 1.0) == 120.0  # 2x: derived again (same seconds: nothing to apply)
    assert due_comm_timeout(auto, 6.0, 12.0) == 360.0  # 3 x 10 x 12 s
    assert due_comm_timeout(auto, 12.0, 6.0) == 180.0  # and down again
    # generation 1 of a job that never re-plans: a 40 s first step (compilation), then 0.5 s steps
    timeline = follow(auto, [40.0, 0.5, 0.5, 0.5, 0.6, 0.4])
    assert comm_timeout(auto, 0.0) == FIRST_COMM_TIMEOUT_S == 300.0
    assert timeline == [1200.0, 120.0, 120.0, 120.0, 120.0, 120.0]
    # a step that grows tenfold (a loaded machine) takes the timeout along, once the median has moved
    slow = follow(auto, [1.0] * 5 + [10.0] * 10)
    assert slow[:5] == [120.0] * 5 and slow[-1] == 300.0


def test_an_explicit_timeout_is_never_overridden() -> None:
    explicit = FaultToleranceConfig(comm_timeout_s=45.0)
    assert due_comm_timeout(explicit, 0.0, 0.5) is None and due_comm_timeout(explicit, 0.5, 50.0) is None
    assert follow(explicit, [40.0, 0.5, 0.5, 30.0, 30.0, 30.0]) == [45.0] * 6


@pytest.mark.parametrize(
    "steps",
    [
        [40.0, 0.5, 0.5, 0.5],
        [0.1] * 3 + [3.0] * 12 + [0.2] * 25,
        [5.0, 9.0, 14.0, 20.0, 27.0, 35.0, 44.0, 54.0, 65.0, 77.0],  # ever slower
        [1.0, 1.9, 3.7, 7.2, 14.0, 27.0, 53.0, 3.0, 2.0, 1.0],
    ],
)
@pytest.mark.parametrize("floor", [None, 0.0, 5.0])
def test_the_hang_bound_stays_under_the_timeout_in_force(steps: list[float], floor: Any) -> None:
    """The agent's hang bound follows every step; the timeout only when due: it still stays longer,
    so a hung peer is cut off by its agent before its peers' collectives time out."""
    ft = FaultToleranceConfig(hang_floor_s=floor)
    seen: list[float] = []
    for s, timeout in zip(steps, follow(ft, steps)):
        seen.append(s)
        bound = hang_bound(ft, typical_step(seen[-20:]))
        assert bound is None or bound < timeout, (seen, bound, timeout)


def _timeout_of(group: Any) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def test_a_running_generation_moves_to_the_derived_timeout() -> None:
    """A world of one: entered at 300 s (nothing measured), derived again between steps once one is
    measured, and its default group posts its next calls under the new timeout; a second
    derivation at a similar step changes nothing."""
    import torch.distributed as dist

    from oobleck_elastic.engine.reference import single_process

    cfg = load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        ["data.seq_len=8", "training.global_batch_size=4", "training.microbatch_size=2", "training.steps=3"],
    )
    trainer = single_process(cfg, dataset=RandomTokens(n=16, seq_len=8))
    try:
        assert trainer.timeout == timedelta(seconds=300) and _timeout_of(dist.group.WORLD) == timedelta(seconds=300)
        result = trainer.train_step(0)
        assert trainer.derive_timeout(result.seconds, running=True) == 120.0
        assert trainer.timeout == trainer.entry.timeout == timedelta(seconds=120)
        assert _timeout_of(dist.group.WORLD) == timedelta(seconds=120)  # the running generation's group
        assert trainer.progress.p2p_timeout == timedelta(seconds=120)  # gloo's pipeline waits
        assert trainer.derive_timeout(result.seconds * 1.5, running=True) is None
        trainer.train_step(1)  # it still steps
    finally:
        trainer.close()


class Spy(Progress):
    def __init__(self) -> None:
        super().__init__()
        self.marked: list[tuple[Any, ...]] = []

    def waiting(self, *works: Any):  # type: ignore[override]
        self.marked.append(works)
        return super().waiting(*works)


def test_the_fingerprint_waits_are_marked_with_their_handles() -> None:
    """The fingerprints' all-gather and a repair's broadcasts wait with their handles, so a step
    thread wedged there with its handles complete stands still (the hang watch cuts it off)."""
    import torch.distributed as dist

    from oobleck_elastic.engine.resilience.fingerprint import Corrupt, gather, repair
    from oobleck_elastic.testing import node_plan

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plan = node_plan(1, [[("a", 0, 2)]], num_layers=2)
        spy = Spy()
        table = gather(plan, {0: (1, 2), 1: (3, 4)}, None, spy)
        assert table == {0: {0: (1, 2), 1: (3, 4)}}
        t = torch.ones(3)
        repair(
            [Corrupt(layer=0, lane=0, holders=(0,), bad=(0,), source=0)],
            rank=0,
            tensors_of={0: [t]},
            groups={(0,): dist.group.WORLD},
            progress=spy,
        )
        assert len(spy.marked) == 2 and all(len(works) == 1 for works in spy.marked)
        assert all(w.is_completed() for works in spy.marked for w in works)
    finally:
        dist.destroy_process_group()


def test_an_entry_after_entries_with_no_step_waits_longer_to_connect() -> None:
    """The join timeout doubles with each entry in a row that followed no committed step, up to
    the collectives' timeout, and is the configured one again after a step."""
    from oobleck_elastic.config.timing import entry_join_timeout

    assert [entry_join_timeout(3.0, k, 30.0) for k in range(6)] == [3.0, 6.0, 12.0, 24.0, 30.0, 30.0]
    assert entry_join_timeout(3.0, 2, 2.0) == 3.0  # never below the configured one
    assert entry_join_timeout(3.0, 10_000, 300.0) == 300.0


def test_a_worker_counts_its_entries_with_no_step_between_them() -> None:
    from oobleck_elastic.engine.entry.enter import GenerationEntry

    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", [])
    entry = GenerationEntry(
        cfg,
        device=torch.device("cpu"),
        identity=("node0", 0),
        timeout=timedelta(seconds=30),
        join_timeout=timedelta(seconds=3),
    )
    seen = []
    for committed in (0, 0, 0, 4, 4, 5):  # the job's first entry, two restarts, a step, one, a step
        entry.count_entry(committed)
        seen.append((entry.idle_entries, entry.join_timeout.total_seconds()))
    assert seen == [(0, 3.0), (1, 6.0), (2, 12.0), (0, 3.0), (1, 6.0), (0, 3.0)]


CHECKED = """
import datetime, torch, torch.distributed as dist
from oobleck_elastic.engine.entry.groups import set_group_timeout
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=3))
g = dist.new_group([0], timeout=datetime.timedelta(seconds=3))
set_group_timeout(datetime.timedelta(seconds=30), g)
set_group_timeout(datetime.timedelta(seconds=40))
backend = lambda group: group._get_backend(torch.device("cpu"))
detail = dist.get_debug_level() == dist.DebugLevel.DETAIL
print(detail, type(backend(g)).__name__, backend(g).options._timeout.total_seconds(),
      backend(dist.group.WORLD).options._timeout.total_seconds())
"""


@pytest.mark.parametrize("debug", ["OFF", "DETAIL"])
def test_a_group_takes_its_new_timeout_also_under_torchs_collective_checker(debug: str) -> None:
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch wraps each group's backend, and its own
    `_set_pg_timeout` skips the wrapper with a warning: a group would keep the timeout it was
    created with when the timeout derived from the steps changes."""
    import subprocess
    import sys

    env = {**os.environ, "TORCH_DISTRIBUTED_DEBUG": debug, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CHECKED], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    wrapper = "_ProcessGroupWrapper" if debug == "DETAIL" else "ProcessGroupGloo"
    assert out.stdout.split() == [str(debug == "DETAIL"), wrapper, "30.0", "40.0"], out.stdout + out.stderr[-2000:]
