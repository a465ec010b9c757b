"""What one step gives back to the loop (`StepResult`): the same on every worker of the generation
except its timings. The story of a step: docs/training.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..resilience.fingerprint import Corrupt


@dataclass(frozen=True)
class StepResult:
    step: int
    """0-based optimizer step that was applied."""
    loss: float
    """Mean token loss over the global batch."""
    seconds: float
    """Wall time of the step on this worker."""
    grad_norm: float
    """Global gradient norm before clipping."""
    next_generation: int = 0
    """Newest plan generation any worker had seen at this step's end."""
    peak_rss_bytes: int = 0
    """The largest peak resident memory of any worker of the generation (engine/telemetry/memory.py)."""
    peak_device_bytes: Optional[int] = None
    """The largest peak device memory of any worker (CUDA only)."""
    rejected: str = ""
    """Why the step guard did not apply the step (engine/resilience/guard.py); empty when it was applied."""
    rejections: int = 0
    """How many times any worker had seen this step rejected before this run of it."""
    stop: bool = False
    """Some worker had seen a request to stop the job: every worker stops at this boundary."""
    repaired: tuple[Corrupt, ...] = ()
    """Layer copies found corrupt after this step and replaced from their holders' majority
    (engine/resilience/fingerprint.py); the same on every worker."""
    unrepairable: str = ""
    """Why the job must stop: a layer's copies differ with no majority (engine/resilience/fingerprint.py)."""
    compute_s: tuple[float, ...] = ()
    """Every worker's compute seconds in this step, by rank (engine/resilience/straggler.py)."""
    shadow_s: float = 0.0
    """Seconds this worker spent in the step on the shadow copies' exchange: gathering and posting
    the gradients for the keepers, and waiting for the exchange before the commit
    (engine/step/shadows.py; 0 without shadows). The goodput ledger charges it to `shadows`."""
    entry_window: tuple[Optional[float], Optional[float]] = (None, None)
    """Unix times the first worker of the generation began entering it and the last one had
    entered it (engine/telemetry/board.py); None: not known."""
