"""Every command of README.md and docs/ works as written after ``make demo``.

Each block of commands names what it needs (``tests/doc_commands.py``). The test builds the state ``make demo``
leaves in a copy of the repository's tracked files (``data/stdlib`` from the suite's prepared corpus, then the
Makefile's own ``demo`` target, trained to the end of a shorter schedule by the step cap), then:

- runs every ``title="CPU"`` block with bash (``-e -o pipefail``) from the copy's root, the environment's ``bin``
  first on ``PATH`` and ``LMRECIPE_MAX_STEPS`` set, so every training command trains at most :data:`STEP_CAP`
  optimizer steps per session, unedited (``lmrecipe/train/callbacks/faults.py``); each page's blocks in order, as
  a reader pastes them, in a copy of the demo's state of its own, the pages on :data:`PAGE_WORKERS` workers; a
  page's last blocks are left out when an earlier page ran the same;
- checks the ``GPU`` and ``SLURM`` blocks with ``bash -n`` and runs each of their ``train.py`` commands (and
  ``sbatch slurm/train.sbatch`` jobs) as ``python train.py ARGS --dry-run`` (with :data:`ON_A_CPU`; not those
  that name an ``s3://`` URL), with the launch's process count as ``WORLD_SIZE``; bash expands each line and
  train.py's ``main`` runs it in the test's process (:data:`RECORDER`): the dry run checks the recipe, the
  overrides, the DeepSpeed config and the launch's process count on a CPU. A data folder such a command names that
  the demo does not prepare (the user's own corpus) is stood in for by ``data/stdlib``;
- checks the ``S3`` and ``NET`` blocks with ``bash -n`` only: their dry run would need the endpoint or the hub;
- checks with ``bash -n`` only the CPU blocks of the benchmark and mid-training pages (:data:`NOT_RUN`), those of a
  ZeRO comparison (:data:`RUN_ELSEWHERE`) and those that build the environment or run the suite (``make demo``,
  ``make test``, ...: the state this test starts from, or this test itself).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from doc_commands import Block, all_blocks, pages_to_run, tag_problems, train_dry_runs
from helpers import ROOT, script_main, subprocess_env

pytestmark = pytest.mark.slow

STEP_CAP = 2
"""Optimizer steps a training command of a CPU block trains per session (LMRECIPE_MAX_STEPS)."""
NOT_RUN = ("docs/benchmarks/", "docs/mid-training.md")
"""Pages whose CPU blocks are checked with ``bash -n``, not run: the benchmarks (minutes each, which the step cap
does not shorten) and mid-training, whose commands name the checkpoints of a 200-step run (steps 125 to 250) that a
capped run never writes; tests/unit/test_branch.py, tests/unit/test_schedule_wsd.py and
tests/integration/test_average.py run its branches, lengthened runs and averages."""
RUN_ELSEWHERE = re.compile(r"tools/compare_zero\.py")
"""Commands whose blocks are checked with ``bash -n``, not run: a ZeRO comparison trains every config of the
comparison (each a launch the step cap does not spare); tests/integration/test_compare_zero.py runs it."""
_MAKE_SETUP = re.compile(r"^\s*make\s+(?:demo|test|test-quick|test-unit|venv)\b", re.MULTILINE)
ON_A_CPU = "model.attn_implementation=sdpa"
"""Added to a GPU or SLURM block's dry runs: flash attention needs the GPU, and the dry run on a CPU checks the rest."""
BLOCK_TIMEOUT_S = 600
PAGE_WORKERS = 2
"""Pages whose CPU blocks run at the same time (each in its own copy): the 2 cores of the smallest test machine."""
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
    venv = Path(sys.prefix)
    # The Makefile's own demo target, the environment and the data taken as built (-o: never remade).
    ran = run_bash(root, shlex.join(["make", "demo", f"VENV={venv}", "-o", f"{venv}/.installed", "-o",
                                     "data/stdlib/meta.json"]))
    assert ran.returncode == 0, f"make demo exited {ran.returncode}:\n{ran.output[-TAIL_CHARS:]}"
    assert (root / "runs" / "tiny" / "export" / "config.json").is_file() and (root / "runs/tiny/eval.json").is_file()
    print(f"make demo: {ran.wall_s:.1f} s wall, {ran.cpu_s:.1f} s CPU")
    return root


def not_run(block: Block) -> bool:
    """A CPU block checked with ``bash -n`` only: a benchmark page's, or one that builds the environment."""
    return block.page.startswith(NOT_RUN) or bool(_MAKE_SETUP.search(block.text) or RUN_ELSEWHERE.search(block.text))


def block_env(root: Path) -> dict:
    """The environment of a reader who ran ``source .venv/bin/activate`` in the copy, with the step cap."""
    env = subprocess_env()
    env.update(PYTHONPATH=str(root), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               VIRTUAL_ENV=sys.prefix, LMRECIPE_MAX_STEPS=str(STEP_CAP), HF_HUB_OFFLINE="1")
    return env


@dataclass
class Ran:
    returncode: int
    output: str
    cpu_s: float
    """CPU seconds of the script's processes (bash and every process it waited for)."""
    wall_s: float


def run_bash(root: Path, script: str, *flags: str, env: dict | None = None) -> Ran:
    """``bash FLAGS -c script`` from ``root``, its output and its own CPU time (``wait4``: other threads' runs and
    the machine's other load left out); killed with its process group after :data:`BLOCK_TIMEOUT_S`."""
    start = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.Popen(["bash", *flags, "-c", script], cwd=root, env=env or block_env(root), stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        timer = threading.Timer(BLOCK_TIMEOUT_S, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        out.seek(0)
        return Ran(proc.returncode, out.read(), usage.ru_utime + usage.ru_stime, time.perf_counter() - start)


def failure(block: Block, what: str, ran: Ran, script: str | None = None) -> str:
    return (f"{block.where} ({block.tag} block): {what} exited {ran.returncode}\n--- block\n{block.text}"
            + (f"--- as run\n{script}\n" if script else "") + f"--- output (tail)\n{ran.output[-TAIL_CHARS:]}")


def test_every_cpu_block_runs_after_make_demo(demo, blocks, tmp_path):
    """Each page's CPU blocks in order, in a copy of the demo's state of its own (a page needs only the demo and its
    own earlier blocks); the pages on parallel workers."""
    pages = pages_to_run([block for block in blocks if block.tag == "CPU" and not not_run(block)])

    def run_page(page: str) -> list[tuple[Block, Ran]]:
        root = tmp_path / re.sub(r"\W", "_", page)
        shutil.copytree(demo, root, symlinks=True)
        try:
            return [(block, run_bash(root, block.text, "-e", "-o", "pipefail")) for block in pages[page]]
        finally:
            shutil.rmtree(root, ignore_errors=True)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=PAGE_WORKERS) as pool:
        results = [item for page in pool.map(run_page, pages) for item in page]
    print(f"CPU blocks of {len(pages)} pages: {time.perf_counter() - start:.1f} s wall on {PAGE_WORKERS} workers; "
          "each block's wall and CPU time:\n"
          + "\n".join(f"{ran.wall_s:6.1f} s {ran.cpu_s:6.1f} s  {block.where}" for block, ran in results))
    failures = [failure(block, "the block", ran) for block, ran in results if ran.returncode != 0]
    assert not failures, f"{len(failures)} CPU block(s) failed:\n\n" + "\n\n".join(failures)


def test_every_other_block_parses_and_its_training_commands_pass_the_dry_run(demo, blocks, train_main):
    failures, seen, start, cpu = [], set(), time.perf_counter(), 0.0
    for block in blocks:
        if block.tag not in ("GPU", "SLURM", "S3", "NET") and not (block.tag == "CPU" and not_run(block)):
            continue
        syntax = run_bash(demo, block.text, "-n")
        cpu += syntax.cpu_s
        if syntax.returncode != 0:
            failures.append(failure(block, "bash -n", syntax))
        if block.tag not in ("GPU", "SLURM") or "s3://" in block.text:
            continue  # an s3:// URL's dry run would need the endpoint
        runs = [re.sub(r" --dry-run$", f" {ON_A_CPU} --dry-run", line) for line in train_dry_runs(block.text)]
        script = "\n".join(runs)
        if not runs or script in seen:
            continue
        seen.add(script)
        ran = dry_run(train_main, demo, script)
        cpu += ran.cpu_s
        if ran.returncode != 0:
            failures.append(failure(block, "the dry run of its train.py commands", ran, script))
    print(f"other blocks: {len(seen)} dry-run scripts, {time.perf_counter() - start:.1f} s wall, {cpu:.1f} s CPU")
    assert not failures, f"{len(failures)} block(s) failed:\n\n" + "\n\n".join(failures)


RECORDER = """python() {  # records the call (its environment, then its arguments) for the test's process to run
  __calls=$((${__calls:-0} + 1))
  { env -0; printf '%s\\0' "--arguments--" "$@"; } > "$LMRECIPE_TEST_CALLS/$__calls"
}
"""
"""Prepended to a dry-run script: each ``python train.py ARGS --dry-run`` line, with its assignments, is recorded by
bash as written (variables expanded, quoting resolved, ``NAME=value`` words in the call's environment) instead of
starting an interpreter."""


@pytest.fixture(scope="module")
def train_main():
    """train.py's ``main``, run in this process: one interpreter's imports for every dry run of the docs."""
    return script_main("train.py")


def recorded_calls(root: Path, script: str) -> tuple[Ran, list[tuple[dict, list[str]]]]:
    """``script`` run by bash with :data:`RECORDER`: each call's environment and arguments, in order."""
    with tempfile.TemporaryDirectory() as calls:
        env = {**block_env(root), "LMRECIPE_TEST_CALLS": calls}
        ran = run_bash(root, RECORDER + script, "-e", "-o", "pipefail", env=env)
        recorded = []
        for path in sorted(Path(calls).iterdir(), key=lambda p: int(p.name)):
            words = path.read_bytes().decode().split("\0")[:-1]
            cut = words.index("--arguments--")
            recorded.append((dict(w.split("=", 1) for w in words[:cut] if "=" in w), words[cut + 1:]))
    return ran, recorded


def call_in_process(main, root: Path, env: dict, argv: list[str]) -> tuple[int, str]:
    """``main(argv)`` from ``root`` under ``env`` (the call's environment as bash gave it), its code and output;
    this process's environment and folder restored after."""
    saved_env, saved_cwd, out = dict(os.environ), os.getcwd(), io.StringIO()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(root)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(argv)
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return code, out.getvalue()


def dry_run(main, root: Path, script: str) -> Ran:
    """The dry runs of ``script`` in this process, in order, stopping at the first that fails (``bash -e``); a data
    folder one names that does not exist in the copy is linked to ``data/stdlib`` (a user's own corpus) and the
    script run again."""
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(4):
        ran, calls = recorded_calls(root, script)
        output, code = ran.output, ran.returncode
        for env, argv in calls if code == 0 else ():
            assert argv[0] == "train.py", f"a dry-run script calls python {shlex.join(argv)}"
            code, said = call_in_process(main, root, env, argv[1:])
            output += said
            if code != 0:
                break
        missing = [Path(name) for name in _MISSING_DATA.findall(output)]
        missing = [p for p in missing if not p.is_absolute() and not (root / p).exists() and ".." not in p.parts]
        if code == 0 or not missing:
            break
        for path in missing:
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).symlink_to((root / "data" / "stdlib").resolve(), target_is_directory=True)
    return Ran(code, output, ran.cpu_s + time.process_time() - cpu, time.perf_counter() - start)
