"""How far profiling has got, and about how long it still takes.

Progress is reported per run (one forward and backward of one microbatch), at most every
`every_s` seconds, and after every layer. `time_left` takes the current layer's mean run time for
its remaining runs and the mean time of a layer so far for each layer not started: layers differ,
so it is an estimate, and says "about". docs/planning.md.
"""

from __future__ import annotations

import time
from statistics import fmean
from typing import Callable, Optional, Sequence

__all__ = ["PROGRESS_EVERY_S", "ProfileProgress", "format_seconds", "time_left"]

PROGRESS_EVERY_S = 5.0
"""Seconds between two progress lines while a layer is measured."""


def time_left(
    layers_s: Sequence[float], runs_s: Sequence[float], runs_per_layer: int, layers_not_started: int
) -> Optional[float]:
    """Seconds profiling still needs, estimated: the current layer's remaining runs at the mean of
    its finished runs `runs_s`, plus `layers_not_started` layers at the mean time of a layer: of
    the finished layers `layers_s` and the current one (its mean run x `runs_per_layer`). None
    when nothing has been timed yet (no finished layer, no finished run)."""
    run = fmean(runs_s) if runs_s else None
    layers = [*layers_s, *([run * runs_per_layer] if run is not None else [])]
    if not layers:
        return None
    current = run * max(0, runs_per_layer - len(runs_s)) if run is not None else 0.0
    return current + fmean(layers) * max(0, layers_not_started)


def format_seconds(s: float) -> str:
    """`42 s`, `3 min 05 s`, `1 h 02 min`: a duration for a progress line."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


class ProfileProgress:
    """Reports profiling progress through `log` (see the module docstring). The profiler calls
    `start_layer(name)`, `run_done()` after every run and `layer_done()` after each measured layer;
    `total_layers` is how many layers will be measured (over every microbatch size)."""

    def __init__(
        self,
        total_layers: int,
        runs_per_layer: int,
        log: Callable[[str], None],
        *,
        every_s: float = PROGRESS_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_layers, self.runs_per_layer, self.log = total_layers, runs_per_layer, log
        self.every_s, self.clock = every_s, clock
        self.started = self.last_line = clock()
        self.layers_s: list[float] = []
        self.runs_s: list[float] = []
        self.layer: Optional[str] = None
        self._layer_t0 = self._run_t0 = self.started

    @property
    def done(self) -> int:
        return len(self.layers_s)

    def start_layer(self, name: str) -> None:
        self.layer, self.runs_s = name, []
        self._layer_t0 = self._run_t0 = self.clock()

    def run_done(self) -> None:
        now = self.clock()
        self.runs_s.append(now - self._run_t0)
        self._run_t0 = now
        if now - self.last_line >= self.every_s:
            self.log(self.line(now))

    def layer_done(self) -> str:
        """Closes the current layer; returns its summary ('1/3 layers measured, ...') for the
        profiler's line about the layer."""
        now = self.clock()
        self.layers_s.append(now - self._layer_t0)
        self.layer, self.runs_s = None, []
        self.last_line = now
        return self.summary(now)

    def estimate(self) -> Optional[float]:
        started = 1 if self.layer is not None else 0
        return time_left(self.layers_s, self.runs_s, self.runs_per_layer, self.total_layers - self.done - started)

    def summary(self, now: Optional[float] = None) -> str:
        now = self.clock() if now is None else now
        left = self.estimate() if self.done < self.total_layers else None
        text = f"{self.done}/{self.total_layers} layers measured, {format_seconds(now - self.started)} so far"
        return text + (f", about {format_seconds(left)} left" if left is not None else "")

    def line(self, now: Optional[float] = None) -> str:
        """The progress line: layers measured, the layer being measured and its run, time so far and left."""
        now = self.clock() if now is None else now
        self.last_line = now
        current = (
            f", measuring {self.layer} (run {len(self.runs_s) + 1}/{self.runs_per_layer})"
            if self.layer is not None and len(self.runs_s) < self.runs_per_layer
            else (f", measuring {self.layer} (its memory)" if self.layer is not None else "")
        )
        left = self.estimate()
        return (
            f"profiling: {self.done}/{self.total_layers} layers measured{current}, "
            f"{format_seconds(now - self.started)} so far"
            + (f", about {format_seconds(left)} left" if left is not None else "")
        )
