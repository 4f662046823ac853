"""What every script shares: clean exits on user errors, and one logging setup."""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Callable

from lmrecipe.errors import EXIT_USER_ERROR, UserError


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
    """Wrap a script's ``main`` so a UserError prints one paragraph on stderr and exits non-zero.

    Under a launcher every rank meets the same bad input; only rank 0 prints it, so the user reads it once.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> int:
        try:
            code = fn(*args, **kwargs)
        except UserError as err:
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"error: {err}", file=sys.stderr, flush=True)
            return EXIT_USER_ERROR
        return 0 if code is None else int(code)

    return wrapper
