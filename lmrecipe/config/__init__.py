"""The one typed configuration of a run: ``sections/`` declares it (a dataclass per section, every field
documented with its units), ``rules.py`` holds every refused combination of settings as a table, ``loader.py``
reads recipes (with ``base:`` inheritance) and ``key=value`` overrides into it, ``reference.py`` lists every key
for ``docs/reference/keys.md`` and ``train.py --list-keys``; ``notes.py`` names settings that a run as configured
never reaches (a warning at start-up, a note in ``train.py --dry-run``).

Precedence: dataclass defaults < recipe YAML < ``key=value`` overrides. Unknown keys, wrong types, out-of-range
values and refused combinations raise :class:`~lmrecipe.errors.UserError` naming each key and what is allowed.
"""

from lmrecipe.config.loader import BASE_KEY, RENAMED, config_from_dict, config_yaml, load_config, save_config
from lmrecipe.config.rules import RULES, Rule, check_rules
from lmrecipe.config.sections import (
    AUTO_LOSS_CHUNK_MIN_VOCAB,
    AUTO_LOSS_CHUNK_TOKENS,
    DS_CONFIG_DIR,
    REPO_ROOT,
    BatchSize,
    CheckpointConfig,
    Config,
    DataConfig,
    DataSource,
    DataStage,
    DistributedConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    Precision,
    ProfileConfig,
    ScheduleConfig,
    SpikeConfig,
    TrackerName,
    TrainConfig,
    Workload,
    autoep_size_of,
    resolved_expert_layer,
    due_at,
    fixed_on_resume_keys,
    flatten_config,
    parse_shard_size,
    resolve_deepspeed_config,
)

__all__ = [
    "AUTO_LOSS_CHUNK_MIN_VOCAB", "AUTO_LOSS_CHUNK_TOKENS", "BASE_KEY", "DS_CONFIG_DIR", "RENAMED", "REPO_ROOT", "RULES",
    "BatchSize", "CheckpointConfig", "Config", "DataConfig", "DataSource", "DataStage", "DistributedConfig", "EvalConfig", "LoggingConfig",
    "ModelConfig", "OptimConfig", "Precision", "ProfileConfig", "Rule", "ScheduleConfig", "SpikeConfig", "TrackerName",
    "TrainConfig", "Workload", "autoep_size_of", "resolved_expert_layer", "check_rules", "config_from_dict", "config_yaml", "due_at", "fixed_on_resume_keys",
    "flatten_config", "load_config", "parse_shard_size", "resolve_deepspeed_config", "save_config",
]
