from kiln.config.dump import to_toml, write_config
from kiln.config.load import config_from_dict, load_config, read_toml
from kiln.config.sections import (
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    JobConfig,
    MetricsConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    OptimizerConfig,
    ResilienceConfig,
    SchedulerConfig,
    TrainConfig,
)
from kiln.config.validate import resolve_layout, validate

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "DistributedConfig",
    "JobConfig",
    "MLAConfig",
    "MTPConfig",
    "MetricsConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ResilienceConfig",
    "SchedulerConfig",
    "TrainConfig",
    "config_from_dict",
    "load_config",
    "read_toml",
    "resolve_layout",
    "to_toml",
    "validate",
    "write_config",
]
