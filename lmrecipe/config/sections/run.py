"""The whole configuration of a run (:class:`Config`, a field per section) and the views of it: the
:class:`Workload` one rank computes, the flat dotted keys, the keys fixed on resume.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from lmrecipe.config.sections.checkpoint import CheckpointConfig
from lmrecipe.config.sections.common import fail_all
from lmrecipe.config.sections.data import DataConfig
from lmrecipe.config.sections.distributed import DistributedConfig
from lmrecipe.config.sections.evaluation import EvalConfig
from lmrecipe.config.sections.model import ModelConfig
from lmrecipe.config.sections.observe import LoggingConfig, ProfileConfig
from lmrecipe.config.sections.optim import OptimConfig, ScheduleConfig
from lmrecipe.config.sections.train import Compile, SpikeConfig, TrainConfig
from lmrecipe.errors import UserError


@dataclass(frozen=True)
class Workload:
    """What each rank computes and holds, as a view of the sections that fix it: the model, the windows, the batch,
    the optimizer and the parallel splits. Memory estimates and throughput predictions take this, not a Config."""

    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    optim: OptimConfig
    distributed: DistributedConfig


@dataclass
class Config:
    out_dir: str = "runs/default"
    """Run folder: resolved config, metrics, checkpoints, export and plots."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The architecture and its initialisation, or the checkpoint to continue from."""
    data: DataConfig = field(default_factory=DataConfig)
    """The prepared token folders and the training window (tokens)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer and its hyperparameters."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The learning-rate schedule (optimizer steps)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Length (optimizer steps), batch sizes (sequences), precision and the loop's features."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Multiple-choice tasks scored during training."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When checkpoints are saved and kept, resuming, and the end-of-run export."""
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    """Loss-spike detection and rollback."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics, experiment trackers and cost figures."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """DeepSpeed, timeouts and the sequence / tensor parallel splits (ranks)."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Optimizer steps run under ``torch.profiler``."""

    def validate(self) -> None:
        """Every section's own checks; UserError listing all that fail (the cross-field rules: ``rules.py``)."""
        problems = []
        if not self.out_dir:
            problems.append("out_dir must be a non-empty folder path.")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                try:
                    value.validate()
                except UserError as err:
                    problems.append(str(err))
        if problems:
            raise fail_all(problems)

    def to_dict(self) -> dict:
        """Plain values only (a :class:`Compile` as its string), as YAML and JSON write them."""
        return dataclasses.asdict(self, dict_factory=lambda items: {k: str(v) if isinstance(v, Compile) else v
                                                                     for k, v in items})

    def workload(self) -> Workload:
        return Workload(self.model, self.data, self.train, self.optim, self.distributed)


def flatten_config(data: dict, prefix: str = "") -> dict[str, Any]:
    """A ``Config.to_dict()`` as ``{"section.key": value}`` (``model.extra`` stays one value)."""
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "extra":
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def fixed_on_resume_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Dotted keys whose value a resume may not change (fields declared with ``fixed``)."""
    keys = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            keys += fixed_on_resume_keys(hint, f"{prefix}{f.name}.")
        elif f.metadata.get("fixed_on_resume"):
            keys.append(prefix + f.name)
    return keys
