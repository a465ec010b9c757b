"""Replica fingerprints (engine/resilience/fingerprint.py): the decision on made-up tables, the fingerprint of
real tensors, and jobs where one copy of a layer has a bit flipped (repaired with three holders,
the job stopped with two)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oobleck_elastic.config import load_config
from oobleck_elastic.engine.resilience.faults import FaultInjector
from oobleck_elastic.engine.resilience.fingerprint import Corrupt, Unrepairable, compare, fingerprints, is_check_step
from helpers import ROOT, assert_same, layout_plan, run_job, tiny_profile


def _table(plan, prints: dict[int, int]) -> dict[int, dict[int, tuple[int, int]]]:
    """Every holder's copy of every layer fingerprints as (1, 1), except `prints`: rank -> value for layer 2."""
    table: dict[int, dict[int, tuple[int, int]]] = {}
    for layer in range(plan.num_layers):
        for r in plan.holders(layer):
            table.setdefault(r, {})[layer] = (prints.get(r, 1), 1) if layer == 2 else (1, 1)
    return table


def test_compare_finds_the_odd_copy_and_its_source() -> None:
    # three pipelines cut differently: layer 2 is held by ranks 0, 2 and 3
    plan = layout_plan([[(0, 6)], [(0, 2), (2, 6)], [(0, 3), (3, 6)]], [2, 2, 2], generation=1)
    assert sorted(plan.holders(2)) == [0, 2, 3]
    assert compare(plan, _table(plan, {})) == []
    assert compare(plan, _table(plan, {2: 7})) == [Corrupt(layer=2, lane=0, holders=(0, 2, 3), bad=(2,), source=0)]
    assert compare(plan, _table(plan, {0: 7})) == [Corrupt(layer=2, lane=0, holders=(0, 2, 3), bad=(0,), source=2)]
    with pytest.raises(
        Unrepairable,
        match=r"^the copies of layer 2 differ between its 3 holders \(rank 0 on n0, "
        r"rank 2 on n2, rank 3 on n3\) and no majority agrees",
    ):
        compare(plan, _table(plan, {0: 7, 2: 8}))


def test_two_holders_that_differ_cannot_be_repaired() -> None:
    plan = layout_plan([[(0, 6)], [(0, 3), (3, 6)]], [2, 2], generation=1)
    with pytest.raises(
        Unrepairable,
        match=r"^the copies of layer 2 differ between its 2 holders \(rank 0 on n0, "
        r"rank 1 on n1\) and no majority agrees, so the intact copy cannot be "
        r"told \(silent data corruption\): restart the job from the newest "
        r"checkpoint, and check those nodes' devices$",
    ):
        compare(plan, _table(plan, {1: 5}))


def test_fingerprints_are_exact_and_see_one_flipped_bit() -> None:
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(3000, 700, generator=g), torch.randn(5, generator=g).bfloat16(), torch.tensor(4.0)]
    b = [t.clone() for t in a]
    assert fingerprints({0: a, 3: b}) == {0: fingerprints({0: a})[0], 3: fingerprints({0: a})[0]}
    for t, index in ((b[0], 2_000_000), (b[1], 4), (b[2], 0)):  # past the first weighting chunk, bf16, a scalar
        before = fingerprints({0: b})[0]
        words = t.view(-1).view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)
        words[index] ^= 1 << 3
        assert fingerprints({0: b})[0][0] != before[0]
        words[index] ^= 1 << 3
        assert fingerprints({0: b})[0] == before
    # the same words in another order: the plain sum agrees, the weighted one does not
    swapped = [a[0].flip(0), *a[1:]]
    assert fingerprints({0: swapped})[0][0] == fingerprints({0: a})[0][0]
    assert fingerprints({0: swapped})[0][1] != fingerprints({0: a})[0][1]


def test_check_steps_settings_and_fault_specs() -> None:
    assert [s for s in range(10) if is_check_step(s, 4)] == [3, 7]
    assert not any(is_check_step(s, 0) for s in range(10))
    with pytest.raises(
        ValueError,
        match=r"'fault_tolerance.fingerprint_interval_steps' must be >= 0 \(0 = off; "
        r"got -1\)",
    ):
        load_config(ROOT / "configs/gpt2-tiny.yaml", ["fault_tolerance.fingerprint_interval_steps=-1"])
    with pytest.raises(ValueError, match=r"^OOBLECK_FLIP_AT='1@3': each item must be RANK@STEP:LAYER, e.g. 1@3:2$"):
        FaultInjector.from_env({"OOBLECK_FLIP_AT": "1@3"})
    assert FaultInjector.from_env({"OOBLECK_FLIP_AT": "1@3:2, 0@5:0"}).flips == {(1, 3): 2, (0, 5): 0}


# n0 = 1 (the tiny profile's layers fit one device of 100 GB): every node is a one-stage pipeline
_ONE_NODE_PIPELINES = ["planning.device_memory_gb=100", "fault_tolerance.fingerprint_interval_steps=2"]


@pytest.mark.slow
def test_a_flipped_bit_in_one_of_three_copies_is_repaired_in_place(tmp_path: Path, etcd_server, run_id) -> None:
    """f = 2 on three nodes: three copies of every layer. Rank 1's copy of layer 2 gets a bit
    flipped after 0-based step 3 (the progress line's step 4); the check after that step replaces it
    from the other two, so the job ends with the weights of one process that never saw the flip
    (without the repair, the flip is summed into every copy's gradients from then on and the
    weights differ). The lines number the step as the progress line does."""
    out, job, ref = _three_copies(tmp_path, etcd_server, run_id, "1@3:2")
    assert all(f"gen 1 step 4 node node{i}: {REPAIRED}" in out for i in range(3)), out[-3000:]
    assert f"repaired: {REPAIRED}" in out, out[-3000:]  # the summary
    assert_same(job, ref)


@pytest.mark.slow
def test_a_flipped_bit_with_two_copies_stops_the_job_naming_the_layer(tmp_path: Path, etcd_server, run_id) -> None:
    profile = tiny_profile(tmp_path / "profile.json")
    out, _, _ = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "2"],
        8,
        profile,
        extra=_ONE_NODE_PIPELINES,
        env={"OOBLECK_FLIP_AT": "1@3:2"},
        expect_failure=True,
    )
    assert (
        "the copies of layer 2 differ between its 2 holders (rank 0 on node0, rank 1 on node1) and no majority "
        "agrees" in out
    ), out[-3000:]
    assert "the job was closed as failed" in out or "JobFailed" in out, out[-3000:]


@pytest.mark.slow
def test_a_bit_flipped_between_checks_is_repaired_at_the_next_check(tmp_path: Path, etcd_server, run_id) -> None:
    """The realistic case (0-based steps; the logs count from 1): the flip lands after step 2,
    between the checks after steps 1 and 3, so the corrupt copy trains step 3 and its gradients
    reach the other copies. The check after step 3 (the log's step 4) replaces it; from then on
    the copies agree (the checks after steps 5 and 7 find nothing). The weights differ from a
    run without the flip: the damage between two checks is not undone, only bounded by the
    interval."""
    out, job, ref = _three_copies(tmp_path, etcd_server, run_id, "1@2:2")
    assert all(f"gen 1 step 4 node node{i}: {REPAIRED}" in out for i in range(3)), out[-3000:]
    assert out.count("silent data corruption") == 4, out[-3000:]  # 3 workers and the summary: once
    assert _differs(job, ref)


@pytest.mark.extended
def test_without_the_check_a_flipped_bit_stays_in_the_weights(tmp_path: Path, etcd_server, run_id) -> None:
    """The negative control of the repair tests: the same flip with the check off; the job
    finishes, nothing is repaired, and its weights differ from the run without the flip."""
    out, job, ref = _three_copies(
        tmp_path, etcd_server, run_id, "1@3:2", "fault_tolerance.fingerprint_interval_steps=0"
    )
    assert "silent data corruption" not in out, out[-3000:]
    assert _differs(job, ref)


REPAIRED = (
    "step 4: layer 2: the copy of rank 1 differed from its 3 holders' majority; replaced by rank 0's "
    "(silent data corruption)"
)
"""The repair line of the f = 2 jobs whose rank 1 gets layer 2's bit flipped before the check
after the log's step 4."""


def _three_copies(tmp_path: Path, etcd_server, run_id: str, flip: str, *extra: str) -> tuple[str, dict, dict]:
    """An 8-step job on three one-node pipelines with f = 2 (three copies of every layer), a bit
    flipped as `OOBLECK_FLIP_AT=flip` says; (output, job weights, reference weights)."""
    return run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "3"],
        8,
        tiny_profile(tmp_path / "profile.json"),
        extra=["fault_tolerance.f=2", *_ONE_NODE_PIPELINES, *extra],
        env={"OOBLECK_FLIP_AT": flip},
    )


def _differs(job: dict, ref: dict) -> bool:
    """Whether some tensor of `job` is outside the equality tolerance of the job tests."""
    assert set(job) == set(ref)
    return any(not torch.allclose(job[k], ref[k], rtol=1e-5, atol=1e-6) for k in ref)
