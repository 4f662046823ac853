"""What every script shares: clean exits on user errors and Ctrl-C, checks of output paths, one logging setup.

Every tool that writes checks its output with :func:`check_tool_output` before any work: never into or over a
training checkpoint or a run folder, never over what the command reads, never over an existing file or folder without
``--overwrite``.
"""

from __future__ import annotations

import functools
import importlib.abc
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from lmrecipe.errors import EXIT_FAILURE, EXIT_INTERRUPTED, UserError, fail
from lmrecipe.fileio import write_json_atomic
from lmrecipe.observe.quiet import maybe_skip_torchao_extensions, quiet

#: Environment variable naming a file where the script records how it ended (``{"exit_code", "error"}``), so a
#: wrapper (``slurm/launch.sh``) can report a rank's exit status and last words, which launchers replace by 1.
EXIT_FILE_ENV = "LMRECIPE_EXIT_FILE"
SHARED_ERROR_WAIT_S = 5.0
"""How long a rank other than 0 waits before ending on a bad input that every rank met (and rank 0 prints)."""


def setup_logging(rank: int | None = None, fmt: str | None = None, stream=None) -> None:
    """INFO on the main process, warnings only on the others; every line says its rank. Third-party lines that say
    nothing about the run are filtered (``lmrecipe/observe/quiet.py``; ``LMRECIPE_VERBOSE=1`` shows them).

    ``rank`` defaults to the launcher's ``RANK`` (0 for a single process).
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=fmt or f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=stream,
    )
    quiet()  # before the libraries are imported: their import-time lines are filtered too


def launched() -> bool:
    """Whether a launcher started this process among others (``WORLD_SIZE`` above 1; a malformed one counts as no)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def cli_main(fn: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap a script's ``main``: a UserError prints one paragraph on stderr and exits with its code (2 for bad
    input), Ctrl-C exits 130 without a traceback.

    Under a launcher every rank meets the same bad input; only rank 0 prints it, so the user reads it once.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> int:
        rank = int(os.environ.get("RANK", "0"))
        error = None
        skip_autotuner_mlflow()
        use_environment_ninja()
        maybe_skip_torchao_extensions()
        quiet()  # a tool that sets up no logging of its own still drops the lines of lmrecipe/observe/quiet.py
        try:
            code = fn(*args, **kwargs)
            code = 0 if code is None else int(code)
        except UserError as err:
            error, code = str(err), err.exit_code
            if rank == 0 or code != 2:  # a bad input is every rank's; any other stop is this rank's own
                print(f"error: {err}", file=sys.stderr, flush=True)
            elif launched():
                time.sleep(SHARED_ERROR_WAIT_S)  # the launcher stops every rank as soon as one ends: rank 0 first
        except KeyboardInterrupt:
            error, code = "interrupted (Ctrl-C)", EXIT_INTERRUPTED
            if rank == 0:
                print("Interrupted (Ctrl-C): stopped. Nothing half-written is left; run the command again to start "
                      "over.", file=sys.stderr, flush=True)
        except BrokenPipeError:  # the reader of stdout went away (`train.py --list-keys | head`): not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit fails otherwise
            code = 0
        except SystemExit as err:  # a clean stop that chose its code (preemption: 124), or argparse's
            if err.code is not None and not isinstance(err.code, int):  # a message: Python prints it, exit 1
                record_exit(rank, 1, str(err.code))
                raise
            code = err.code or 0
        except Exception as err:
            # A crash: recorded before this process exits, so the lost peer the other ranks then see (exit 4) is not
            # taken for the cause, and slurm/train.sbatch does not run a crash again.
            record_exit(rank, EXIT_FAILURE, f"{type(err).__name__}: {err}", crash=True)
            raise
        record_exit(rank, code, error)
        return code

    return wrapper


def exit_launched(code: int) -> None:
    """End this process with ``code``; a launched rank (``WORLD_SIZE`` above 1) whose run succeeded (0) without the
    interpreter's teardown.

    Python's own exit first: the threads that are not daemons are joined, the exit handlers run (loggers, trackers,
    temporary folders) and the streams are flushed; then the process ends. DeepSpeed's ZeRO-3 hooks keep the model, and
    with it the process groups and their gloo threads, alive to the end, and a rank whose run had ended and written
    everything has been seen to abort while Python tore those down (SIGABRT, "terminate called without an active
    exception"), which fails the whole launch. Any other exit keeps Python's: a rank that ends early on a shared bad
    input must not hurry the launcher into stopping rank 0 before it prints the error."""
    if code != 0 or not launched():
        sys.exit(code)
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, or a stream closed by a handler
            pass
    os._exit(code)


class _AutotunerMlflowSkip(importlib.abc.MetaPathFinder):
    """Refuses the import of mlflow that DeepSpeed's autotuner makes when DeepSpeed is imported (Accelerate imports
    DeepSpeed in every process, the launcher's too); any other import of mlflow (the mlflow tracker's) goes ahead."""

    module = "deepspeed.autotuning.autotuner"

    def find_spec(self, name, path=None, target=None):
        if name == "mlflow":
            frame = sys._getframe(1)
            for _ in range(16):  # the importing module's frame lies a few import-machinery frames up
                if frame is None:
                    break
                if frame.f_globals.get("__name__") == self.module:
                    raise ModuleNotFoundError(f"mlflow is not imported for {self.module}", name=name)
                frame = frame.f_back
        return None


def skip_autotuner_mlflow() -> None:
    """Spare this process DeepSpeed's autotuner's import of mlflow: where mlflow is installed it costs about 1.5 s of
    every process's start (most of ``import deepspeed``), and the recipe never runs the autotuner, the only user of
    that import (it then logs nothing to mlflow, which it would not anyway)."""
    if not any(isinstance(finder, _AutotunerMlflowSkip) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AutotunerMlflowSkip())


def use_environment_ninja() -> None:
    """Put this Python environment's ``bin`` first on ``PATH`` when it holds a ``ninja``, as activating it would.

    torch compiles DeepSpeed's ops with the first ``ninja`` on ``PATH``. The environment's (pip's ``ninja``) and a
    system one (Debian's ``ninja-build``) are different versions that keep incompatible build logs in the same
    ``TORCH_EXTENSIONS_DIR``: a run started with the other one first compiled every op again, a minute of CPU each,
    whenever runs from an activated and a non-activated shell (``.venv/bin/python train.py``) alternated."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if os.path.isfile(os.path.join(bin_dir, "ninja")) and path.split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, path]) if path else bin_dir


def record_exit(rank: int, code: int, error: str | None, crash: bool = False) -> None:
    """Write ``{"exit_code", "error", "rank", "crash"}`` to ``$LMRECIPE_EXIT_FILE``: rank 0's, or the first failing
    rank's; a crash's (an exception with its traceback) is kept over any later record: it is the cause."""
    path = os.environ.get(EXIT_FILE_ENV)
    if not path or (rank != 0 and not crash and (code == 0 or Path(path).exists())) or _crash_recorded(path):
        return
    try:
        write_json_atomic(path, {"exit_code": code, "error": error, "rank": rank, "crash": crash})
    except OSError:
        pass  # the status file is a courtesy to the wrapper; the exit code itself still says it


def _crash_recorded(path: str) -> bool:
    try:
        return bool(json.loads(Path(path).read_text()).get("crash"))
    except (OSError, ValueError, AttributeError):
        return False


def check_output_path(path: str | os.PathLike, option: str, folder: bool = True) -> Path:
    """UserError unless ``path`` can be created as a folder (``folder``) or written as a file: it is not the
    wrong kind of thing, no part of the path above it is a file, and this user may write where it is created (the
    folder itself when it exists, else the nearest existing folder above it)."""
    path = Path(path)
    kind, other = ("folder", "file") if folder else ("file", "folder")
    if path.exists() and path.is_dir() != folder:
        raise fail(f"{option} {path} is a {other}, not a {kind}. Choose another path, or move the {other} away.")
    for parent in path.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise fail(f"{option} {path} lies under {parent}, which is a file, not a folder. Choose a path "
                           "whose parent folders are folders.")
            break
    anchor = path if folder else path.parent  # a file is replaced by a rename in its folder
    written = next(p for p in (anchor, *anchor.parents) if p.exists())
    if not os.access(written, os.W_OK | os.X_OK):  # also a read-only file system, for every user
        what = "" if written == path else f" ({written}, where it would be created)"
        raise fail(f"{option} {path} cannot be written{what}: that folder is read-only for this user. Choose a "
                   "folder this user may write, or give it write permission (chmod u+w, or remount read-write).")
    return path


# The names that mark a run's folders. This module sits below checkpoint/ and observe/, so it names them itself;
# tests/unit/test_faults.py holds them equal to the constants of the modules that write the files.
CHECKPOINT_STATE_FILE = "train_state.json"
"""What makes a folder a training checkpoint (``lmrecipe.checkpoint.storage.STATE_FILE``)."""
RUN_CHECKPOINTS_DIR = "checkpoints"
RUN_POINTERS = ("latest", "best")
RUN_RECORD_FILES = ("config.yaml", "metrics.jsonl")
"""A run folder (a run's ``out_dir``) holds both of these, or a ``checkpoints/`` with a checkpoint or a pointer."""
RUN_FILES = frozenset({*RUN_RECORD_FILES, "run_meta.json", "final.json", "report.md", "spikes.jsonl", "training.png",
                       "preempted.json", "run.lock", "wandb_run_id", "mlflow_run_id", "goodput.json"})
"""The files a run writes at its top level: no tool writes over them, even with ``--overwrite``."""


def training_folder_kind(path: Path) -> str | None:
    """``"checkpoint"`` or ``"run folder"`` when ``path`` is one (module constants), else None."""
    if (path / CHECKPOINT_STATE_FILE).is_file():
        return "checkpoint"
    if all((path / name).is_file() for name in RUN_RECORD_FILES):
        return "run folder"
    checkpoints = path / RUN_CHECKPOINTS_DIR
    if checkpoints.is_dir() and (any((checkpoints / name).is_file() for name in RUN_POINTERS)
                                 or any(p.is_dir() for p in checkpoints.glob("step_*"))):
        return "run folder"
    return None


def _training_folder_below(folder: Path) -> tuple[str, Path] | None:
    """The first checkpoint or run folder inside ``folder`` (any depth; links are not followed), or None."""
    for root, dirs, _ in os.walk(folder):
        for name in sorted(dirs):
            kind = training_folder_kind(Path(root) / name)
            if kind is not None:
                return kind, Path(root) / name
    return None


def check_tool_output(path: str | os.PathLike, option: str, *, folder: bool = True, overwrite: bool | None = False,
                      reads: Sequence[str | os.PathLike] = ()) -> Path:
    """UserError, before any work, unless a tool can write ``path`` (a folder, or a file when not ``folder``) without
    destroying anything: :func:`check_output_path`, and the path

    - is not a training checkpoint nor inside one (its ``train_state.json`` lists every file it holds);
    - is not a run folder nor its ``checkpoints/``, nor one of the run's own files (:data:`RUN_FILES`); a new file or
      folder inside a run folder is fine (the run's exports live there);
    - is none of ``reads`` (what the command reads) and holds none of them;
    - exists only with ``overwrite`` (a file, or a folder that is not empty), and then holds no checkpoint or run
      folder at any depth, since the replacement deletes them. ``overwrite=None`` leaves an existing folder to the
      caller, which fills it piece by piece and checks what each piece replaces (a shard set, a comparison).
    """
    path = check_output_path(path, option, folder)
    target = path.resolve()
    for candidate in (target, *target.parents):
        if (candidate / CHECKPOINT_STATE_FILE).is_file():
            where = "is" if candidate == target else "lies inside"
            raise fail(f"{option} {path} {where} the training checkpoint {candidate}: writing there would change the "
                       f"files its {CHECKPOINT_STATE_FILE} lists, and resuming, exporting or evaluating it would then "
                       "fail. Choose a path outside the checkpoint, e.g. a new folder beside the run.")
    if training_folder_kind(target):
        raise fail(f"{option} {path} is the folder of a training run (it holds {RUN_CHECKPOINTS_DIR}/ or "
                   f"{' and '.join(RUN_RECORD_FILES)}): writing there would mix with or replace the run's checkpoints, "
                   f"metrics and config. Choose a new folder; one inside the run folder is fine (e.g. "
                   f"{path / 'my_output'}).")
    for candidate in (target, *target.parents):
        if candidate.name == RUN_CHECKPOINTS_DIR and training_folder_kind(candidate.parent):
            where = "is" if candidate == target else "lies inside"
            raise fail(f"{option} {path} {where} the checkpoints folder of the training run {candidate.parent}: its "
                       f"checkpoints and their {' and '.join(RUN_POINTERS)} pointers are the run's to write. Choose a "
                       f"path outside it (e.g. {candidate.parent / 'my_output'}).")
    if not folder and target.name in RUN_FILES and training_folder_kind(target.parent):
        raise fail(f"{option} {path} is the run's own {target.name} (in the run folder {target.parent}): writing it "
                   "would replace the run's record. Choose another file name.")
    for source in reads:
        read = Path(source).resolve()
        if read == target or target in read.parents:
            raise fail(f"{option} {path} {'is' if read == target else 'holds'} {source}, which this command reads: "
                       "writing it would destroy the command's own input. Choose a path elsewhere.")
    if not (path.exists() or path.is_symlink()):
        return path
    if not folder or any(path.iterdir()):
        if overwrite is False:
            what = "already exists" if not folder else "already exists and is not empty"
            raise fail(f"{option} {path} {what}. Pass --overwrite to replace it, or choose another path.")
        if folder and overwrite and (held := _training_folder_below(target)) is not None:
            kind, found = held
            raise fail(f"{option} {path} holds the {kind} {found}: replacing the folder would delete it. Choose a "
                       f"folder that holds no training run or checkpoint, or move {found} out of it first.")
    return path
