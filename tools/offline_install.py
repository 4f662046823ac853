"""Install the project's pins on an offline node (an air-gapped cluster) from a pack, with no network.

    bash tools/offline_pack.sh                  # on a machine with PyPI: fills offline/pack (about 37 MB)
    python3 tools/offline_install.py            # on the node, from the repository root: into offline/site
    PYTHONPATH=$PWD/offline/site accelerate launch train.py recipes/llama_1b.yaml

The node brings CPython 3.12 on x86-64 Linux with a CUDA build of torch, numpy and accelerate (a PyTorch container);
the pack holds the rest at the versions ``pyproject.toml`` pins. Everything goes into one folder (``--target``), put
first on ``PYTHONPATH``: the node's torch, accelerate and triton stay, an older transformers is shadowed (hence
``--no-deps`` and the pack's exact file list), and DeepSpeed's sdist is built with ``DS_BUILD_OPS=0`` (no nvcc) and
without build isolation. It installs once: run again with the same pack, it does nothing. ``--check`` checks the
pack against the pins and installs nothing. Exit 2 with the fix for a missing, incomplete or stale pack; 1 when pip
fails.
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACK, SITE = ROOT / "offline" / "pack", ROOT / "offline" / "site"
MARKER = ".installed"


def project_pins() -> dict[str, str]:
    """``name -> version`` of the ``==`` pins of pyproject.toml's dependencies."""
    text = (ROOT / "pyproject.toml").read_text()
    return {m.group(1).lower(): m.group(2) for m in re.finditer(r'"([A-Za-z0-9_.-]+)==([^"]+)"', text)}


def check_pack(pack: Path) -> dict:
    """The pack's file list and pins, checked against pyproject.toml; ValueError naming what is wrong and the fix."""
    if not (pack / "files.txt").is_file():
        raise ValueError(f"{pack} holds no files.txt: it is not a pack. Run bash tools/offline_pack.sh on a machine "
                         "with PyPI and copy the tree with that folder to this node.")
    files = (pack / "files.txt").read_text().split()
    missing = [f for f in files if not (pack / f).is_file()]
    if missing:
        raise ValueError(f"{pack} lacks {', '.join(missing)}: copy it whole, or run tools/offline_pack.sh again.")
    requirements, pins = (pack / "requirements.txt").read_text().split(), project_pins()
    stale = [r for r in requirements if pins.get((pin := r.split("=="))[0].strip().lower()) not in (None, pin[-1].strip())]
    if stale:
        raise ValueError(f"{pack} was packed for {', '.join(stale)}; pyproject.toml pins otherwise: run "
                         "tools/offline_pack.sh again.")
    size_mb = sum((pack / f).stat().st_size for f in files) / 1e6
    return {"files": files, "requirements": requirements, "size_mb": round(size_mb, 1)}


def _digest(pack: Path) -> str:
    return hashlib.sha256((pack / "files.txt").read_bytes() + (pack / "requirements.txt").read_bytes()).hexdigest()


def install(pack: Path, target: Path, log=print) -> dict:
    """Install the pack into ``target`` once (a marker records which pack); RuntimeError with pip's output if pip fails."""
    info = check_pack(pack)
    marker = target / MARKER
    if marker.is_file() and marker.read_text() == _digest(pack):
        return {**info, "installed": "already, by an earlier run"}
    start = time.perf_counter()
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--upgrade", "--target", str(target),
           "--disable-pip-version-check", "--no-warn-conflicts"]
    wheels = [str(pack / f) for f in info["files"] if f.endswith(".whl")]
    sdists = [str(pack / f) for f in info["files"] if not f.endswith(".whl")]
    path = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "DS_BUILD_OPS": "0", "PIP_NO_INPUT": "1"}
    for step, files, flags in (("wheels", wheels, []), ("sdists", sdists, ["--no-build-isolation"])):
        if not files:
            continue
        log(f"install: {len(files)} {step} into {target}")
        proc = subprocess.run([*pip, *flags, *files], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip install of the {step} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
    marker.write_text(_digest(pack))
    return {**info, "installed": f"in {time.perf_counter() - start:.0f} s"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pack", type=Path, default=PACK, help="the folder offline_pack.sh filled (default: %(default)s)")
    parser.add_argument("--target", type=Path, default=SITE, help="where to install (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="check the pack against the pins; install nothing")
    parser.add_argument("--json", action="store_true", help="print what was done as one JSON line (for scripts)")
    args = parser.parse_args(argv)
    log = (lambda text: print(text, file=sys.stderr, flush=True)) if args.json else print
    try:
        info = check_pack(args.pack) if args.check else install(args.pack, args.target.absolute(), log)
    except ValueError as err:
        print(f"offline_install.py: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"offline_install.py: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info))
    elif args.check:
        print(f"{args.pack}: {len(info['files'])} files, {info['size_mb']} MB, at the pins of pyproject.toml")
    else:
        print(f"installed {info['installed']}; run with PYTHONPATH={args.target.absolute()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
