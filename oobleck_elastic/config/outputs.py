"""The `checkpoint` and `logging` sections of the job config: what the job writes, and where.

Checkpoints (directory, interval, resume) and logs (TensorBoard, progress lines, the logging
level, JSON event lines). The fields: docs/config.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .schema import Section, at_least

# The choices of this section's choice fields (schema.py: omegaconf refuses any other value).
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


@dataclass
class CheckpointConfig(Section):
    dir: str = ""
    """Directory of safetensors checkpoints; empty: `checkpoints/<job>`, a directory of the job's
    own, where `<job>` is `name` when the config sets it, else the config file's name without its
    extension (configs/gpt2-tiny.yaml: `checkpoints/gpt2-tiny`). A relative path: see Paths."""
    interval_steps: int = 0
    """Save every this many steps; 0 = only at the end."""
    resume: bool = True
    """Resume from the newest checkpoint in `dir` when one exists."""

    def validate(self) -> list[str]:
        return at_least("checkpoint", self, ("interval_steps",), 0)


@dataclass
class LoggingConfig(Section):
    tensorboard_dir: str = "runs"
    """TensorBoard log directory: one run per start of a job, `<run id>/<UTC start>` (the run id is
    the job's --rdzv-id, `name` for the single process), written by the worker holding rank 0
    (engine/telemetry/board.py). A relative path: see Paths."""
    log_interval: int = 1
    """Print a progress line every this many steps, at the last step and at the first step of every
    generation (the one that pays for a reconfiguration)."""
    level: LogLevel = "INFO"
    """Python logging level."""
    events_dir: str = ""
    """Also write the job's events (steps, failures, generation entries, checkpoints...) as JSON
    lines, one file per worker process, in this directory (oobleck_elastic/logs.py), with the
    sample ledger that `oobleck samples --check` proves exactly-once from; empty: off. A relative
    path: see Paths."""
