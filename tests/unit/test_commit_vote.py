"""The commit vote (engine/step/commit.py) on made-up values: its layout, a round trip through the
packed tensor, the MAX all-reduce of several workers' votes against the field-wise rule, the
precision of each field on the wire, and a malformed tensor refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from oobleck_elastic.engine.resilience.progress import Progress
from oobleck_elastic.engine.step.commit import CommitVote, combine, commit, own_slot


def _vote(rank: int, world_size: int, **fields) -> CommitVote:
    values = dict(
        generation=3,
        peak_rss_bytes=3 * 2**30,
        peak_device_bytes=None,
        max_loss=2.5,
        rejections=0,
        stop=0,
        entry_began=BEGAN + rank,
        entry_ended=BEGAN + 10 + rank,
        compute_s=own_slot(rank, world_size, 0.125 * (rank + 1)),
    )
    return CommitVote(**{**values, **fields})


BEGAN = 1_764_000_000.125  # a Unix time


def test_the_layout_has_eight_slots_then_one_per_rank_then_the_errored_groups() -> None:
    assert CommitVote.layout(4) == {
        "generation": slice(0, 1),
        "peak_rss_bytes": slice(1, 2),
        "peak_device_bytes": slice(2, 3),
        "max_loss": slice(3, 4),
        "rejections": slice(4, 5),
        "stop": slice(5, 6),
        "entry_began": slice(6, 7),
        "entry_ended": slice(7, 8),
        "compute_s": slice(8, 12),
        "errored_groups": slice(12, 13),
    }
    assert [CommitVote.size(n) for n in (1, 2, 8)] == [10, 11, 17]
    packed = _vote(2, 4, generation=7, peak_device_bytes=5 * 2**20, rejections=1, stop=1).pack()
    assert packed.dtype == torch.float64
    assert packed.tolist() == [7, 3 * 2**30, 5 * 2**20, 2.5, 1, 1, -(BEGAN + 2), BEGAN + 12, 0, 0, 0.375, 0, 0]


def test_a_vote_survives_pack_and_unpack() -> None:
    for vote in (_vote(1, 3), _vote(0, 1, peak_device_bytes=2**33, max_loss=0.0, rejections=2)):
        again = CommitVote.unpack(vote.pack(), world_size=vote.world_size)
        assert again == vote
        assert type(again.generation) is int and type(again.max_loss) is float
    assert _vote(0, 2).pack()[2] == -1  # None travels as -1 ...
    packed = _vote(0, 2).pack()
    packed[2] = -7.0
    assert CommitVote.unpack(packed, world_size=2).peak_device_bytes is None  # ... and any negative reads as None


def test_the_max_of_several_votes_is_the_field_wise_rule() -> None:
    votes = [
        _vote(0, 3, generation=4, peak_rss_bytes=2**30, max_loss=3.0),
        _vote(1, 3, generation=5, peak_rss_bytes=2**31, peak_device_bytes=2**20, rejections=1, stop=1),
        _vote(2, 3, generation=4, peak_rss_bytes=2**29, peak_device_bytes=2**22, max_loss=1.5),
    ]
    reduced = CommitVote.unpack(torch.stack([v.pack() for v in votes]).amax(0), world_size=3)
    assert reduced == combine(votes)
    assert reduced == CommitVote(
        generation=5,
        peak_rss_bytes=2**31,
        peak_device_bytes=2**22,
        max_loss=3.0,
        rejections=1,
        stop=1,  # one worker saw the request to stop: every worker stops at this boundary
        entry_began=BEGAN,  # the first worker to begin entering ...
        entry_ended=BEGAN + 12,  # ... and the last one to have entered
        compute_s=(0.125, 0.25, 0.375),  # every worker's own slot
    )
    assert combine(votes[:1]) == votes[0]
    assert combine([_vote(r, 2) for r in range(2)]).peak_device_bytes is None  # no worker has a device
    with pytest.raises(ValueError, match="no votes"):
        combine([])


def test_commit_is_one_max_all_reduce_over_the_group(monkeypatch) -> None:
    others = [_vote(1, 3, generation=9, max_loss=4.0), _vote(2, 3, rejections=2)]
    calls = []

    class Work:
        def wait(self) -> None:
            calls.append("waited")

        def is_completed(self) -> bool:
            return False

    def all_reduce(tensor: torch.Tensor, op=None, group=None, async_op=False) -> Work:  # the others' votes arrive
        calls.append((op, group, async_op))
        tensor.copy_(torch.stack([tensor, *(v.pack() for v in others)]).amax(0))
        return Work()

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    mine = _vote(0, 3)
    group, progress = object(), Progress()
    # its wait is marked as waiting for the peers (engine/resilience/progress.py)
    waiting = lambda: calls.append(progress.waits_for_a_peer())  # noqa: E731
    assert commit(mine, group=group, progress=progress, while_waiting=waiting) == combine([mine, *others])
    assert calls == [(dist.ReduceOp.MAX, group, True), True, "waited"]
    assert not progress.waits_for_a_peer()


def test_one_slot_fields_travel_as_float32_and_seconds_and_unix_times_as_float64() -> None:
    loss, seconds, began = 5.57361912727356, 0.1234567890123, 1_764_000_123.456789
    times = {"entry_began": began, "entry_ended": began}
    vote = _vote(0, 2, peak_rss_bytes=1_234_567_891, max_loss=loss, compute_s=(seconds, 0.0), **times)
    again = CommitVote.unpack(vote.pack(), world_size=2)
    assert again.peak_rss_bytes == 1_234_567_936  # the nearest float32
    assert again.max_loss == float(torch.tensor(loss, dtype=torch.float32)) != loss
    assert again.compute_s == (seconds, 0.0)
    assert again.entry_began == again.entry_ended == began  # to the microsecond, where float32 is off by 64 s


def test_a_malformed_tensor_is_refused_naming_the_layout() -> None:
    layout = (
        r"\(generation x 1, peak_rss_bytes x 1, peak_device_bytes x 1, max_loss x 1, rejections x 1, "
        r"stop x 1, entry_began x 1, entry_ended x 1, compute_s x 3, errored_groups x 1\)"
    )
    with pytest.raises(
        ValueError, match=rf"over 3 ranks is a flat float64 tensor of 12 slots {layout}; got shape \(7,\) "
    ):
        CommitVote.unpack(torch.zeros(7, dtype=torch.float64), world_size=3)
    with pytest.raises(ValueError, match=r"got shape \(12,\) of torch.float32"):
        CommitVote.unpack(torch.zeros(12), world_size=3)
    with pytest.raises(ValueError, match=r"got shape \(2, 4\)"):
        CommitVote.unpack(torch.zeros(2, 4, dtype=torch.float64), world_size=3)
