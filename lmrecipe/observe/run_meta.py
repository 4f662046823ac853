"""The run's metadata, ``out_dir/run_meta.json``: built, written and amended here only.

At the start (main process): commit, package versions, hardware, container, world size, precision, model and data
facts and the resolved configuration (:func:`write_run_meta`), and under ``launches`` one entry per session of the
run (:func:`launch_record`: the command line, the launcher's topology, the step it started at and the checkpoint it
resumed from), the first start's kept by every resume, and the session's events (:func:`record_event`: a
spike's rollback, a stop before ``train.max_steps`` by a preemption's signal or an error). At the end: how the run
ended, under ``outcome`` (:func:`record_outcome`).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

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

    try:  # the installed version, without importing DeepSpeed (about 1.2 s) into a run that does not use it
        ds_version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
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


LAUNCHER_ENV = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "NNODES", "NODE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "LMRECIPE_PROCS_PER_NODE", "SLURM_JOB_ID",
                "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_JOB_NODELIST",
                "CUDA_VISIBLE_DEVICES", "LMRECIPE_JOB_RESTART", "LMRECIPE_JOB_RESTART_REASON")
"""The launcher's variables a session records: its topology, as ``torchrun`` / ``accelerate launch`` and SLURM set it,
and ``slurm/train.sbatch``'s run of the training step again in the same job (after a hang or a lost peer)."""


def launch_record(command: Sequence[str] | None, world_size: int, start_step: int, resumed_from: str | None,
                  environ=os.environ) -> dict:
    """One session's entry of ``run_meta.json``'s ``launches``: the script's command line as launched
    (``command``: its ``sys.argv``, None when training was started from Python), the time, the processes and the
    launcher's variables of :data:`LAUNCHER_ENV`, and where it started."""
    return {"command": list(command) if command is not None else None,
            "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "world_size": world_size, "launcher_env": {k: environ[k] for k in LAUNCHER_ENV if k in environ},
            "start_step": start_step, "resumed_from": resumed_from}


def read_run_meta(out_dir: Path) -> dict:
    """``run_meta.json`` of ``out_dir`` ({} when there is none, or it is unreadable)."""
    path = Path(out_dir) / RUN_META_FILE
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        logger.warning("%s is not valid JSON; its earlier content is not carried over", path)
        return {}


def write_run_meta(out_dir: Path, meta: dict, launch: dict | None = None) -> None:
    """Write ``run_meta.json`` (main process, at the start of every session of the run), ``launch`` appended to the
    earlier sessions' ``launches``. A session that starts at step 0 without a checkpoint starts the list afresh:
    the earlier sessions trained a history this run has dropped."""
    launches = []
    if launch is not None:
        fresh = launch.get("start_step") == 0 and launch.get("resumed_from") is None
        launches = ([] if fresh else read_run_meta(out_dir).get("launches", [])) + [launch]
    write_json_atomic(out_dir / RUN_META_FILE, {**meta, "launches": launches})


def record_event(out_dir: Path, event: dict) -> None:
    """Append ``event`` (``{"kind": "rollback" | "stop", "step", ...}``) to this session's ``launches`` entry."""
    meta = read_run_meta(out_dir)
    if meta.get("launches"):
        meta["launches"][-1].setdefault("events", []).append(event)
        write_json_atomic(out_dir / RUN_META_FILE, meta)


def run_events(meta: dict) -> list[dict]:
    """The events of the history the run kept, ``{"step", "kind", "label"}``: each resume (at the step it resumed
    at), rollback (at the step it went back to) and preemption (at the step it stopped after). An event of a
    session after the step the next session resumed at belongs to a continuation that was dropped, and is left out."""
    launches = meta.get("launches", [])
    events = []
    for i, launch in enumerate(launches):
        if launch.get("resumed_from"):
            events.append({"step": launch["start_step"], "kind": "resume", "label": "resume"})
        until = launches[i + 1].get("start_step") if i + 1 < len(launches) else None
        for event in launch.get("events", []):
            if until is not None and event["step"] > until:
                continue
            if event["kind"] == "rollback":
                events.append({"step": event["step"], "kind": "rollback", "label": "rollback (loss spike)"})
            elif event["kind"] == "stop" and event.get("preempted"):
                events.append({"step": event["step"], "kind": "preemption", "label": "preemption (checkpoint saved)"})
    return events


def record_outcome(out_dir: Path, outcome: dict) -> dict:
    """Add how the run ended to ``run_meta.json`` (under ``outcome``); return the amended metadata."""
    meta = read_run_meta(out_dir)
    meta["outcome"] = outcome
    write_json_atomic(out_dir / RUN_META_FILE, meta)
    return meta
