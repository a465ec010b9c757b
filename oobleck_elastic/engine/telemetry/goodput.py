"""One worker's side of the goodput ledger: the clock that charges its time while it holds rank 0.

The ledger itself (its categories, the pure transitions and the report `oobleck goodput` prints)
is a record shared with the control plane: records/goodput.py explains where each second of a
job's wall time goes. `GoodputClock` applies those transitions to the job's ledger with the wall
clock as engine/worker.py goes through generations and steps, while this worker holds rank 0 of the
current generation; it sends the ledger with every progress report and writes it to TensorBoard.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterator, Optional

from ...logs import JobLog
from ...records.goodput import Category, Ledger, Origin, began_step, continue_from, ended_step, switch

log = JobLog(logging.getLogger("oobleck_elastic.train"))

__all__ = ["GoodputClock"]


# ---------------------------------------------------------------------------- one worker's clock
class GoodputClock:
    """One worker's side of the ledger (module docstring): it holds the job's ledger while the
    worker holds rank 0 and does nothing otherwise. `clock` is the wall clock (tests pass their own)."""

    def __init__(self, node: str, clock: Callable[[], float] = time.time) -> None:
        self.node, self.clock = node, clock
        self.ledger: Optional[Ledger] = None
        """The job's ledger, while this worker holds rank 0."""

    def entered(self, generation: int, step: int, *, rank0: bool, origin: Callable[[], Origin]) -> None:
        """This worker entered `generation` at `step`, holding rank 0 or not (`origin` is read only
        when it does)."""
        if not rank0:
            self.ledger = None
            return
        try:
            found = origin()
        except Exception as err:  # noqa: BLE001 - the ledger is informative; training goes on
            log.at(gen=generation, step=step, node=self.node).warning(
                "goodput ledger: could not read where it stands (%s); continuing from %s",
                err,
                "this worker's own" if self.ledger is not None else "now, as if the job started here",
            )
            found = Origin(reported=None)
        self.ledger = continue_from(self.ledger, found, self.clock())

    def began_step(self) -> None:
        if self.ledger is not None:
            self.ledger = began_step(self.ledger, self.clock())

    def ended_step(self, step: int, outcome: Category, shadows_s: float = 0.0) -> None:
        """Step `step` ended as `outcome`, `shadows_s` of it on the shadow copies' exchange."""
        if self.ledger is not None:
            self.ledger = ended_step(self.ledger, self.clock(), step, outcome, shadows_s)

    @contextlib.contextmanager
    def checkpointing(self) -> Iterator[None]:
        """Time inside is `checkpointing`, then the bookkeeping goes on as `useful`."""
        if self.ledger is not None:
            self.ledger = switch(self.ledger, self.clock(), Category.CHECKPOINTING)
        try:
            yield
        finally:
            if self.ledger is not None:
                self.ledger = switch(self.ledger, self.clock(), Category.USEFUL)

    def snapshot(self) -> Optional[Ledger]:
        """The ledger accounted up to now (the open interval charged so far), or None."""
        if self.ledger is not None and self.ledger.open is not None:
            self.ledger = switch(self.ledger, self.clock(), self.ledger.open)
        return self.ledger

    def reporter(self, report: Callable[..., None], metrics: Any) -> Callable[..., None]:
        """`report` (ControlPlane.report_progress) with the ledger so far added as `goodput`, also
        written to TensorBoard (`metrics`, engine/telemetry/metrics.py; None: not written)."""

        def send(**fields: Any) -> None:
            ledger = self.snapshot()
            if ledger is None:
                report(**fields)
                return
            report(**fields, goodput=ledger.to_json())
            if metrics is not None:
                metrics.goodput({c.value: ledger.get(c) for c in Category}, ledger.fraction, step=fields.get("step", 0))

        return send

    def finished(self, report: Callable[..., None], metrics: Any, *, generation: int, step: int) -> None:
        """The last report, just before rank 0 closes the job (it covers the final checkpoint)."""
        self.reporter(report, None)(generation=generation, step=step)
        ledger = self.ledger
        if ledger is not None:
            if metrics is not None:  # the last step's point: the final checkpoint included
                metrics.goodput({c.value: ledger.get(c) for c in Category}, ledger.fraction, step=step, final=True)
            log.at(gen=generation, step=step, node=self.node).info(
                "goodput %.1f%% of %.1f s (%s)",
                100 * ledger.fraction,
                ledger.total,
                ", ".join(f"{c.value} {ledger.get(c):.1f} s" for c in Category if ledger.get(c) > 0),
            )
