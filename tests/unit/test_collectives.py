"""Which control collectives an entry, a step and a retake issue (engine/step/collectives.py): pure
functions of the plan and of agreed values, so every member issues the same ones in one order."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from oobleck_elastic.engine.step.collectives import (
    Collective,
    checked_timeout,
    entry_collectives,
    retake_collectives,
    save_collectives,
    step_collectives,
)
from oobleck_elastic.testing import node_plan

C = Collective


def test_an_entry_agrees_on_the_step_then_the_layouts_and_releases_donors_only_when_there_are_some() -> None:
    plan = node_plan(2, [[("n0", 0, 3), ("n1", 3, 6)]])
    assert entry_collectives(plan) == (C.AGREE_STEP, C.AGREE_LAYOUTS)
    with_donor = dataclasses.replace(plan, donors=("n2",))
    assert entry_collectives(with_donor) == (C.AGREE_STEP, C.AGREE_LAYOUTS, C.RELEASE_DONORS)


def test_a_step_checks_the_replicas_only_after_an_applied_step_on_the_interval() -> None:
    base = (C.NORM_AND_LOSS, C.COMMIT)
    assert step_collectives(0, applied=True, fingerprint_interval=0) == base
    assert step_collectives(0, applied=True, fingerprint_interval=2) == base
    assert step_collectives(1, applied=True, fingerprint_interval=2) == (*base, C.FINGERPRINTS)
    assert step_collectives(1, applied=False, fingerprint_interval=2) == base  # rejected: replayed, not checked


def test_a_retake_looks_then_saves_unless_the_agreed_look_found_one() -> None:
    assert retake_collectives(exists=None) == (C.CHECKPOINT_EXISTS,)
    assert retake_collectives(exists=True) == (C.CHECKPOINT_EXISTS,)
    assert retake_collectives(exists=False) == (C.CHECKPOINT_EXISTS, *save_collectives())
    assert save_collectives() == (C.CHECKPOINT_ROOM, C.CHECKPOINT_BARRIER)


def test_a_save_that_does_not_fit_agrees_on_the_room_and_writes_nothing() -> None:
    assert save_collectives(fits=False) == (C.CHECKPOINT_ROOM,)


def test_the_same_inputs_give_the_same_collectives_whatever_the_rank() -> None:
    """Nothing rank-local goes in: the decision of rank 0 is the decision of every rank."""
    for step in range(6):
        for applied in (True, False):
            runs = {step_collectives(step, applied=applied, fingerprint_interval=3) for _ in range(4)}
            assert len(runs) == 1


def test_groups_that_carry_collectives_connect_under_the_join_timeout_unless_torch_checks_them(monkeypatch) -> None:
    import torch.distributed as dist

    join, comm = timedelta(seconds=3), timedelta(seconds=60)
    monkeypatch.setattr(dist, "get_debug_level", lambda: dist.DebugLevel.OFF)
    assert checked_timeout(join, comm) == join
    monkeypatch.setattr(dist, "get_debug_level", lambda: dist.DebugLevel.DETAIL)
    assert checked_timeout(join, comm) == comm
