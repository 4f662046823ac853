"""User-facing errors: a message that names the problem and the fix, and the exit code scripts give them."""

from __future__ import annotations

import textwrap

#: Exit code for a user error (bad config, bad data, bad checkpoint): no traceback is printed.
EXIT_USER_ERROR = 2
#: Exit code for a failure that is not the input's: a message, no traceback (and a crash's, with its traceback).
EXIT_FAILURE = 1
#: Exit code of the ranks that outlive a peer process that died (``kill -9``, out of host memory, a lost node): the
#: run may go on from its last checkpoint (``slurm/train.sbatch`` runs it again; a crash's own rank exits 1).
EXIT_LOST_PEER = 4
#: Exit code after Ctrl-C (SIGINT), as shells report a process stopped by it (128 + 2).
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """An error caused by the user's input. Its message names the problem and the fix.

    ``exit_code``: what the script exits with (:data:`EXIT_USER_ERROR` unless :func:`fail` says otherwise).
    """

    exit_code = EXIT_USER_ERROR


def fail(message: str, exit_code: int = EXIT_USER_ERROR) -> "UserError":
    """Build a UserError whose message is dedented and stripped, for readable multi-line errors.

    ``exit_code``: :data:`EXIT_FAILURE` for a stop that is explained but not caused by the input,
    :data:`EXIT_LOST_PEER` for a lost peer.
    """
    err = UserError(textwrap.dedent(message).strip())
    err.exit_code = exit_code
    return err
