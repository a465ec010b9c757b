"""`training.microbatch_size: auto`: the sizes a profile is measured at, and a profile at any size.

Candidates are the divisors of the global batch up to global_batch_size // (f+1)
(`microbatch_candidates`); `profile_microbatch_sizes` measures 1 and the largest candidate <= 4;
`profile_at` fits each layer's times and bytes as a + c * b through the measured sizes (clamped at
>= 0; proportional with one size). `pick_microbatch_size` takes the best estimated samples/s,
ties to the larger size, among sizes that keep f+1 pipelines when any does. The size is chosen
once per job and carried by the plan. docs/planning.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ...config import JobConfig
from ..errors import PlanningError
from .profile import ModelProfile

__all__ = [
    "MicrobatchChoice",
    "MicrobatchError",
    "MicrobatchOption",
    "fixed_microbatch_size",
    "microbatch_candidates",
    "pick_microbatch_size",
    "profile_at",
    "profile_microbatch_sizes",
]

PROFILE_SECOND_SIZE_MAX = 4
"""The second size the profiler measures for `auto` is the largest candidate up to this."""
TIE_TOLERANCE = 1e-9
"""Relative samples/s difference below which two sizes tie (the larger one is chosen)."""


class MicrobatchError(PlanningError):
    """No candidate microbatch size can be planned. `memory_bound`: none fits in memory on any node
    count (more nodes would not help)."""

    def __init__(self, message: str, *, memory_bound: bool) -> None:
        super().__init__(message)
        self.memory_bound = memory_bound


def fixed_microbatch_size(cfg: JobConfig) -> Optional[int]:
    """training.microbatch_size as a number, or None for `auto`."""
    mb = cfg.training.microbatch_size
    return None if mb == "auto" else int(mb)


def microbatch_candidates(cfg: JobConfig) -> list[int]:
    """Divisors of training.global_batch_size up to global_batch_size // (f+1) (at least [1])."""
    total = cfg.training.global_batch_size
    cap = max(1, total // (cfg.fault_tolerance.f + 1))
    return [b for b in range(1, cap + 1) if total % b == 0]


def profile_microbatch_sizes(cfg: JobConfig) -> list[int]:
    """The microbatch sizes a profile is measured at: the configured one, or for `auto` 1 and the
    largest candidate <= PROFILE_SECOND_SIZE_MAX (only 1 when that is the only candidate)."""
    fixed = fixed_microbatch_size(cfg)
    if fixed is not None:
        return [fixed]
    small = [b for b in microbatch_candidates(cfg) if b <= PROFILE_SECOND_SIZE_MAX]
    return sorted({1, max(small)})


def _fit(points: Sequence[tuple[int, float]], size: int) -> float:
    """Least-squares line through (size, value) points at `size`, clamped at >= 0; one point:
    proportional."""
    if len(points) == 1:
        ((b0, y0),) = points
        return max(0.0, y0 * size / b0)
    n = len(points)
    mb = sum(b for b, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((b - mb) ** 2 for b, _ in points)
    slope = sum((b - mb) * (y - my) for b, y in points) / sxx
    return max(0.0, my + slope * (size - mb))


def profile_at(profile: ModelProfile, size: int) -> ModelProfile:
    """The profile at microbatch size `size`, from the sizes it was measured at (module
    docstring). Raises PlanningError when the profile does not say which size it was measured at."""
    measured = profile.measurements()
    if not measured:
        raise PlanningError(
            "training.microbatch_size=auto needs to know the microbatch size the profile was "
            "measured at, and this profile records none (neither microbatch_size nor "
            "key.microbatch_size): add it to the profile file, or set training.microbatch_size"
        )
    if size in measured:
        layers = list(measured[size])
    else:
        sizes = sorted(measured)
        layers = []
        for i, base in enumerate(profile.layers):
            names = ["forward_s", "backward_s", "activation_bytes", "output_bytes"]
            split = all(measured[b][i].split_measured for b in sizes)  # fitted only where every size has it
            names += ["input_grad_s", "weight_grad_s"] if split else []
            variant = all(measured[b][i].has_recomputed for b in sizes)
            names += ["recomputed_backward_s", "recomputed_activation_bytes"] if variant else []
            fit = {name: _fit([(b, float(getattr(measured[b][i], name))) for b in sizes], size) for name in names}
            layers.append(
                dataclasses.replace(
                    base,
                    forward_s=fit["forward_s"],
                    backward_s=fit["backward_s"],
                    activation_bytes=int(round(fit["activation_bytes"])),
                    output_bytes=int(round(fit["output_bytes"])),
                    input_grad_s=fit.get("input_grad_s"),
                    weight_grad_s=fit.get("weight_grad_s"),
                    recomputed_backward_s=fit.get("recomputed_backward_s"),
                    recomputed_activation_bytes=(int(round(fit["recomputed_activation_bytes"])) if variant else None),
                )
            )
    key = dict(profile.key) | {"microbatch_size": size, "fitted_from_microbatch_sizes": sorted(measured)}
    return ModelProfile(
        layers=layers,
        key=key,
        device_memory_bytes=profile.device_memory_bytes,
        tensor_parallel=profile.tensor_parallel,
        microbatch_size=size,
    )


@dataclass(frozen=True)
class MicrobatchOption:
    """One candidate size and what the planner estimates for it."""

    size: int
    """Samples per microbatch."""
    microbatches: int
    """Microbatches per global batch (global_batch_size / size)."""
    step_s: Optional[float] = None
    """Estimated step time of the plan at this size (None: it does not fit)."""
    samples_per_s: Optional[float] = None
    """Estimated samples/s of that plan."""
    pipelines: int = 0
    """Pipelines of that plan."""
    peak_memory_bytes: Optional[int] = None
    """Peak memory of one device over the plan's templates."""
    error: Optional[str] = None
    """Why this size cannot be planned (None: it can)."""
    memory_bound: bool = False
    """The error is that no template fits in memory at this size."""

    @property
    def fits(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size, "microbatches": self.microbatches, "fits": self.fits}
        if self.fits:
            out |= {
                "step_s": self.step_s,
                "samples_per_s": self.samples_per_s,
                "pipelines": self.pipelines,
                "peak_memory_bytes": self.peak_memory_bytes,
            }
        else:
            out["error"] = self.error
        return out


@dataclass(frozen=True)
class MicrobatchChoice:
    """The result of `training.microbatch_size: auto`: the size chosen and every candidate."""

    size: int
    """The size chosen."""
    nodes: int
    """The node count it was chosen for."""
    options: tuple[MicrobatchOption, ...]
    """Every candidate, smallest first."""
    measured_sizes: tuple[int, ...] = ()
    """The sizes the profile was measured at (the others are fitted)."""
    min_pipelines: int = 1
    """f+1: sizes whose plan has fewer pipelines are chosen only when no size reaches it."""

    def to_json(self) -> dict[str, Any]:
        return {
            "chosen": self.size,
            "nodes": self.nodes,
            "measured_sizes": list(self.measured_sizes),
            "min_pipelines": self.min_pipelines,
            "candidates": [o.to_json() for o in self.options],
        }


def pick_microbatch_size(
    options: Sequence[MicrobatchOption],
    *,
    nodes: int,
    min_pipelines: int = 1,
    measured_sizes: Sequence[int] = (),
    memory: str = "",
) -> MicrobatchChoice:
    """The fitting option with the best samples/s (ties within TIE_TOLERANCE: the larger size),
    among those whose plan has at least `min_pipelines` (f+1) pipelines when any has: a larger
    microbatch never buys throughput with fault tolerance. Raises MicrobatchError (one line naming
    training.microbatch_size and planning.device_memory_gb) when none fits; `memory` describes the
    device memory for that message."""
    ok = [o for o in options if o.fits]
    if not ok:
        sizes = ", ".join(str(o.size) for o in options)
        smallest = min(options, key=lambda o: o.size)
        bound = all(o.memory_bound for o in options)
        where = "in memory" if bound else f"on {nodes} node(s)"
        reason = " ".join(str(smallest.error).split())
        raise MicrobatchError(
            f"training.microbatch_size=auto: no candidate microbatch size ({sizes}) can be planned {where}"
            + (f" with {memory}" if memory else "")
            + f" (at size {smallest.size}: {reason}); raise "
            "planning.device_memory_gb (or use devices with more memory)"
            + ("" if bound else ", add nodes")
            + " or set training.microbatch_size to a number",
            memory_bound=bound,
        )
    ok = [o for o in ok if o.pipelines >= min_pipelines] or ok
    best = max(o.samples_per_s or 0.0 for o in ok)
    chosen = max(o.size for o in ok if (o.samples_per_s or 0.0) >= best * (1 - TIE_TOLERANCE))
    return MicrobatchChoice(
        size=chosen,
        nodes=nodes,
        options=tuple(sorted(options, key=lambda o: o.size)),
        measured_sizes=tuple(sorted(measured_sizes)),
        min_pipelines=min_pipelines,
    )
