"""The run's metadata (``run_meta.json``): commit, package versions, hardware, container, world size, precision.
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

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
