"""Paced devices: workers that share a machine's cores made to behave like devices of their own.

With `training.paced_devices` = k > 0 (benchmarks and tests only), every pass a stage makes over
one microbatch is padded by a sleep to k times what the plan expects of it (`pace_targets`: the
forward to k x `forward_s`, the backward to k x the rest of `compute_s`, a split backward's I and
W passes by the planner's `WEIGHT_SHARE`; each chunk to its own times), so a schedule's bubble
can be measured on a small machine. A node whose device is slower or faster than the plan
believes (`OOBLECK_PACED_SPEED`, a mixed fleet's benchmark) pads to k x the plan's time x the
speed the plan assumed / its own (`node_factor`). Communication, the optimizer step and
one-stage pipelines are not paced. `Pacer` applies it, `pace_stage` installs it. docs/schedules.md.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ...logs import JobLog
from ...planning.plan.plan import StagePlacement
from ...planning.schedules.choice import WEIGHT_SHARE

__all__ = [
    "PaceTargets",
    "Pacer",
    "node_factor",
    "pace_stage",
    "pace_targets",
    "padding_s",
    "pass_of",
    "pin_threads",
]

FORWARD_SHARE_UNKNOWN = 1 / 3
"""The forward's share of compute_s for a plan that carries no forward_s (backward = 2 x forward)."""


@dataclass(frozen=True)
class PaceTargets:
    """Seconds one pass over one microbatch takes on the paced device."""

    forward_s: float
    input_grad_s: float
    weight_grad_s: float

    @property
    def backward_s(self) -> float:
        """The whole backward (input and weight gradients in one pass)."""
        return self.input_grad_s + self.weight_grad_s

    def of(self, pass_: str) -> float:
        """The target of `pass_`: forward, backward, input_grad or weight_grad."""
        return {
            "forward": self.forward_s,
            "backward": self.backward_s,
            "input_grad": self.input_grad_s,
            "weight_grad": self.weight_grad_s,
        }[pass_]


def pace_targets(compute_s: float, forward_s: float, factor: float, weight_share: float = WEIGHT_SHARE) -> PaceTargets:
    """The targets of a stage whose forward + backward of one microbatch is `compute_s`, of which
    `forward_s` the forward (0 or more than compute_s: unknown, a third), paced at `factor`.
    Zero targets (no padding) when the factor or compute_s is not positive."""
    if factor <= 0 or compute_s <= 0:
        return PaceTargets(0.0, 0.0, 0.0)
    forward = forward_s if 0 < forward_s <= compute_s else compute_s * FORWARD_SHARE_UNKNOWN
    backward = compute_s - forward
    return PaceTargets(
        forward_s=factor * forward,
        input_grad_s=factor * backward * (1.0 - weight_share),
        weight_grad_s=factor * backward * weight_share,
    )


def node_factor(paced: float, planned_speed: float, node_speed: Optional[float]) -> float:
    """The factor a paced device pads the plan's times by: `paced` (training.paced_devices) x the
    speed the plan assumed for this device (its class's, 1 without classes) / the device's own
    (`node_speed`, OOBLECK_PACED_SPEED; None: as the plan assumed). 0 when not paced."""
    if paced <= 0:
        return 0.0
    if node_speed is None:
        return paced
    if node_speed <= 0:
        raise ValueError(f"OOBLECK_PACED_SPEED={node_speed:g}: give a speed > 0 (1 = the profiled device)")
    return paced * planned_speed / node_speed


def padding_s(target_s: float, elapsed_s: float) -> float:
    """How long to sleep after a pass that took `elapsed_s` to make it last `target_s`."""
    return max(0.0, target_s - elapsed_s)


def pass_of(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Which pass a call of the stage's `method` with `args` and `kwargs` makes
    (`backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, ...)`)."""
    if method == "forward_one_chunk":
        return "forward"
    if method == "backward_one_chunk":
        full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
        return "backward" if full else "input_grad"
    if method == "backward_weight_one_chunk":
        return "weight_grad"
    raise ValueError(f"{method} is no pass of a pipeline stage")


@dataclass
class Pacer:
    """Pads the passes it wraps (`paced`) to `targets`: the sleep runs to a deadline from the
    call's start (on CUDA after the device finished the pass), so it absorbs the real arithmetic
    and the time spent waiting for a core. A pass longer than its target is not shortened; the
    first overrun after the stage's first step is logged once: raise k. On the CPU the sleeps are
    outside the straggler clock (thread CPU time), which still measures the real arithmetic."""

    targets: PaceTargets
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    log: Optional[JobLog] = None
    step: Callable[[], int] = lambda: 0
    calls: dict[str, int] = field(default_factory=dict)
    """Padded calls per pass."""
    wall_s: dict[str, float] = field(default_factory=dict)
    """Wall seconds of those calls, sleeps included, per pass."""
    overruns: int = 0
    """Calls that took longer than their target before any padding."""
    _first_step: Optional[int] = None
    _warned: bool = False

    def paced(self, fn: Callable[..., Any], method: str) -> Callable[..., Any]:
        """`fn` (the stage's `method`), each call padded to its pass's target."""

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            if self._first_step is None:
                self._first_step = self.step()
            out = fn(*args, **kwargs)
            pass_ = pass_of(method, args, kwargs)
            target = self.targets.of(pass_)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the pass is done when the device is
            elapsed = time.perf_counter() - t0
            if elapsed > target:
                self._overrun(pass_, elapsed, target)
            while (left := padding_s(target, time.perf_counter() - t0)) > 0:
                time.sleep(left)  # to the deadline: a sleep may end early on a signal
            self.calls[pass_] = self.calls.get(pass_, 0) + 1
            self.wall_s[pass_] = self.wall_s.get(pass_, 0.0) + time.perf_counter() - t0
            return out

        return run

    def _overrun(self, pass_: str, elapsed: float, target: float) -> None:
        self.overruns += 1
        step = self.step()
        if self._warned or self.log is None or step == self._first_step:
            return  # the first step's first passes carry one-off costs (allocations): not the pace's fault
        self._warned = True
        self.log.at(step=step).warning(
            "paced device: a %s took %.1f ms, more than its %.1f ms target; raise training.paced_devices",
            pass_,
            elapsed * 1e3,
            target * 1e3,
            event="paced_overrun",
        )


def pace_stage(
    pstage: Any,
    stage: StagePlacement,
    factor: float,
    *,
    device: torch.device,
    log: Optional[JobLog] = None,
    step: Callable[[], int] = lambda: 0,
    chunk: int = 0,
) -> Optional[Pacer]:
    """Pad `pstage`'s passes to `stage`'s plan times x `factor` (with chunks: chunk `chunk`'s,
    `StagePlacement.chunk_times`); None (nothing changed) when the factor is 0. Wrap before any
    timer that should see the padded pass."""
    if factor <= 0:
        return None
    compute_s, forward_s = stage.compute_s, stage.forward_s
    if len(stage.layer_ranges()) > 1:
        if len(stage.chunk_times) != len(stage.layer_ranges()):  # the device's times only
            if log is not None and chunk == 0:
                log.warning(
                    "paced device: this device runs %d chunks and the plan gives no time per chunk; not paced",
                    len(stage.chunks),
                )
            return None
        compute_s, forward_s = stage.chunk_times[chunk]
    pacer = Pacer(pace_targets(compute_s, forward_s, factor), device=device, log=log, step=step)
    for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        if hasattr(pstage, method):
            setattr(pstage, method, pacer.paced(getattr(pstage, method), method))
    if log is not None and compute_s <= 0:
        log.warning("paced device: the plan gives this stage no compute time; its passes are not padded")
    return pacer


def pin_threads(factor: float, device: torch.device) -> None:
    """A paced worker on the CPU uses one intra-op thread: workers sharing cores must not also
    share a thread pool's spinning (their real arithmetic stays short and even)."""
    if factor > 0 and device.type == "cpu" and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
