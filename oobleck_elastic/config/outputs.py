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
    keep_last: int = 3
    """Keep this many newest intact checkpoints: after each save, rank 0 removes the older step
    directories (docs/training.md, "Retention and disk space"); 0 keeps all. 1 is refused: a
    restore that a newer generation began from the previous checkpoint could lose its files."""

    def validate(self) -> list[str]:
        problems = at_least("checkpoint", self, ("interval_steps", "keep_last"), 0)
        if self.keep_last == 1:
            problems.append(
                "'checkpoint.keep_last' must be 0 (keep all) or >= 2 (got 1): a restore begun from the "
                "previous checkpoint while the newest was completed could find its files removed"
            )
        return problems


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
