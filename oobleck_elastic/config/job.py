"""The whole job config: `JobConfig`, one field per section, and the rules that span sections.

Its sections' order here is the order of the configuration reference (docs/config.md).
`JobConfig.validate()` gathers every section's clauses, then adds the rules between sections. Users
import it from the package: `from oobleck_elastic.config import JobConfig`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from .fault_tolerance import FaultToleranceConfig
from .model_data import DataConfig, ModelConfig
from .outputs import CheckpointConfig, LoggingConfig
from .planning import PlanningConfig
from .schema import Section
from .training import TrainingConfig


def folder_name(name: str) -> str:
    """A job's `name` as one safe folder or run-id name: every run of other characters becomes one
    `-`, none at either end ('' when nothing is left)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")


def default_checkpoint_dir(job: str) -> str:
    """`checkpoints/<job>` (relative to the working directory): the checkpoint directory of the job
    named `job` when `checkpoint.dir` is empty, `job` made one safe folder name (`folder_name`)."""
    return os.path.join("checkpoints", folder_name(job) or "job")


@dataclass
class JobConfig(Section):
    name: str = "oobleck"
    """Job name used in logs, the TensorBoard run id of the single process, and the name of the
    default checkpoint directory (`checkpoint.dir`)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training data."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Batch sizes, steps, optimizer, precision, seed."""
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    """Failures to tolerate and detection timeouts."""
    planning: PlanningConfig = field(default_factory=PlanningConfig)
    """Device memory, devices per node, schedule, profile."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Logs and TensorBoard."""

    def __post_init__(self) -> None:
        if not self.checkpoint.dir:  # load_config names a config file's job after the file
            self.checkpoint.dir = default_checkpoint_dir(self.name)

    def validate(self) -> list[str]:
        """Every section's problems, then the rules that span sections."""
        sections: list[Section] = [
            self.model,
            self.data,
            self.training,
            self.fault_tolerance,
            self.planning,
            self.checkpoint,
            self.logging,
        ]
        problems = [problem for section in sections for problem in section.validate()]
        if self.data.seq_len > self.model.max_seq_len:
            problems.append(
                f"'data.seq_len' ({self.data.seq_len}) exceeds 'model.max_seq_len' "
                f"({self.model.max_seq_len}): lower data.seq_len or raise model.max_seq_len"
            )
        return problems
