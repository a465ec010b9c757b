"""Job configuration: one structured omegaconf schema, loaded from YAML plus CLI dotlist overrides.

    schema.py     what every section shares: `Section` (its `validate()`: the rules the field
                  types cannot express), `ConfigError`, the keys that hold paths
    model_data.py, training.py, fault_tolerance.py, planning.py, outputs.py
                  the sections (dataclasses; a docstring under every field), one module per
                  group, each section's `validate()` beside its fields
    job.py        `JobConfig`: the sections in order, and the rules that span them
    loading.py    `load_config(path, overrides)`: the YAML file and `key=value` overrides merged
                  onto the schema, every problem turned into one `ConfigError`; to/from dict
    reference.py  the configuration reference, rendered as Markdown from the field docstrings
                  (`oobleck config reference`; docs/config.md is its output, checked in)
    timing.py     the fault-tolerance clocks left to `None` (auto), derived from the measured
                  step times: the hang bound, the communication timeout, the stall report

Imports go one way: schema imports nothing of this package; the section modules import schema;
job imports the sections; loading, reference and timing import job or a section.
"""

from .loading import from_dict, load_config, to_dict, to_yaml
from .fault_tolerance import FaultToleranceConfig, parse_signals
from .job import JobConfig
from .model_data import AttnImplementation, DataConfig, DataSource, ModelConfig, ModelFamily, TokenDtype, TokenizerKind
from .outputs import CheckpointConfig, LoggingConfig, LogLevel
from .planning import PlanningConfig, Schedule
from .schema import ConfigError, Section
from .training import DeviceKind, LRDecay, LRScheduleConfig, OptimizerConfig, OptimizerName, Precision, TrainingConfig

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
