"""The ``distributed`` section: DeepSpeed, timeouts, the hang watchdog and the sequence / tensor / expert parallel
splits (ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from lmrecipe.config.sections.common import fixed, positive
from lmrecipe.errors import fail

REPO_ROOT = Path(__file__).resolve().parents[3]
DS_CONFIG_DIR = REPO_ROOT / "ds_configs"


@dataclass
class DistributedConfig:
    deepspeed_config: Optional[str] = None
    """JSON in ds_configs/ choosing the ZeRO stage and offload; null trains without DeepSpeed (DDP)."""
    timeout_s: int = 1800
    """Collective-operation timeout (seconds) before a hung rank fails the job."""
    sequence_parallel_size: int = 1
    """Ulysses sequence parallelism (DeepSpeed ALST through Accelerate): each window is split over this many
    consecutive ranks, which attend over the whole window through all-to-alls; the data-parallel ranks are
    ``world_size / sequence_parallel_size``. 1 = off. Needs DeepSpeed; must divide the process count, the attention
    heads and ``data.seq_len``."""
    tensor_parallel_size: int = 1
    """DeepSpeed AutoTP tensor parallelism: the attention and MLP matrices of each layer are split over this many
    consecutive ranks, which read the same samples; the data-parallel ranks are ``world_size /
    tensor_parallel_size``. 1 = off. Needs DeepSpeed ZeRO 0-2 (ZeRO-3 is refused); must divide the process count,
    the attention and key/value heads and ``model.intermediate_size``."""

    expert_parallel_size: int = 1
    """Expert parallelism (DeepSpeed AutoEP, ``docs/moe.md``): the experts of each MoE layer are split over this many
    consecutive ranks, which exchange tokens through all-to-alls; every rank still reads its own samples (the
    data-parallel ranks stay ``world_size``). 1 = each rank holds every expert. Needs DeepSpeed and
    ``model.num_experts`` > 0; must divide the process count and ``model.num_experts``."""
    expert_layer: Literal["auto", "autoep", "hf"] = fixed("auto")
    """Which MoE layer trains: ``hf`` = the model class's own block (under ZeRO-3 made a leaf module, so its
    experts are gathered together); ``autoep`` = DeepSpeed AutoEP's layer (needs DeepSpeed; also at
    ``expert_parallel_size=1``); ``auto`` = ``autoep`` when ``expert_parallel_size`` > 1, else ``hf``."""
    hang_watchdog: bool = True
    """A watchdog thread on every rank of a multi-process run (``docs/hangs.md``): when a rank makes no progress for
    longer than its phase's budget (the ``hang_*_s`` keys, each below ``timeout_s``), the live ranks write
    ``hang.md`` naming the stuck rank, dump their stacks and end the run with exit code 3. false = only ``timeout_s``
    bounds a wait."""
    hang_step_s: str = "auto"
    """Budget (seconds) of each phase of a training step (data and forward/backward, optimizer, the step's end): a
    number, or auto = max(10 x the median step time after the session's first 2 steps, ``hang_step_floor_s``), at
    most 0.9 x ``timeout_s``."""
    hang_step_floor_s: float = 120.0
    """The least budget (seconds) ``hang_step_s=auto`` gives."""
    hang_first_step_s: float = 900.0
    """Budget (seconds) of the start (the resume) and of the session's first step; with ``hang_step_s=auto``, of
    every step until one after the first 2 was measured."""
    hang_checkpoint_s: float = 900.0
    """Budget (seconds) of a checkpoint's save, and of the end of the run (the last write's wait, the export)."""
    hang_eval_s: float = 900.0
    """Budget (seconds) of an evaluation (validation loss, tasks, samples)."""

    # Stragglers (docs/hangs.md, "Stragglers"; lmrecipe/observe/stragglers.py)
    stragglers: bool = True
    """Time each micro-batch's forward on every rank (CUDA events on a GPU, the host's clock on a CPU), read at logged
    steps only and compared across ranks in the logged step's reduction: ``compute_s_median``, ``compute_s_max``,
    ``compute_slowest_rank`` and ``stragglers`` in every ``metrics.jsonl`` row. false = not timed."""
    straggler_margin: float = 0.2
    """A rank is named when its forward seconds per step exceed the median rank's by more than this fraction (0.2 =
    20 %) at ``straggler_logged_steps`` logged steps in a row."""
    straggler_logged_steps: int = 3
    """Logged steps in a row a rank must stay slower than the median by ``straggler_margin`` to be named with its host
    (in the log, the row's ``stragglers``, the doctor's findings and ``report.md``)."""

    def validate(self) -> None:
        positive(self, "timeout_s", "sequence_parallel_size", "tensor_parallel_size", "expert_parallel_size",
                  "hang_step_floor_s", "hang_first_step_s", "hang_checkpoint_s", "hang_eval_s", "straggler_margin",
                  "straggler_logged_steps")
        self.fixed_hang_step_s()
        if self.hang_watchdog:
            self._check_hang_budgets()
        self.deepspeed_config_path()

    def _check_hang_budgets(self) -> None:
        """Every watchdog budget below ``timeout_s`` (the section's own keys: checked here, not in rules.py)."""
        budgets = {"hang_step_s": self.fixed_hang_step_s(), "hang_step_floor_s": self.hang_step_floor_s,
                   "hang_first_step_s": self.hang_first_step_s, "hang_checkpoint_s": self.hang_checkpoint_s,
                   "hang_eval_s": self.hang_eval_s}
        over = [f"distributed.{key}={value:g}" for key, value in budgets.items()
                if value is not None and value >= self.timeout_s]
        if over:
            raise fail(f"{', '.join(over)} must each be below distributed.timeout_s={self.timeout_s}: the collective's "
                       "timeout would end a hung run first, naming nobody. Lower the budget, or raise "
                       "distributed.timeout_s above it (docs/hangs.md).")

    def fixed_hang_step_s(self) -> Optional[float]:
        """``hang_step_s`` in seconds, or None for auto."""
        if self.hang_step_s.strip().lower() == "auto":
            return None
        try:
            value = float(self.hang_step_s)
        except ValueError:
            value = math.nan
        if not value > 0:
            raise fail(f"distributed.hang_step_s={self.hang_step_s!r} must be auto or a positive number of seconds.")
        return value

    def deepspeed_config_path(self) -> Optional[Path]:
        """The DeepSpeed JSON file, or None: see :func:`resolve_deepspeed_config`."""
        return resolve_deepspeed_config(self.deepspeed_config)

    def uses_autoep(self) -> bool:
        """Whether the MoE layers are DeepSpeed AutoEP's (:attr:`expert_layer`)."""
        return resolved_expert_layer(self.expert_layer, self.expert_parallel_size) == "autoep"

    def uses_deepspeed(self) -> bool:
        """Whether the run trains under DeepSpeed (``deepspeed_config`` names a file), without reading the file."""
        return self.deepspeed_config not in (None, "none", "null")


def autoep_size_of(run_config: dict) -> Optional[int]:
    """The DeepSpeed AutoEP size of a resolved config as saved (``Config.to_dict()``, a checkpoint's ``config``);
    None when its MoE layers are not AutoEP's (or it has none): :meth:`DistributedConfig.uses_autoep` on a dict."""
    dist = run_config.get("distributed", {})
    size, layer = int(dist.get("expert_parallel_size", 1)), dist.get("expert_layer", "auto")
    return size if resolved_expert_layer(layer, size) == "autoep" else None


def resolved_expert_layer(layer: str, expert_parallel_size: int) -> str:
    """``distributed.expert_layer`` as the layer it picks: ``auto`` is AutoEP's above ``expert_parallel_size`` 1 and
    the class's own block (``hf``) at 1."""
    return ("autoep" if expert_parallel_size > 1 else "hf") if layer == "auto" else layer


def resolve_deepspeed_config(value: str | None) -> Optional[Path]:
    """Where ``distributed.deepspeed_config`` points: None for no DeepSpeed.

    A name without ``.json`` (``zero2``) is a file of the repository's ``ds_configs/``; a path is taken as
    given, relative to the working directory, and else relative to the repository root (so a job started
    from another folder finds ``ds_configs/zero2.json``). UserError naming the choices if there is no file.
    """
    if value is None or value in ("none", "null"):
        return None
    candidates = [DS_CONFIG_DIR / f"{value}.json"] if not value.endswith(".json") else [Path(value)]
    if value.endswith(".json") and not Path(value).is_absolute():
        candidates.append(REPO_ROOT / value)
    for path in candidates:
        if path.is_file():
            return path
    names = sorted(f"ds_configs/{p.name}" for p in DS_CONFIG_DIR.glob("*.json"))
    raise fail(
        f"distributed.deepspeed_config={value!r} is not a file. Choose one of {', '.join(names) or 'the files in ds_configs/'} "
        "(or its name alone, e.g. zero2), a path to another DeepSpeed JSON file, or null for no DeepSpeed."
    )
