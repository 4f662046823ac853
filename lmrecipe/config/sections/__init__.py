"""The sections of a run's configuration: one dataclass each, every field documented with its units.

Each section's ``validate`` checks its fields one at a time (ranges, names); a refusal that depends on two or more
fields lives in ``rules.py``. Derived values (accumulation steps, ...) are methods, never mutated fields.

A module per concern: ``model``, ``data``, ``optim`` (with ``schedule``), ``train`` (with ``spike``), ``evaluation``
(``eval``), ``checkpoint``, ``observe`` (``logging``, ``profile``), ``distributed``; ``run`` holds :class:`Config`,
which gathers them, and ``common`` what they share.
"""

from lmrecipe.config.sections.checkpoint import CheckpointConfig, parse_shard_size
from lmrecipe.config.sections.common import due_at, fail_all
from lmrecipe.config.sections.data import DataConfig, DataSource, DataStage
from lmrecipe.config.sections.distributed import (
    DS_CONFIG_DIR,
    REPO_ROOT,
    DistributedConfig,
    autoep_size_of,
    resolve_deepspeed_config,
    resolved_expert_layer,
)
from lmrecipe.config.sections.evaluation import EvalConfig
from lmrecipe.config.sections.model import MOE_ARCHS, SHARED_EXPERT_ARCHS, ModelConfig
from lmrecipe.config.sections.observe import LoggingConfig, ProfileConfig, TrackerName
from lmrecipe.config.sections.optim import OptimConfig, ScheduleConfig
from lmrecipe.config.sections.run import Config, Workload, fixed_on_resume_keys, flatten_config
from lmrecipe.config.sections.train import (
    AUTO_LOSS_CHUNK_MIN_VOCAB,
    AUTO_LOSS_CHUNK_TOKENS,
    COMPILE_FROM_BOOL,
    BatchSize,
    Compile,
    CompileMode,
    Precision,
    SpikeConfig,
    TrainConfig,
)

__all__ = [
    "AUTO_LOSS_CHUNK_MIN_VOCAB", "AUTO_LOSS_CHUNK_TOKENS", "COMPILE_FROM_BOOL", "DS_CONFIG_DIR", "MOE_ARCHS",
    "REPO_ROOT", "SHARED_EXPERT_ARCHS", "BatchSize", "CheckpointConfig", "Compile", "CompileMode", "Config",
    "DataConfig", "DataSource", "DataStage", "DistributedConfig", "EvalConfig", "LoggingConfig", "ModelConfig",
    "OptimConfig", "Precision", "ProfileConfig", "ScheduleConfig", "SpikeConfig", "TrackerName", "TrainConfig",
    "Workload", "autoep_size_of", "due_at", "fail_all", "fixed_on_resume_keys", "flatten_config", "parse_shard_size",
    "resolve_deepspeed_config", "resolved_expert_layer",
]
