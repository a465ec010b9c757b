"""Job configuration: one structured omegaconf schema, loaded from YAML plus CLI dotlist overrides.

One module per section (or group of sections), `schema` for what they share, `loading` for the
merge and validation, `reference` for the generated reference page. The fields: docs/config.md.
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
