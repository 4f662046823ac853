"""Every command of README.md and docs/ works as written after ``make demo``.

Each block of commands names what it needs (``tests/doc_commands.py``). The test builds the state ``make demo``
leaves in a copy of the repository's tracked files (``data/stdlib`` from the suite's prepared corpus, then the
Makefile's own ``demo`` target, trained to the end of a shorter schedule by the step cap), then:

- runs every ``title="CPU"`` block with bash (``-e -o pipefail``) from the copy's root, the environment's ``bin``
  first on ``PATH`` and ``LMRECIPE_MAX_STEPS`` set, so every training command trains at most :data:`STEP_CAP`
  optimizer steps per session, unedited (``lmrecipe/train/callbacks/faults.py``); the blocks run in page order in
  one copy, as a reader pastes them, identical blocks once;
- checks the ``GPU`` and ``SLURM`` blocks with ``bash -n`` and runs each of their ``train.py`` commands as
  ``python train.py ARGS --dry-run``, with the launcher's process count as ``WORLD_SIZE``: the dry run checks the
  recipe, the overrides, the DeepSpeed config and the launch's process count on a CPU. A data folder such a command
  names that the demo does not prepare (the user's own corpus) is stood in for by ``data/stdlib``;
- checks the ``S3`` and ``NET`` blocks with ``bash -n`` only: their dry run would need the endpoint or the hub;
- checks with ``bash -n`` only the CPU blocks of the benchmark pages (:data:`NOT_RUN`: each a benchmark of minutes
  that the step cap does not shorten) and those that build the environment or run the suite (``make demo``,
  ``make test``, ...: the state this test starts from, or this test itself).
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from doc_commands import Block, all_blocks, tag_problems, train_dry_runs
from helpers import ROOT, subprocess_env

pytestmark = pytest.mark.slow

STEP_CAP = 2
"""Optimizer steps a training command of a CPU block trains per session (LMRECIPE_MAX_STEPS)."""
NOT_RUN = ("docs/benchmarks/",)
"""Pages whose CPU blocks are benchmarks: checked with ``bash -n``, not run."""
_MAKE_SETUP = re.compile(r"^\s*make\s+(?:demo|test|test-quick|test-unit|venv)\b", re.MULTILINE)
BLOCK_TIMEOUT_S = 600
TAIL_CHARS = 3000
_MISSING_DATA = re.compile(r"Data folder '([^']+)' does not exist")


@pytest.fixture(scope="module")
def blocks() -> list[Block]:
    return all_blocks(ROOT)


def test_every_command_block_has_one_known_tag(blocks):
    problems = tag_problems(blocks)
    assert not problems, f"{len(problems)} command block(s) without exactly one known tag:\n" + "\n".join(problems)


@pytest.fixture(scope="module")
def demo(tmp_path_factory, tiny_data) -> Path:
    """A copy of the tracked files in the state ``make demo`` leaves: ``data/stdlib`` prepared (the suite's corpus),
    ``runs/tiny`` trained to its end (capped) with the task scored, its export evaluated."""
    root = tmp_path_factory.mktemp("demo") / "repo"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, tracked.split("\0")):
        source = ROOT / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    shutil.copytree(tiny_data, root / "data" / "stdlib")
    venv, start, cpu = Path(sys.prefix), time.perf_counter(), children_cpu_s()
    # The Makefile's own demo target, the environment and the data taken as built (-o: never remade).
    proc = subprocess.run(["make", "demo", f"VENV={venv}", "-o", f"{venv}/.installed", "-o", "data/stdlib/meta.json"],
                          cwd=root, env=block_env(root), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert proc.returncode == 0, f"make demo exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-TAIL_CHARS:]}"
    assert (root / "runs" / "tiny" / "export" / "config.json").is_file() and (root / "runs/tiny/eval.json").is_file()
    print(f"make demo: {time.perf_counter() - start:.1f} s wall, {children_cpu_s() - cpu:.1f} s CPU")
    return root


def not_run(block: Block) -> bool:
    """A CPU block checked with ``bash -n`` only: a benchmark page's, or one that builds the environment."""
    return block.page.startswith(NOT_RUN) or bool(_MAKE_SETUP.search(block.text))


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children (a block's time without the machine's other load)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def block_env(root: Path) -> dict:
    """The environment of a reader who ran ``source .venv/bin/activate`` in the copy, with the step cap."""
    env = subprocess_env()
    env.update(PYTHONPATH=str(root), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               VIRTUAL_ENV=sys.prefix, LMRECIPE_MAX_STEPS=str(STEP_CAP), HF_HUB_OFFLINE="1")
    return env


def run_bash(root: Path, script: str, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *flags, "-c", script], cwd=root, env=env or block_env(root), capture_output=True,
                          text=True, timeout=BLOCK_TIMEOUT_S)


def failure(block: Block, what: str, proc: subprocess.CompletedProcess, script: str | None = None) -> str:
    out = (proc.stdout + proc.stderr)[-TAIL_CHARS:]
    return (f"{block.where} ({block.tag} block): {what} exited {proc.returncode}\n--- block\n{block.text}"
            + (f"--- as run\n{script}\n" if script else "") + f"--- output (tail)\n{out}")


def test_every_cpu_block_runs_after_make_demo(demo, blocks):
    failures, seen, timings = [], set(), []
    for block in blocks:
        if block.tag != "CPU" or not_run(block) or block.text in seen:
            continue
        seen.add(block.text)
        start, cpu = time.perf_counter(), children_cpu_s()
        proc = run_bash(demo, block.text, "-e", "-o", "pipefail")
        timings.append(f"{time.perf_counter() - start:6.1f} s {children_cpu_s() - cpu:6.1f} s  {block.where}")
        if proc.returncode != 0:
            failures.append(failure(block, "the block", proc))
    print("CPU blocks: wall, CPU time of their processes\n" + "\n".join(timings))
    assert not failures, f"{len(failures)} CPU block(s) failed:\n\n" + "\n\n".join(failures)


def test_every_other_block_parses_and_its_training_commands_pass_the_dry_run(demo, blocks):
    failures, seen, start, cpu = [], set(), time.perf_counter(), children_cpu_s()
    for block in blocks:
        if block.tag not in ("GPU", "SLURM", "S3", "NET") and not (block.tag == "CPU" and not_run(block)):
            continue
        syntax = run_bash(demo, block.text, "-n")
        if syntax.returncode != 0:
            failures.append(failure(block, "bash -n", syntax))
        if block.tag not in ("GPU", "SLURM"):
            continue
        runs = train_dry_runs(block.text)
        script = "\n".join(runs)
        if not runs or script in seen:
            continue
        seen.add(script)
        proc = dry_run(demo, script)
        if proc.returncode != 0:
            failures.append(failure(block, "the dry run of its train.py commands", proc, script))
    print(f"other blocks: {len(seen)} dry-run scripts, {time.perf_counter() - start:.1f} s wall, "
          f"{children_cpu_s() - cpu:.1f} s CPU")
    assert not failures, f"{len(failures)} block(s) failed:\n\n" + "\n\n".join(failures)


def dry_run(root: Path, script: str) -> subprocess.CompletedProcess:
    """``script`` (dry runs) with bash -e; a data folder it names that does not exist in the copy is linked to
    ``data/stdlib`` (a user's own corpus) and the script run again."""
    env = {**block_env(root), "PYTHONWARNINGS": "ignore"}
    for _ in range(4):
        proc = run_bash(root, script, "-e", "-o", "pipefail", env=env)
        missing = [Path(name) for name in _MISSING_DATA.findall(proc.stdout + proc.stderr)]
        missing = [p for p in missing if not p.is_absolute() and not (root / p).exists() and ".." not in p.parts]
        if proc.returncode == 0 or not missing:
            return proc
        for path in missing:
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).symlink_to((root / "data" / "stdlib").resolve(), target_is_directory=True)
    return proc
