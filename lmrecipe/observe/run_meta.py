"""The run's metadata, ``out_dir/run_meta.json``: built, written and amended here only.

At the start (main process): commit, package versions, hardware, container, world size, precision, model and data
facts and the resolved configuration (:func:`write_run_meta`). At the end: how the run ended, under ``outcome``
(:func:`record_outcome`).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
from pathlib import Path

import torch

from lmrecipe.fileio import write_json_atomic

logger = logging.getLogger(__name__)

RUN_META_FILE = "run_meta.json"


def _git_commit() -> str | None:
    """The checkout's commit, or the one a container image was built from (``LMRECIPE_GIT_COMMIT``)."""
    built = os.environ.get("LMRECIPE_GIT_COMMIT")
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or built
    except (OSError, subprocess.SubprocessError):
        return built


IMAGE_ENV = "LMRECIPE_IMAGE"
"""Set in the project's Docker and Apptainer images (``Dockerfile``, ``containers/lmrecipe.def``) to the image's tag."""


def container_info() -> dict | None:
    """The container this process runs in (image tag from the project's images, runtime), or None on the host."""
    runtime = None
    if os.environ.get("APPTAINER_CONTAINER") or os.environ.get("SINGULARITY_CONTAINER"):
        runtime = "apptainer"
    elif Path("/.dockerenv").exists():
        runtime = "docker"
    image = os.environ.get(IMAGE_ENV)
    if runtime is None and image is None:
        return None
    return {"image": image, "runtime": runtime,
            "sif": os.environ.get("APPTAINER_CONTAINER") or os.environ.get("SINGULARITY_CONTAINER")}


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
        "container": container_info(),
        "world_size": world_size,
        "precision": precision,
        **extra,
        "config": config,
    }


def write_run_meta(out_dir: Path, meta: dict) -> None:
    """Write ``run_meta.json`` (main process, at the start of every session of the run)."""
    write_json_atomic(out_dir / RUN_META_FILE, meta)


def record_outcome(out_dir: Path, outcome: dict) -> dict:
    """Add how the run ended to ``run_meta.json`` (under ``outcome``); return the amended metadata."""
    path = out_dir / RUN_META_FILE
    meta = json.loads(path.read_text()) if path.is_file() else {}
    meta["outcome"] = outcome
    write_json_atomic(path, meta)
    return meta
