"""The ``logging`` and ``profile`` sections: metrics, experiment trackers, cost figures and profiled steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from lmrecipe.config.sections.common import positive
from lmrecipe.errors import fail

TrackerName = Literal["wandb", "tensorboard", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio"]


@dataclass
class LoggingConfig:
    log_every_steps: int = 10
    """Write a metrics row and a log line every this many optimizer steps (and at the first and last)."""
    trackers: list[TrackerName] = field(default_factory=list)
    """Experiment trackers, any of wandb, tensorboard, mlflow, comet_ml, aim, clearml, dvclive, swanlab, trackio
    (Accelerate's tracker classes; each tool's own login and environment variables apply, see
    ``lmrecipe/observe/trackers.py``); [] = none. metrics.jsonl is always written."""
    project: str = "lmrecipe"
    """Tracker project (wandb project, MLflow experiment) unless the tool's own variable sets it."""
    run_name: Optional[str] = None
    """Tracker run name; null uses the out_dir's name."""
    progress_bar: bool = True
    """Show a progress bar on the main process."""
    plots: bool = True
    """Draw ``training.png`` (and with ``layer_stats``, ``layers.png``) when the run ends or stops; false leaves
    matplotlib out (about 1.3 s of CPU at the end of each run on a 2-core CPU) and ``report.md`` without the curves."""
    peak_tflops: Optional[float] = None
    """Peak TFLOP/s per device for MFU; null looks the GPU up in a table or probes the CPU with a matmul."""
    cost_per_device_hour: Optional[float] = None
    """Price of one device (GPU, or CPU process) for one hour, for the cost line of ``out_dir/report.md``."""
    measure_model_states: bool = False
    """Measure the bytes of weights, gradients and optimizer states each rank holds, during the second optimizer
    step, into ``out_dir/memory_rank{N}.json`` (``tools/compare_zero.py`` turns it on)."""
    verbose: bool = False
    """Show the start-up and per-checkpoint lines of third-party libraries (torchao, DeepSpeed, Accelerate, torch)
    that are filtered by default; the filtered lines are listed in ``lmrecipe/observe/quiet.py``."""
    layer_stats: bool = False
    """At every logged step, per part of the model (embeddings, each block, the final norm, the output layer): the
    gradient norm before clipping, the parameter norm and the update/parameter ratio (``grad_norm/<part>``,
    ``param_norm/<part>``, ``update_ratio/<part>``), each block's output RMS and the largest absolute logit on one
    micro-batch (``act_rms/<block>``, ``max_abs_logit``); a heat map ``out_dir/layers.png``. Costs one copy of the
    weights a rank owns and (DeepSpeed) one all-reduce at a logged step, nothing at the others
    (``lmrecipe/train/callbacks/layer_stats.py``)."""

    def validate(self) -> None:
        positive(self, "log_every_steps")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise fail(f"logging.peak_tflops={self.peak_tflops} must be positive (or null).")
        if self.cost_per_device_hour is not None and self.cost_per_device_hour < 0:
            raise fail(f"logging.cost_per_device_hour={self.cost_per_device_hour} must be zero or positive (or null).")


@dataclass
class ProfileConfig:
    first_step: Optional[int] = None
    """First optimizer step (1-based, as numbered in metrics.jsonl) run under ``torch.profiler``; null = off."""
    last_step: Optional[int] = None
    """Last profiled step (inclusive); null = ``first_step``."""
    ranks: Literal["all", "main"] = "all"
    """Processes that profile: every rank, or the main process only."""

    def validate(self) -> None:
        if self.first_step is not None and self.first_step < 1:
            raise fail(f"profile.first_step={self.first_step}, profile.last_step={self.last_step}: need "
                       "1 <= first_step <= last_step (optimizer steps, 1-based).")

    def last(self) -> int:
        return self.first_step if self.last_step is None else self.last_step
