"""The run configuration: one TOML file, dotted overrides, strict checks that name the key.

    load.py      loading, merging overrides, `millstream config` output
    checks.py    checks across sections (addresses, budgets, the batch and the buffer, NaN)
    schema.py    the config tree and the run-wide sections (run, model, train); re-exports them all
    rollout.py   the sections about how episodes are generated (actor, envpool)
    learning.py  the section about how the learner trains (learner)
    ops.py       the sections about how processes talk and are placed (transport, launcher)
    scoring.py   the sections about how a run is scored and watched (eval, judge, metrics)
    meta.py      how a field carries its documentation and constraints; ConfigError
    limits.py    what the config implies: the largest frame a socket must accept
    trainable.py what sampling the learner can train on (the launcher and the learner check it)

Everything a role needs is re-exported here: `from millstream.shared.config import Config`.
"""

from millstream.shared.config.load import (
    DEFAULT_CONFIG,
    ActorConfig,
    ChaosConfig,
    Config,
    ConfigError,
    EnvPoolConfig,
    EvalConfig,
    LauncherConfig,
    LearnerConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
    TransportConfig,
    check_config,
    config_keys,
    describe_config,
    dump_config,
    load_config,
    parse_overrides,
    toml_value,
)

__all__ = [
    "Config",
    "RunConfig",
    "ModelConfig",
    "TrainConfig",
    "ActorConfig",
    "EnvPoolConfig",
    "LearnerConfig",
    "TransportConfig",
    "ChaosConfig",
    "LauncherConfig",
    "EvalConfig",
    "ConfigError",
    "load_config",
    "check_config",
    "parse_overrides",
    "dump_config",
    "toml_value",
    "describe_config",
    "config_keys",
    "DEFAULT_CONFIG",
]
