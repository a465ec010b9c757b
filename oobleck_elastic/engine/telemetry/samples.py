"""One worker's side of the sample ledger (`SampleLedger`): what it fed, applied, skipped and restored.

The records, and the check that proves from them that every sample of a job was used exactly
once, are records/samples.py's; this writer turns the trainer's moments into those records.
Invariant: a batch is recorded as the sample indices actually collated, so the check sees what
trained, not what was planned. docs/training.md.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from ...config import JobConfig
from ...logs import event_line
from ...records.samples import EVENT, runs

__all__ = ["SampleLedger"]


class Sampler(Protocol):
    """What the ledger needs of `data/sampler.py:GlobalBatchSampler`."""

    global_batch_size: int
    steps_per_epoch: int

    def epoch_of(self, step: int) -> int: ...

    def epoch_permutation(self, epoch: int) -> Any: ...

    def positions(self, epoch: int, indices: Sequence[int]) -> list[int]: ...


class SampleLedger:
    """Writes one worker's sample ledger records as JSON event lines (logs.py `event_line`); does
    nothing without `logging.events_dir`. `sampler` is the trainer's `GlobalBatchSampler`. `fed`:
    by the worker feeding a pipeline (first stage, lane 0), before the step's first communication;
    `committed`: by every worker that applied (in the step or rolling it forward) or skipped a
    step; `restored`: by every worker that restored a checkpoint."""

    def __init__(self, cfg: JobConfig, sampler: Sampler, node: str) -> None:
        self.on = bool(cfg.logging.events_dir)
        self.steps, self.sampler, self.node = cfg.training.steps, sampler, node

    def fed(
        self,
        step: int,
        indices: Sequence[int],
        *,
        generation: int,
        rank: int,
        pipeline: int,
        pipelines: int,
        slice_: tuple[int, int],
    ) -> None:
        """Pipeline `pipeline` (of `pipelines`) took `indices`, its `slice_` of step `step`'s batch."""
        if not self.on:
            return
        s = self.sampler
        epoch = s.epoch_of(step)
        fields = {
            "kind": "fed",
            "pipeline": pipeline,
            "pipelines": pipelines,
            "slice": list(slice_),
            "batch": s.global_batch_size,
            "steps_per_epoch": s.steps_per_epoch,
            "steps": self.steps,
            "epoch": epoch,
            "positions": self._positions(step, epoch, indices, slice_),
        }
        event_line(EVENT, fields, gen=generation, step=step, node=self.node, rank=rank)

    def _positions(self, step: int, epoch: int, indices: Sequence[int], slice_: tuple[int, int]) -> list[list[int]]:
        """`indices` as runs of positions in `epoch`'s permutation: the slice's own range when the
        permutation holds exactly `indices` there (a comparison), else each index looked up."""
        s = self.sampler
        lo = (step % s.steps_per_epoch) * s.global_batch_size + slice_[0]
        hi = lo + slice_[1] - slice_[0]
        if [int(i) for i in s.epoch_permutation(epoch)[lo:hi].tolist()] == [int(i) for i in indices]:
            return [[lo, hi]] if hi > lo else []
        return runs(s.positions(epoch, indices))

    def committed(self, kind: str, step: int, *, generation: int, rank: int, how: Optional[str] = None) -> None:
        """Step `step`'s `kind` ("applied": of the gradients fed in `generation`; "skipped")."""
        if self.on:
            fields = {"kind": kind, **({"how": how} if how else {})}
            event_line(EVENT, fields, gen=generation, step=step, node=self.node, rank=rank)

    def restored(self, step: int, *, generation: int, rank: int) -> None:
        """A checkpoint was restored in `generation`: the job goes on from step `step`."""
        if self.on:
            event_line(EVENT, {"kind": "restored"}, gen=generation, step=step, node=self.node, rank=rank)
