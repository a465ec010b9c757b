"""ZB-H1 on one chunk per device at any microbatch count (`OneChunkZeroBubble`).

torch's `ScheduleInterleavedZeroBubble` runs the microbatches in rounds of r = max(1, m // D)
and refuses an m that is not a multiple of r (9 microbatches on 4 devices). With one chunk per
device the rounds change nothing in the order, so this is torch's schedule built with one round:
the ZB-H1 order planning/schedules/schedules.py plans, for every m (tests/unit/test_schedules.py compares it
with torch's action for action). With two or more chunks torch's rule stands and the planner
refuses those m too. docs/schedules.md.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch.distributed.pipelining.schedules import (
    ScheduleInterleavedZeroBubble,
    _check_torch_compile_compatibility,
    _PipelineScheduleRuntime,
)

__all__ = ["OneChunkZeroBubble"]


class OneChunkZeroBubble(ScheduleInterleavedZeroBubble):
    """torch's interleaved zero-bubble schedule on one stage per rank, its microbatches in one
    round (module docstring): the same order, without the rounds rule that one chunk does not need."""

    def __init__(
        self,
        stages: list[Any],
        n_microbatches: int,
        loss_fn: Optional[Callable[..., Any]] = None,
        scale_grads: bool = True,
    ) -> None:
        if len(stages) != 1:
            raise ValueError(f"OneChunkZeroBubble runs one stage per rank (got {len(stages)}): use torch's schedule")
        # ScheduleInterleavedZeroBubble.__init__ without its rounds check (torch 2.13)
        _check_torch_compile_compatibility(stages, type(self).__name__)
        self.pp_group_size = stages[0].group_size
        _PipelineScheduleRuntime.__init__(
            self, stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads
        )
        self.n_local_stages = 1
        self.rank = stages[0].group_rank
        self.number_of_rounds = 1
        self.microbatches_per_round = n_microbatches
        self.pipeline_order = {r: self._calculate_single_rank_operations(r) for r in range(self.pp_group_size)}
        self.pipeline_order = self._add_bubbles_to_actions(self.pp_group_size)
        self._prepare_schedule_with_comms(self.pipeline_order)
