"""Experiment configuration: strict, typed, loaded from YAML with command-line overrides.

Every section forbids unknown keys, so a typo is an error that names its path
(`model.n_layer: extra inputs are not permitted`) instead of a silently ignored setting.
"""
from mode.config.config import Config
from mode.config.loading import (
    apply_overrides,
    config_from_dict,
    config_text,
    field_differences,
    flat_fields,
    load_config,
    load_yaml,
    override_field,
    parse_override,
    read_yaml_file,
    save_config,
)
from mode.config.routing import (
    NOOP_KINDS,
    CapacitySchedule,
    MoEConfig,
    MoRConfig,
    NoopKind,
    RoutingConfig,
)
from mode.config.sections import (
    BLOCK_KINDS,
    DEFAULT_BLOCK_PATTERN,
    DEPTH_ROUTED_KINDS,
    EXPERT_KINDS,
    SEED_LIMIT,
    BlockKind,
    ConfigError,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RopeScaling,
    Section,
    TrainConfig,
    seed_problem,
)

__all__ = [
    "BLOCK_KINDS", "DEFAULT_BLOCK_PATTERN", "DEPTH_ROUTED_KINDS", "EXPERT_KINDS", "NOOP_KINDS", "SEED_LIMIT",
    "BlockKind", "CapacitySchedule", "Config", "ConfigError", "DataConfig", "MoEConfig", "MoRConfig", "ModelConfig",
    "NoopKind", "ParallelConfig", "RopeScaling", "RoutingConfig", "Section", "TrainConfig", "apply_overrides",
    "config_from_dict", "config_text", "field_differences", "flat_fields", "load_config", "load_yaml",
    "override_field", "parse_override", "read_yaml_file", "save_config", "seed_problem",
]
