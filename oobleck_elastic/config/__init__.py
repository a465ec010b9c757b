"""Job configuration: one structured omegaconf schema, loaded from YAML plus CLI dotlist overrides.

    schema.py     the sections (dataclasses; a docstring under every field) and, beside each
                  section's fields, its `validate()`: the rules their types cannot express
    loading.py    `load_config(path, overrides)`: the YAML file and `key=value` overrides merged
                  onto the schema, every problem turned into one `ConfigError`; to/from dict
    reference.py  the configuration reference, rendered as Markdown from the field docstrings
                  (`oobleck config reference`; docs/config.md is its output, checked in)
    timing.py     the fault-tolerance clocks left to `None` (auto), derived from the measured
                  step times: the hang bound, the communication timeout, the stall report

Imports go one way: loading, reference and timing import schema, which imports nothing of this
package.
"""

from .loading import from_dict, load_config, to_dict, to_yaml
from .schema import (
    AttnImplementation,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DataSource,
    DeviceKind,
    FaultToleranceConfig,
    JobConfig,
    LoggingConfig,
    LogLevel,
    LRDecay,
    LRScheduleConfig,
    ModelConfig,
    ModelFamily,
    OptimizerConfig,
    OptimizerName,
    PlanningConfig,
    Precision,
    Schedule,
    Section,
    TokenDtype,
    TokenizerKind,
    TrainingConfig,
    parse_signals,
)

__all__ = [
    "AttnImplementation",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DataSource",
    "DeviceKind",
    "FaultToleranceConfig",
    "JobConfig",
    "LRDecay",
    "LRScheduleConfig",
    "LogLevel",
    "LoggingConfig",
    "ModelConfig",
    "ModelFamily",
    "OptimizerConfig",
    "OptimizerName",
    "PlanningConfig",
    "Precision",
    "Schedule",
    "Section",
    "TokenDtype",
    "TokenizerKind",
    "TrainingConfig",
    "from_dict",
    "load_config",
    "parse_signals",
    "to_dict",
    "to_yaml",
]
