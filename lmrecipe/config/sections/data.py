"""The ``data`` section: the prepared token folders, their mixture and stages, and the training window.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lmrecipe.config.sections.common import FIXED_ON_RESUME, fixed, positive
from lmrecipe.errors import fail

_SOURCE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass
class DataSource:
    """One prepared folder of a weighted mixture (``data.sources``)."""

    path: str
    """Folder written by ``tools/prepare_data.py``."""
    weight: float = 1.0
    """Share of training samples drawn from this folder, relative to the other sources' weights (0 = evaluated only)."""
    name: Optional[str] = None
    """Name in metrics (``val_loss/<name>``, ``tokens_seen/<name>``); null means the folder's name."""

    def resolved_name(self) -> str:
        return self.name if self.name is not None else Path(self.path).name


@dataclass
class DataStage:
    """One stage of a staged mixture (``data.stages``): from optimizer step ``start_step`` on, these weights."""

    start_step: int
    """Optimizer step (0-based) the stage starts at; the first stage starts at 0, the others at increasing steps."""
    weights: dict = field(default_factory=dict)
    """Weight of each source by name (``data.sources[].name``), relative to the others; a source left out has weight
    0 in this stage (it leaves, or has not entered yet), e.g. ``{web: 0.3, code: 0.7}``."""


@dataclass
class DataConfig:
    path: Optional[str] = "data/stdlib"
    """Folder written by ``tools/prepare_data.py`` (train.bin, val.bin, meta.json, tokenizer); null with ``sources``."""
    sources: list[DataSource] = field(default_factory=list)
    """A weighted mixture of prepared folders, e.g. ``[{path: data/code, weight: 0.7}, {path: data/prose, weight: 0.3}]``,
    used instead of ``path``. All must share one tokenizer. Setting one of ``path`` / ``sources`` in a recipe or on the
    command line clears the other one from lower layers; setting both in the same layer is an error."""
    stages: list[DataStage] = field(default_factory=list, metadata=FIXED_ON_RESUME)
    """A staged mixture: ``[{start_step: 0, weights: {web: 1.0}}, {start_step: 9000, weights: {web: 0.5, code: 0.5}}]``
    over the sources of ``sources`` (by name). Each stage's weights replace the sources' ``weight`` for training from
    its ``start_step``; ``sources[].weight`` then only weighs the validation mean. Empty = the sources' weights
    throughout. Fixed on resume."""
    seq_len: int = fixed(256)
    """Tokens per training sequence (each window reads ``seq_len + 1`` tokens)."""
    val_windows: int = 64
    """Validation sequences evaluated each time (a fixed set, spread over val.bin), per source for a mixture."""
    cache_dir: str = "~/.cache/lmrecipe/data"
    """Local folder that data folders given as object-storage URLs (``data.path`` or ``data.sources[].path`` =
    ``s3://...``, ``gs://...``) are downloaded into before the first step (one process per node, verified against
    the sha256 in meta.json), reused by later runs and memory-mapped from there."""
    document_masking: bool = fixed(True)
    """Train packed documents as documents: each token attends only to earlier tokens of its own document and position
    ids restart at each document start (boundaries from the folder's ``train.idx`` / ``val.idx``). Needs a model whose
    attention can mask (``docs/training.md``); false attends across the whole window. Fixed on resume."""

    def validate(self) -> None:
        positive(self, "seq_len", "val_windows")
        names: dict[str, int] = {}
        for i, source in enumerate(self.sources):
            where = f"data.sources[{i}]"
            if not source.path:
                raise fail(f"{where}.path is empty: name a folder written by tools/prepare_data.py.")
            if not math.isfinite(source.weight) or source.weight < 0:
                raise fail(f"{where}.weight={source.weight} ({source.path}) must be a finite number >= 0 (weights are "
                           "relative shares of the training samples; 0 evaluates a source without training on it).")
            name = source.resolved_name()
            if not _SOURCE_NAME.match(name):
                raise fail(f"{where} has the name {name!r}, which cannot label metrics: set {where}.name to letters, "
                           "digits, '_', '-' or '.' (e.g. name: code).")
            if name in names:
                raise fail(f"data.sources[{names[name]}] and {where} are both named {name!r} (names default to the "
                           f"folder's name): give each source a distinct name, e.g. {{path: {source.path}, name: "
                           f"{name}_2}}.")
            names[name] = i
        if self.sources and sum(s.weight for s in self.sources) <= 0:
            raise fail(f"The weights of data.sources sum to zero ({', '.join(str(s.weight) for s in self.sources)}): "
                       "give at least one source a positive weight.")
        self._validate_stages(names)

    def _validate_stages(self, names: dict[str, int]) -> None:
        """The stages' steps start at 0 and increase; their weights name sources and are not all 0."""
        if not self.stages:
            return
        if not self.sources:
            raise fail("data.stages needs a mixture: list the folders in data.sources (each with a name) and give "
                       "each stage weights by those names.")
        if self.stages[0].start_step != 0:
            raise fail(f"data.stages[0].start_step={self.stages[0].start_step}: the first stage must start at step 0 "
                       "(set it to 0, or add a first stage {start_step: 0, weights: {...}}).")
        for i, (before, stage) in enumerate(zip(self.stages, self.stages[1:]), start=1):
            if stage.start_step <= before.start_step:
                raise fail(f"data.stages[{i}].start_step={stage.start_step} is not after data.stages[{i - 1}]."
                           f"start_step={before.start_step}: list the stages in increasing start_step order, each "
                           "step once.")
        for i, stage in enumerate(self.stages):
            where = f"data.stages[{i}].weights"
            for name, weight in stage.weights.items():
                if str(name) not in names:
                    close = difflib.get_close_matches(str(name), list(names), n=1)
                    raise fail(f"{where} names the source {name!r}, which is not in data.sources"
                               f"{f' (did you mean {close[0]!r}?)' if close else ''}: the sources are "
                               f"{', '.join(names)}. Name a source of data.sources, or add the folder there.")
                if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                        or weight < 0:
                    raise fail(f"{where}.{name}={weight!r} must be a finite number >= 0 (0: the source takes no "
                               "training samples in this stage).")
            if sum(stage.weights.values()) <= 0:
                raise fail(f"{where} are all 0 (or empty): stage {i} (from step {stage.start_step}) would draw no "
                           "samples. Give at least one source a positive weight.")

    def stage_weights(self) -> list[tuple[int, list[float]]]:
        """(start step, weight of each source in ``sources`` order) of each stage; without stages, one stage of the
        sources' own weights."""
        if not self.stages:
            return [(0, [s.weight for s in self.source_list()])]
        return [(stage.start_step, [float(stage.weights.get(s.resolved_name(), 0.0)) for s in self.sources])
                for stage in self.stages]

    def source_list(self) -> list[DataSource]:
        """The training data as sources: ``sources``, or ``path`` as one source of weight 1."""
        return list(self.sources) if self.sources else [DataSource(path=self.path)]

    def is_mixture(self) -> bool:
        return bool(self.sources)
