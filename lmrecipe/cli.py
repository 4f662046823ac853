"""What every script shares: clean exits on user errors and Ctrl-C, checks of output paths, one logging setup."""

from __future__ import annotations

import functools
import importlib.abc
import logging
import os
import sys
from pathlib import Path
from typing import Callable

from lmrecipe.errors import EXIT_INTERRUPTED, UserError, fail
from lmrecipe.fileio import write_json_atomic

#: Environment variable naming a file where the script records how it ended (``{"exit_code", "error"}``), so a
#: wrapper (``slurm/launch.sh``) can report a rank's exit status and last words, which launchers replace by 1.
EXIT_FILE_ENV = "LMRECIPE_EXIT_FILE"


def setup_logging(rank: int | None = None, fmt: str | None = None, stream=None) -> None:
    """INFO on the main process, warnings only on the others; every line says its rank.

    ``rank`` defaults to the launcher's ``RANK`` (0 for a single process).
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=fmt or f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=stream,
    )


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
        try:
            code = fn(*args, **kwargs)
            code = 0 if code is None else int(code)
        except UserError as err:
            error, code = str(err), err.exit_code
            if rank == 0 or code != 2:  # a bad input is every rank's; any other stop is this rank's own
                print(f"error: {err}", file=sys.stderr, flush=True)
        except KeyboardInterrupt:
            error, code = "interrupted (Ctrl-C)", EXIT_INTERRUPTED
            if rank == 0:
                print("Interrupted (Ctrl-C): stopped. Nothing half-written is left; run the command again to start "
                      "over.", file=sys.stderr, flush=True)
        except SystemExit as err:  # a clean stop that chose its code (preemption: 124), or argparse's
            if err.code is not None and not isinstance(err.code, int):  # a message: Python prints it, exit 1
                _record_exit(rank, 1, str(err.code))
                raise
            code = err.code or 0
        _record_exit(rank, code, error)
        return code

    return wrapper


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


def _record_exit(rank: int, code: int, error: str | None) -> None:
    """Write ``{"exit_code", "error"}`` to ``$LMRECIPE_EXIT_FILE``: rank 0's, or the first failing rank's."""
    path = os.environ.get(EXIT_FILE_ENV)
    if not path or (rank != 0 and (code == 0 or Path(path).exists())):
        return
    try:
        write_json_atomic(path, {"exit_code": code, "error": error, "rank": rank})
    except OSError:
        pass  # the status file is a courtesy to the wrapper; the exit code itself still says it


def check_output_path(path: str | os.PathLike, option: str, folder: bool = True) -> Path:
    """UserError unless ``path`` can be created as a folder (``folder``) or written as a file: it is not the
    wrong kind of thing, and no part of the path above it is a file."""
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
    return path
