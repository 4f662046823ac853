"""The ``optim`` and ``schedule`` sections: the optimizer, its hyperparameters and the learning-rate schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from lmrecipe.config.sections.common import non_negative, positive
from lmrecipe.errors import fail


@dataclass
class OptimConfig:
    name: Literal["adamw", "muon"] = "adamw"
    """adamw; or muon: DeepSpeed's Muon (momentum orthogonalised by Newton-Schulz) for the hidden 2-D matrices, AdamW
    (``lr``, betas, eps) for embeddings, norms, biases and the output layer. A resume keeps the checkpoint's (its
    state differs; checked when the checkpoint is loaded, so that checkpoints from before this key load as AdamW)."""
    muon_lr: float = 0.02
    """Muon's peak learning rate (``name=muon``); the schedule moves it in proportion to ``lr``."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""
    lr: float = 3e-4
    """Peak learning rate (after warmup)."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.1
    """Decoupled AdamW weight decay, applied to matrices only."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    decay_embeddings: bool = False
    """Also apply weight decay to the embedding matrices."""

    def validate(self) -> None:
        for key in ("lr", "eps", "min_lr", "weight_decay", "grad_clip", "beta1", "beta2", "muon_lr", "muon_momentum"):
            if not math.isfinite(getattr(self, key)):  # nan passes every comparison below; inf trains NaN weights
                raise fail(f"optim.{key}={getattr(self, key)} must be a finite number.")
        positive(self, "lr", "eps", "muon_lr")
        non_negative(self, "min_lr", "weight_decay", "grad_clip")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise fail(f"optim.muon_momentum={self.muon_momentum} must be in [0, 1) (0.95 is Muon's usual value).")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise fail(f"optim.{key}={getattr(self, key)} must be in [0, 1).")


@dataclass
class ScheduleConfig:
    warmup_steps: int = 100
    """Optimizer steps of linear warmup: step s < warmup_steps trains at ``optim.lr x (s+1) / warmup_steps``."""
    decay: Literal["cosine", "linear", "1-sqrt", "constant"] = "cosine"
    """Shape of the decay from ``optim.lr`` to ``optim.min_lr``, reached at the last step (``train.max_steps - 1``).
    1-sqrt: ``1 - sqrt(progress)``. constant: no decay; with ``decay_steps`` / ``decay_fraction``, a drop to
    ``min_lr`` for the decay's steps."""
    decay_steps: Optional[int] = None
    """Warmup-stable-decay: hold ``optim.lr`` after warmup and decay only over the last this many optimizer steps
    (steps ``max_steps - decay_steps`` .. ``max_steps - 1``; the first of them already below ``lr``); null = decay
    over the whole run after warmup. A resume may raise ``train.max_steps`` while the run is in its stable phase:
    the decay moves with it."""
    decay_fraction: Optional[float] = None
    """Warmup-stable-decay with the decay as a fraction of ``train.max_steps`` (rounded to whole steps, at least 1),
    in (0, 1]; instead of ``decay_steps``."""

    def validate(self) -> None:
        non_negative(self, "warmup_steps")
        if self.decay_steps is not None:
            positive(self, "decay_steps")
        if self.decay_fraction is not None and not 0.0 < self.decay_fraction <= 1.0:
            raise fail(f"schedule.decay_fraction={self.decay_fraction} must be in (0, 1] (e.g. 0.2: the last 20 % "
                       "of train.max_steps).")

    def is_wsd(self) -> bool:
        """Warmup-stable-decay: the decay covers only the last steps (``decay_steps`` or ``decay_fraction``)."""
        return self.decay_steps is not None or self.decay_fraction is not None

    def decay_length(self, max_steps: int) -> int | None:
        """Optimizer steps of a warmup-stable-decay run's decay for a run of ``max_steps``; None without one."""
        if self.decay_steps is not None:
            return self.decay_steps
        if self.decay_fraction is not None:
            return max(1, round(self.decay_fraction * max_steps))
        return None

    def decay_start(self, max_steps: int) -> int | None:
        """The first optimizer step (0-based) of a warmup-stable-decay run's decay; None without one."""
        length = self.decay_length(max_steps)
        return None if length is None else max_steps - length
