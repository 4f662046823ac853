"""What every section's module uses: the fixed-on-resume field marker, the range checks of ``validate``, one
error for many problems, and the every-N-steps rule.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any

from lmrecipe.errors import UserError, fail

FIXED_ON_RESUME = {"fixed_on_resume": True}
"""Field metadata: a resume may not change this value (the saved weights, shards or data position depend on it)."""


def fixed(default: Any = dataclasses.MISSING, **kwargs) -> Any:
    """A field a resume may not change (:data:`FIXED_ON_RESUME`)."""
    return field(default=default, metadata=FIXED_ON_RESUME, **kwargs)


def due_at(step: int, every_steps: int, last_step: int) -> bool:
    """Whether an every-``every_steps`` action (0 = never) is due after optimizer step ``step`` (1-based); the last
    step ``last_step`` always is."""
    return step == last_step or (every_steps > 0 and step % every_steps == 0)


def fail_all(problems: list[str], heading: str = "problems in the configuration") -> UserError:
    """One UserError for every problem found: the message itself when there is one, else a numbered heading and a
    line per problem (each keeps its own key, choices and fix)."""
    if len(problems) == 1:
        return fail(problems[0])
    lines = "\n".join(f"- {problem}" for problem in problems)
    return UserError(f"{len(problems)} {heading}:\n{lines}")


def positive(section: Any, *keys: str) -> None:
    for key in keys:
        value = getattr(section, key)
        if value <= 0:
            raise fail(f"{section_name(section)}.{key}={value} must be positive.")


def non_negative(section: Any, *keys: str) -> None:
    for key in keys:
        value = getattr(section, key)
        if not math.isfinite(value) or value < 0:  # nan passes every comparison; inf overflows what it scales
            raise fail(f"{section_name(section)}.{key}={value} must be a finite number, zero or positive.")


def section_name(section: Any) -> str:
    """The key of a section's dataclass in the configuration: ``TrainConfig`` is ``train``."""
    return type(section).__name__.removesuffix("Config").lower()
