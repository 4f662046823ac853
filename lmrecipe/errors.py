"""User-facing errors and the entry-point wrapper that turns them into clean exits."""

from __future__ import annotations

import functools
import sys
import textwrap
from typing import Callable

#: Exit code for a user error (bad config, bad data, bad checkpoint): no traceback is printed.
EXIT_USER_ERROR = 2


class UserError(Exception):
    """An error caused by the user's input. Its message names the problem and the fix."""


def fail(message: str) -> "UserError":
    """Build a UserError whose message is dedented and stripped, for readable multi-line errors."""
    return UserError(textwrap.dedent(message).strip())


def cli_main(fn: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap a script's ``main`` so a UserError prints one paragraph on stderr and exits non-zero."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> int:
        try:
            code = fn(*args, **kwargs)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            return EXIT_USER_ERROR
        return 0 if code is None else int(code)

    return wrapper
