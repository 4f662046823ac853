"""What an offline GPU node lacks, installed from the packed folder (``bench/gpu/pack.sh``) with no network.

Everything goes into one folder (``--target``) first on the kit's ``PYTHONPATH``, so the node's own torch,
accelerate and triton stay and an older transformers is shadowed (hence ``--no-deps`` and the pack's exact file
list). DeepSpeed's sdist is built there with ``DS_BUILD_OPS=0`` (no nvcc) and without build isolation.
"""

import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = ".installed"


def project_pins() -> dict[str, str]:
    """``name -> version`` of the ``==`` pins of pyproject.toml's dependencies."""
    text = (ROOT / "pyproject.toml").read_text()
    return {m.group(1).lower(): m.group(2) for m in re.finditer(r'"([A-Za-z0-9_.-]+)==([^"]+)"', text)}


def check_packed(packed: Path) -> dict:
    """The packed folder's file list and pins, checked against pyproject.toml; ValueError naming what is wrong."""
    if not (packed / "files.txt").is_file():
        raise ValueError(f"{packed} holds no files.txt, so nothing is installed: the environment's packages are "
                         "measured (for an offline node, run bash bench/gpu/pack.sh on a machine with PyPI)")
    files = (packed / "files.txt").read_text().split()
    missing = [f for f in files if not (packed / f).is_file()]
    if missing:
        raise ValueError(f"{packed} lacks {', '.join(missing)}: run bash bench/gpu/pack.sh again")
    requirements, pins = (packed / "requirements.txt").read_text().split(), project_pins()
    stale = [r for r in requirements if pins.get((pin := r.split("=="))[0].strip().lower()) not in (None, pin[-1].strip())]
    if stale:
        raise ValueError(f"{packed} was packed for {', '.join(stale)}, pyproject.toml pins otherwise: run pack.sh again")
    size_mb = sum((packed / f).stat().st_size for f in files) / 1e6
    return {"files": files, "requirements": requirements, "size_mb": round(size_mb, 1)}


def _digest(packed: Path) -> str:
    return hashlib.sha256((packed / "files.txt").read_bytes() + (packed / "requirements.txt").read_bytes()).hexdigest()


def pythonpath(target: Path | None) -> str:
    parts = [*([str(target)] if target else []), str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(part for part in parts if part)  # the pack, the package, the benchmarks' _common.py


def install(packed: Path, target: Path, log) -> dict:
    """Install the packed files into ``target`` (once: a marker records what was installed)."""
    info = check_packed(packed)
    marker = target / MARKER
    if marker.is_file() and marker.read_text() == _digest(packed):
        return {**info, "installed": "already, by an earlier run"}
    start = time.perf_counter()
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--upgrade", "--target", str(target),
           "--disable-pip-version-check", "--no-warn-conflicts"]
    wheels = [str(packed / f) for f in info["files"] if f.endswith(".whl")]
    sdists = [str(packed / f) for f in info["files"] if not f.endswith(".whl")]
    env = {**os.environ, "PYTHONPATH": pythonpath(target), "DS_BUILD_OPS": "0", "PIP_NO_INPUT": "1"}
    for step, files, flags in (("wheels", wheels, []), ("sdists", sdists, ["--no-build-isolation"])):
        log(f"install: {len(files)} {step} into {target}")
        proc = subprocess.run([*pip, *flags, *files], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip install of the {step} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
    marker.write_text(_digest(packed))
    return {**info, "installed": f"in {time.perf_counter() - start:.0f} s"}
