"""User-facing errors: a message that names the problem and the fix, and the exit code scripts give them."""

from __future__ import annotations

import textwrap

#: Exit code for a user error (bad config, bad data, bad checkpoint): no traceback is printed.
EXIT_USER_ERROR = 2


class UserError(Exception):
    """An error caused by the user's input. Its message names the problem and the fix."""


def fail(message: str) -> "UserError":
    """Build a UserError whose message is dedented and stripped, for readable multi-line errors."""
    return UserError(textwrap.dedent(message).strip())
