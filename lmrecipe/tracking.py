"""Where metrics go: metrics.jsonl always, plus wandb or tensorboard; and the run's metadata file."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


class Tracker:
    """Appends one JSON object per row to ``metrics.jsonl`` and mirrors numeric values to a tracker backend.

    Only the main process writes; other ranks get a Tracker with ``enabled=False`` that does nothing.
    """

    def __init__(self, out_dir: Path, backend: str, project: str, run_name: str, config: dict, enabled: bool):
        self.enabled = enabled
        self.backend = backend
        self._wandb_run = None
        self._tb = None
        self._file = None
        if not enabled:
            return
        self._file = open(out_dir / "metrics.jsonl", "a", buffering=1)  # line-buffered: a crash loses no row
        if backend == "wandb":
            import wandb

            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb_run = wandb.init(
                project=project, name=run_name, dir=str(out_dir), config=config, mode=mode, resume="allow"
            )
            logger.info("wandb run in %s mode under %s", mode, out_dir / "wandb")
        elif backend == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(row) + "\n")
        step = row["step"]
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self._wandb_run is not None:
            self._wandb_run.log(numbers, step=step)
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_metadata(config: dict, world_size: int, precision: str, extra: dict) -> dict:
    """What a person needs to reproduce or compare the run: code, packages, hardware, topology, config."""
    import accelerate
    import transformers

    try:
        import deepspeed

        ds_version = deepspeed.__version__
    except ImportError:
        ds_version = None
    hardware = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        hardware["gpu"] = torch.cuda.get_device_name(0)
        hardware["gpu_count_per_node"] = torch.cuda.device_count()
    return {
        "git_commit": _git_commit(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "accelerate": accelerate.__version__,
            "transformers": transformers.__version__,
            "deepspeed": ds_version,
        },
        "hardware": hardware,
        "world_size": world_size,
        "precision": precision,
        **extra,
        "config": config,
    }
